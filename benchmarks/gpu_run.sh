#!/usr/bin/env bash
# One call on a lent GPU machine: the SGRAF step figures of benchmarks/step_profile.py and a
# small robustness sweep (methods x noise rates on one synthetic world), within a time budget.
#
# Run from the repository root, with the wheels of the packages the GPU image lacks in .whl/
# (ott-jax, jaxopt, grain, array-record, portpicker, ml-collections; see the end of this
# header), e.g. through the device tool with carry [".whl"] and a timeout of 540 s:
#
#   bash benchmarks/gpu_run.sh
#
# Every part runs under `timeout`, so the script ends within GPU_RUN_BUDGET seconds (default
# 500) whatever happens, and prints a short summary table last. What comes back in $OUT
# (at most 8 files, none in a folder):
#   gpu_run.log        everything this script printed
#   profile.jsonl      one JSON line per step_profile case (pairs_per_s, seconds, GFLOP, ...)
#   sweep_summary.csv  one row per sweep run: status, test rSum, val rSum, noise AUC, fallbacks
#   report_pairs.{md,csv,png}  ncljax.report's tables and plot of the sweep
#   logs.tar.gz        every log, metrics.jsonl, results.json and config.json (no checkpoints)
#
# Steps, in order (GPU_RUN_STEPS, space-separated): sgr (the vse train step with the SGR head
# at batch 128), peak (the measured matrix-product peak), sweep, gsc (the GSC step at batch
# 96), eval (one SGR evaluation block; the implied Flickr30K test time), sgr_bf16 (the SGR
# step with bfloat16 matrix products). A step starts only while time is left; each is cut at
# its cap or at the budget's end.
#
# Settings (environment): PYTHON (python3), OUT (/tmp/gpu_run_out), GPU_RUN_BUDGET (500),
# GPU_RUN_STEPS, GPU_RUN_PROFILE_ARGS (extra step_profile flags; default --repeats=10),
# GPU_RUN_WORLD (small_global), GPU_RUN_METHODS (vse,infonce,ncr,gsc,srem,ugncl,pc2),
# GPU_RUN_RATES (0.4,0.6,0), GPU_RUN_SEEDS (0), GPU_RUN_JOBS (runs at a time, 11),
# GPU_RUN_MEM_FRACTION (GPU memory cap per sweep run, 0.07), GPU_RUN_SWEEP_CAP (seconds,
# 240), GPU_RUN_SET (space-separated field=value overrides for every sweep run, e.g.
# "train.epochs=3" for a smoke test, one epoch past the pairs methods' warm-ups; 5 for the
# labels family), GPU_RUN_FAMILY (pairs; labels sweeps the noisy-label methods on the
# labels worlds through ncljax.report).
#
# Local smoke test on a CPU (no GPU: the profile runs at a tiny batch):
#   OUT=/tmp/gpuprep/out PYTHON=/tmp/gpuvenv/bin/python GPU_RUN_PROFILE_ARGS="--batch=4
#   --repeats=1" GPU_RUN_METHODS=vse,ncr GPU_RUN_RATES=0,0.6 GPU_RUN_JOBS=1
#   GPU_RUN_SET=train.epochs=3 bash benchmarks/gpu_run.sh
#
# The wheels (Python 3.12, manylinux x86_64), fetched here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl ott-jax==0.6.0 jaxopt==0.8.5 grain==0.2.18 \
#     array_record==0.8.6 portpicker==1.6.0 ml_collections==1.1.0
# Everything else the synthetic path imports is in the image (jax 0.11.2 with the CUDA 13
# plugin, flax, optax, orbax-checkpoint, lineax, equinox, etils, ...); tensorflow-datasets
# and nltk are imported only by the real-data builders and are not needed here.

set -u
START=$SECONDS
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_run_out}
BUDGET=${GPU_RUN_BUDGET:-500}
STEPS=${GPU_RUN_STEPS:-sgr peak sweep gsc eval sgr_bf16}
PROFILE_ARGS=${GPU_RUN_PROFILE_ARGS:---repeats=10}
WORLD=${GPU_RUN_WORLD:-small_global}
METHODS=${GPU_RUN_METHODS:-vse,infonce,ncr,gsc,srem,ugncl,pc2}
RATES=${GPU_RUN_RATES:-0.4,0.6,0}
SEEDS=${GPU_RUN_SEEDS:-0}
JOBS=${GPU_RUN_JOBS:-11}
MEM_FRACTION=${GPU_RUN_MEM_FRACTION:-0.07}
SWEEP_CAP=${GPU_RUN_SWEEP_CAP:-240}
SETS=${GPU_RUN_SET:-}
FAMILY=${GPU_RUN_FAMILY:-pairs}
RESERVE=25  # seconds kept for the summary and the tar at the end
LOGS=/tmp/gpu_run_logs
RUNS=/tmp/gpu_run_sweep

mkdir -p "$OUT"
rm -rf "$LOGS" "$RUNS"
mkdir -p "$LOGS" "$RUNS"
exec > >(tee -a "$OUT/gpu_run.log") 2>&1
export PYTHONUNBUFFERED=1

left() { echo $((BUDGET - RESERVE - (SECONDS - START))); }
cap() {  # the smaller of $1 and the time left
    local l
    l=$(left)
    if ((l < $1)); then echo "$l"; else echo "$1"; fi
}
say() { echo "## [$((SECONDS - START)) s] $*"; }

# --- the carried wheels ---------------------------------------------------------------------
if compgen -G ".whl/*.whl" >/dev/null; then
    say "installing $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "wheel install failed"; exit 1; }
else
    say "no .whl/ here: using the packages the interpreter has"
fi
export PYTHONPATH=/tmp/site:$PWD

# --- the machine ----------------------------------------------------------------------------
say "machine"
if command -v nvidia-smi >/dev/null; then
    timeout 20 nvidia-smi
    timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
        --format=csv
else
    echo "nvidia-smi: not found (no NVIDIA GPU here)"
fi
timeout 120 "$PY" - <<'EOF' 2>&1 | tee "$LOGS/versions.txt"
import importlib.metadata as md, platform, os
print("python", platform.python_version(), "cores", os.cpu_count())
for p in ("jax", "jaxlib", "jax-cuda13-plugin", "flax", "optax", "orbax-checkpoint", "chex",
          "numpy", "scipy", "protobuf", "ott-jax", "jaxopt", "lineax", "equinox", "grain",
          "array-record", "ml-collections", "etils"):
    try:
        print(f"  {p} {md.version(p)}")
    except md.PackageNotFoundError:
        print(f"  {p} (not installed)")
import jax
print("jax backend:", jax.default_backend(), jax.devices())
open("/tmp/gpu_run_logs/gpu", "w").write(str(int(jax.default_backend() == "gpu")))
import ncljax.train, ncljax.methods  # everything train.py imports
print("ncljax imports: ok")
EOF
GPU=$(cat "$LOGS/gpu" 2>/dev/null || echo 0)
((GPU == 1)) || echo "NO GPU: the figures below are not GPU figures"

# --- step_profile cases ----------------------------------------------------------------------
profile() {  # name, cap in seconds, step_profile flags...
    local name=$1 limit
    limit=$(cap "$2")
    shift 2
    if ((limit < 15)); then
        say "profile $name: skipped, $(left) s left"
        echo "{\"case\": \"$name\", \"status\": \"skipped\"}" >>"$OUT/profile.jsonl"
        return
    fi
    say "profile $name (limit ${limit} s): step_profile.py $* $PROFILE_ARGS"
    # shellcheck disable=SC2086
    timeout -k 10 "$limit" "$PY" benchmarks/step_profile.py "$@" $PROFILE_ARGS \
        >"$LOGS/profile_$name.out" 2>"$LOGS/profile_$name.err"
    local rc=$?
    local line
    line=$(grep '^{' "$LOGS/profile_$name.out" | tail -1)
    if [[ $rc == 0 && -n $line ]]; then
        "$PY" -c "import json,sys; d=json.loads(sys.argv[1]); d['name']=sys.argv[2]; print(json.dumps(d))" \
            "$line" "$name" >>"$OUT/profile.jsonl"
        "$PY" -c "import json,sys; d=json.loads(sys.argv[1]); print({k: d.get(k) for k in ('pairs', 'seconds', 'pairs_per_s', 'gflops_achieved', 'peak_float32_gflops', 'peak_bfloat16_gflops', 'memory_temp_gib')})" "$line"
        return
    fi
    local why="exit $rc"
    ((rc == 124 || rc == 137)) && why="timed out after ${limit} s"
    echo "profile $name FAILED ($why); last lines of its stderr:"
    tail -5 "$LOGS/profile_$name.err"
    limit=$(cap 120)
    if [[ $name != peak && $name != eval ]] && ((rc != 124 && rc != 137 && limit >= 30)); then
        # the same step timed without the profiler trace and FLOP count (a CUPTI failure, say)
        say "profile $name: timing only (limit ${limit} s)"
        # shellcheck disable=SC2086
        line=$(timeout -k 10 "$limit" "$PY" - "$name" "$@" $PROFILE_ARGS <<'PYEOF' 2>>"$LOGS/profile_$name.err" | grep '^{' | tail -1
import argparse, json, statistics, sys
sys.path.insert(0, "benchmarks")
p = argparse.ArgumentParser()
p.add_argument("--case", default="sgr")
p.add_argument("--batch", type=int, default=0)
p.add_argument("--length", type=int, default=16)
p.add_argument("--chunk", type=int, default=16)
p.add_argument("--groups", type=int, default=4)
p.add_argument("--remat", default="auto")
p.add_argument("--dtype", default="float32")
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--xla-defaults", action="store_true")
args, _ = p.parse_known_args(sys.argv[2:])
import step_profile as sp
_, run, pairs, _ = sp.build_train(args, args.case)
times = sp.timed(run, warmup=1, repeats=max(args.repeats, 3))
t = statistics.median(times)
print(json.dumps({"case": args.case, "name": sys.argv[1], "timing_only": True, "pairs": pairs,
                  "seconds": t, "seconds_range": [min(times), max(times)],
                  "pairs_per_s": pairs / t, "settings": vars(args)}))
PYEOF
        )
        if [[ -n $line ]]; then
            echo "$line" >>"$OUT/profile.jsonl"
            echo "$line"
            return
        fi
        echo "profile $name: timing only FAILED too"
    fi
    echo "{\"case\": \"$name\", \"status\": \"$why\"}" >>"$OUT/profile.jsonl"
}

# --- the sweep -------------------------------------------------------------------------------
sweep() {
    local limit
    limit=$(cap "$SWEEP_CAP")
    if ((limit < 30)); then
        say "sweep: skipped, $(left) s left"
        return
    fi
    # several train.py processes share the GPU: no preallocation, each capped
    export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM_FRACTION
    local sets=()
    for s in $SETS; do sets+=("--set=$s"); done
    if [[ -z ${GPU_RUN_NO_REPORT:-} ]] && "$PY" -c "import ncljax.report" >/dev/null 2>&1; then
        say "sweep (limit ${limit} s) through ncljax.report: world $WORLD, methods $METHODS," \
            "rates $RATES, seeds $SEEDS, $JOBS at a time"
        timeout -k 10 "$limit" "$PY" -m ncljax.report --out="$RUNS" --worlds="$WORLD" \
            --family="$FAMILY" --methods="$METHODS" --rates="$RATES" --seeds="$SEEDS" --jobs="$JOBS" "${sets[@]}"
        local rc=$?
        echo "ncljax.report exit $rc"
        if ((rc == 124 || rc == 137)); then  # cut by the timeout: tabulate what finished
            timeout 60 "$PY" -m ncljax.report --out="$RUNS" --family="$FAMILY" --aggregate_only >/dev/null 2>&1
        fi
        cp "$RUNS"/report_*.* "$OUT"/ 2>/dev/null
    else
        say "sweep (limit ${limit} s), plain train.py runs (no ncljax.report):" \
            "world $WORLD, methods $METHODS, rates $RATES, seeds $SEEDS, $JOBS at a time"
        local extra=""
        for s in $SETS; do extra+=" --config.$s"; done
        for r in ${RATES//,/ }; do
            for s in ${SEEDS//,/ }; do
                for m in ${METHODS//,/ }; do
                    echo "$m $r $s"
                done
            done
        done | timeout -k 10 "$limit" xargs -P "$JOBS" -L 1 bash -c '
            m=$1 r=$2 s=$3
            d='"$RUNS"'/runs/pairs/$m/'"$WORLD"'/rate$(printf %g "$r")/seed$s
            mkdir -p "$d"
            if [[ $(printf %g "$r") == 0 ]]; then n="--config.noise.kind=none --config.noise.rate=0.0"
            else n="--config.noise.rate=$r --config.noise.seed=$s"; fi
            t0=$SECONDS
            '"$PY"' train.py --config=configs/$m.py:synthetic,world='"$WORLD"' $n \
                --config.seed=$s'"$extra"' --workdir="$d" >"$d/log.txt" 2>&1
            rc=$?
            echo "{\"returncode\": $rc, \"wall_s\": $((SECONDS - t0))}" >"$d/gpu_run.json"
            echo "$m rate $r seed $s: exit $rc ($((SECONDS - t0)) s)"' _
    fi
    unset XLA_PYTHON_CLIENT_PREALLOCATE XLA_PYTHON_CLIENT_MEM_FRACTION
}

for step in $STEPS; do
    case $step in
        sgr) profile sgr 150 --case=sgr ;;
        peak) profile peak 45 --case=peak ;;
        gsc) profile gsc 150 --case=gsc ;;
        saf) profile saf 150 --case=saf ;;
        eval) profile eval 90 --case=eval ;;
        sgr_bf16) profile sgr_bf16 120 --case=sgr --dtype=bfloat16 ;;
        sweep) sweep ;;
        *) echo "unknown step $step" ;;
    esac
done

# --- summary ---------------------------------------------------------------------------------
say "summary"
tar czf "$OUT/logs.tar.gz" --exclude=checkpoints -C /tmp "$(basename "$LOGS")" \
    "$(basename "$RUNS")" 2>/dev/null
timeout 20 "$PY" - "$OUT" "$RUNS" "$GPU" "$METHODS" <<'EOF'
import csv, glob, json, os, re, sys

out, runs, gpu, order = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4].split(",")
rows = []
if os.path.exists(f"{out}/profile.jsonl"):
    rows = [json.loads(line) for line in open(f"{out}/profile.jsonl") if line.strip()]
peak = next((r for r in rows if r.get("case") == "peak" and "peak_float32_gflops" in r), {})
print("\n### step_profile" + ("" if gpu else " (NO GPU)") + (f": {peak['machine']}" if peak else ""))
if peak:
    print(f"peak float32 {peak['peak_float32_gflops']:,.0f} GFLOP/s"
          + (f", bfloat16 {peak['peak_bfloat16_gflops']:,.0f}" if "peak_bfloat16_gflops" in peak else ""))
print("| case | batch | s/step | pairs/s | GFLOP exec | GFLOP/s | of fp32 peak | XLA args+temp GiB |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    if r.get("case") == "peak":
        continue
    if "pairs_per_s" not in r:
        print(f"| {r.get('name', r.get('case'))} | {r.get('status')} |||||||")
        continue
    frac = (f"{100 * r['gflops_achieved'] / peak['peak_float32_gflops']:.0f}%"
            if peak else "")
    if r.get("timing_only"):
        print(f"| {r['name']} | {r['pairs']} | {r['seconds']:.4f} | {r['pairs_per_s']:,.0f} | "
              "timing only (no profile) ||||")
        continue
    print(f"| {r['name']} | {r['pairs']} | {r['seconds']:.4f} | {r['pairs_per_s']:,.0f} | "
          f"{r['gflop_executed']:,.0f} | {r['gflops_achieved']:,.0f} | {frac} | "
          f"{r['memory_args_gib']:.2f}+{r['memory_temp_gib']:.2f} |")
    if r["case"] == "eval":
        print(f"|   eval: Flickr30K test (5M pairs) {5e6 / r['pairs_per_s']:.1f} s |||||||")

table = []
for d in sorted(glob.glob(f"{runs}/runs/pairs/*/*/rate*/seed*")):
    method, world, rate, seed = d.split("/")[-4:]
    row = dict(world=world, method=method, rate=rate[4:], seed=seed[4:], status="unfinished",
               wall_s="", test_rsum="", val_rsum="", best_epoch="", noise_auc="",
               fallback_warnings=0, fallback_epochs=0)
    if os.path.exists(f"{d}/results.json"):
        res = json.load(open(f"{d}/results.json"))
        row.update(status="ok", test_rsum=round(res.get("rsum", float("nan")), 1),
                   val_rsum=round(res.get("val_rsum", float("nan")), 1),
                   best_epoch=res.get("best_epoch", ""),
                   noise_auc=round(res["noise_auc"], 3) if "noise_auc" in res else "")
    rec = f"{d}/report_run.json"
    rec = rec if os.path.exists(rec) else f"{d}/gpu_run.json"  # ncljax.report's or the loop's
    if os.path.exists(rec):
        rr = json.load(open(rec))
        row["wall_s"] = round(rr.get("wall_s", 0))
        if rr.get("returncode"):
            row["status"] = f"exit {rr['returncode']}"
    log = f"{d}/log.txt"
    if os.path.exists(log):
        text = open(log, errors="replace").read()
        row["fallback_warnings"] = len(re.findall(r"fallback", text, re.I))
        if row["status"] == "unfinished" and "Traceback" in text:
            row["status"] = "failed"
    epochs = set()
    if os.path.exists(f"{d}/metrics.jsonl"):
        for line in open(f"{d}/metrics.jsonl"):
            try:
                m = json.loads(line)
            except ValueError:
                continue
            if any(k.endswith("division_fallback") and v for k, v in m.items()):
                epochs.add(m.get("epoch"))
    row["fallback_epochs"] = len(epochs)
    table.append(row)
if table:
    with open(f"{out}/sweep_summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    rates = sorted({r["rate"] for r in table}, key=float)
    print(f"\n### sweep on {table[0]['world']}: test rSum (noise AUC) [fallback epochs]; wall s")
    print("| method | " + " | ".join(f"rate {r}" for r in rates) + " |")
    print("|---" * (len(rates) + 1) + "|")
    names = {r["method"] for r in table}
    for method in [m for m in order if m in names] + sorted(names - set(order)):
        cells = []
        for rate in rates:
            rs = [r for r in table if r["method"] == method and r["rate"] == rate]
            cell = []
            for r in rs:
                if r["status"] != "ok":
                    cell.append(r["status"])
                    continue
                c = f"{r['test_rsum']}"
                c += f" ({r['noise_auc']})" if r["noise_auc"] != "" else ""
                c += f" [{r['fallback_epochs']}]" if r["fallback_epochs"] else ""
                c += f"; {r['wall_s']} s" if r["wall_s"] != "" else ""
                cell.append(c)
            cells.append(", ".join(cell) or "-")
        print(f"| {method} | " + " | ".join(cells) + " |")
else:
    print("\n### sweep: no run directory")
EOF
say "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
