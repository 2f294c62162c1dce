"""Reading a compiled XLA program: FLOPs with loop trip counts, and a profile by kind.

``compiled.cost_analysis()`` counts the body of a ``while`` loop once, whatever its trip
count, and a ``conditional`` as its most expensive branch; the SGRAF step is a loop over
caption chunks (and the Bi-GRU a loop over words), so its figure is several times too
small. ``program_flops`` walks the compiled HLO text instead: every ``dot`` costs
``2 x prod(output) x prod(contracted dims)``, every other array instruction one FLOP
per output element (elementwise work), a loop body counts ``known_trip_count`` times,
and a conditional's branches count with the given weights (the fraction of the loop's
iterations that take each; default: the most expensive branch every time; ``'cheapest'``:
the least expensive, e.g. a step whose conds skip a term no pair needs).

``profile_by_kind`` runs the step under ``jax.profiler`` and adds up the time of every
executed HLO instruction (the CPU and GPU runtimes name their events after them),
classified by what the instruction computes:

* ``gru``: everything inside the ``gru`` named scope (the Bi-GRU's recurrent scan);
* ``matmul``: a ``dot`` or a fusion around one;
* ``softmax/norms``: fusions with exponentials, logarithms, square roots, divisions or
  reductions (softmax, L2 and BatchNorm normalisation, loss reductions);
* ``elementwise``: everything else (elementwise fusions, copies, transposes, slices,
  gathers, scatters, collectives).
"""

from __future__ import annotations

import collections
import glob
import math
import re
import tempfile

_COMP = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"^[a-z][a-z0-9]*\[([0-9,]*)\]")
_ARRAYS = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([0-9,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}
_GRU = re.compile(r"(^|[/(])gru([/)]|$)")


def _weights(branch_weights, costs: list[float]) -> list[float]:
    """Each branch's weight: ``branch_weights[len(costs)]``, or all on the costliest branch
    (the default) or on the cheapest (``branch_weights='cheapest'``)."""
    if branch_weights != "cheapest":
        weights = (branch_weights or {}).get(len(costs))
        if weights is not None:
            return list(weights)
    pick = min(costs) if branch_weights == "cheapest" else max(costs)
    first = costs.index(pick)
    return [float(i == first) for i in range(len(costs))]


_CONTROL = {"while", "conditional", "call", "tuple", "get-tuple-element", "parameter"}
_NORM_OPS = {"exponential", "log", "sqrt", "rsqrt", "divide", "reduce", "logistic", "tanh"}
_FREE_OPS = _CONTROL | {"constant", "bitcast", "after-all", "partition-id", "replica-id"}


class Instruction:
    __slots__ = ("computation", "name", "op", "rest", "shape")

    def __init__(self, name, shape, op, rest, computation):
        self.name, self.shape, self.op, self.rest = name, shape, op, rest
        self.computation = computation

    def dims(self) -> list[int] | None:
        m = _ARRAY.match(self.shape)
        if not m:
            return None
        return [int(d) for d in m.group(1).split(",") if d]

    def nbytes(self) -> int:
        """Bytes of the value(s) the instruction produces (every array of a tuple)."""
        total = 0
        for dtype, dims in _ARRAYS.findall(self.shape):
            bits = _BITS.get(dtype) or int(dtype[1:])
            total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
        return total

    def operands(self) -> list[str]:
        head = self.rest.split(")", 1)[0]
        return re.findall(r"%([^\s,()]+)", head)

    def attr(self, key: str) -> str | None:
        m = re.search(key + r"=\{?([^}\s]*)\}?", self.rest)
        return m.group(1) if m else None

    def callees(self) -> list[str]:
        names = re.findall(r"(?:calls|to_apply|body|condition)=%([^\s,}]+)", self.rest)
        m = re.search(r"branch_computations=\{([^}]*)\}", self.rest)
        if m:
            names += re.findall(r"%([^\s,}]+)", m.group(1))
        for key in ("true_computation", "false_computation"):
            names += re.findall(key + r"=%([^\s,}]+)", self.rest)
        return names

    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.rest)
        return m.group(1) if m else ""


class Program:
    """The computations and instructions of a compiled HLO module (``compiled.as_text()``)."""

    def __init__(self, text: str):
        self.computations: dict[str, list[Instruction]] = {}
        self.instructions: dict[str, Instruction] = {}
        self.entry = None
        current = None
        for line in text.splitlines():
            m = _COMP.match(line)
            if m:
                current = m.group(1)
                self.computations[current] = []
                if line.startswith("ENTRY"):
                    self.entry = current
                continue
            if current is None:
                continue
            m = _INSTR.match(line)
            if m:
                ins = Instruction(*m.groups(), current)
                self.computations[current].append(ins)
                self.instructions[ins.name] = ins

    def dot_flops(self, ins: Instruction) -> float:
        out = ins.dims() or []
        lhs = self.instructions.get(ins.operands()[0])
        lhs_dims = lhs.dims() if lhs else None
        contract = ins.attr("lhs_contracting_dims")
        k = 1
        if lhs_dims is not None and contract:
            k = math.prod(lhs_dims[int(i)] for i in contract.split(",") if i)
        return 2.0 * math.prod(out) * k

    def cost(self, name: str, branch_weights=None, _memo=None) -> dict[str, float]:
        """``{'matmul': FLOPs, 'other': FLOPs}`` of one execution of computation ``name``."""
        memo = {} if _memo is None else _memo
        if name in memo:
            return memo[name]
        total = collections.Counter()
        for ins in self.computations.get(name, []):
            if ins.op == "dot":
                total["matmul"] += self.dot_flops(ins)
            elif ins.op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.rest)
                n = int(trips.group(1)) if trips else 1
                body = re.search(r"body=%([^\s,}]+)", ins.rest).group(1)
                for k, v in self.cost(body, branch_weights, memo).items():
                    total[k] += n * v
            elif ins.op == "conditional":
                branches = [self.cost(b, branch_weights, memo) for b in ins.callees()]
                weights = _weights(branch_weights, [sum(c.values()) for c in branches])
                for w, c in zip(weights, branches, strict=True):
                    for k, v in c.items():
                        total[k] += w * v
            elif ins.op in ("fusion", "call"):
                for callee in ins.callees():
                    for k, v in self.cost(callee, branch_weights, memo).items():
                        total[k] += v
            elif ins.op not in _FREE_OPS:
                dims = ins.dims()
                if dims is not None:
                    total["other"] += math.prod(dims)
        memo[name] = dict(total)
        return memo[name]

    def flops(self, branch_weights=None) -> dict[str, float]:
        return self.cost(self.entry, branch_weights)

    def traffic(self, name: str | None = None, branch_weights=None, _memo=None) -> float:
        """Bytes one execution of computation ``name`` (the entry) moves through memory: every
        executed kernel (a fusion, a ``dot``, any other array instruction at a
        computation's top level) reads its operands and writes its outputs once, what it
        slices or updates in place only as large as the slice; a fusion's inside stays in
        registers and cache. Loops and conditionals count as in
        :meth:`cost`. A lower bound on the traffic of the program as compiled (a kernel that
        reads an operand twice, or spills, moves more), the roofline's memory side."""
        name = self.entry if name is None else name
        memo = {} if _memo is None else _memo
        if name in memo:
            return memo[name]
        total = 0.0
        for ins in self.computations.get(name, []):
            if ins.op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.rest)
                n = int(trips.group(1)) if trips else 1
                body = re.search(r"body=%([^\s,}]+)", ins.rest).group(1)
                total += n * self.traffic(body, branch_weights, memo)
            elif ins.op == "conditional":
                branches = [self.traffic(b, branch_weights, memo) for b in ins.callees()]
                weights = _weights(branch_weights, branches)
                total += sum(w * b for w, b in zip(weights, branches, strict=True))
            elif ins.op == "call":
                for callee in ins.callees():
                    total += self.traffic(callee, branch_weights, memo)
            elif ins.op not in _FREE_OPS:
                total += self._kernel_traffic(ins)
        memo[name] = total
        return total

    def _kernel_traffic(self, ins: Instruction) -> float:
        """One executed kernel's bytes: its outputs and operands once, except what it only
        slices (a ``dynamic-slice`` or ``slice`` reads its slice, not the whole operand)
        and what it updates in place (a ``dynamic-update-slice`` writes its update, and its
        buffer is not read): a loop over the rows of a matrix reads each row once, not the
        matrix once per trip."""
        operands = [self.instructions.get(o) for o in ins.operands()]
        read = [o.nbytes() if o is not None else 0 for o in operands]
        written = ins.nbytes()
        if ins.op in ("dynamic-slice", "slice") and read:
            read[0] = written
        elif ins.op == "dynamic-update-slice" and len(read) > 1:
            read[0], written = 0, read[1]
        elif ins.op == "fusion" and ins.callees():
            body = self.computations.get(ins.callees()[0], [])
            params = {
                int(m.group(1)): i.name
                for i in body
                if i.op == "parameter" and (m := re.match(r"(\d+)\)", i.rest))
            }
            root = body[-1] if body else None
            for k, param in params.items():
                if k >= len(read):
                    continue
                users = [i for i in body if param in i.operands()]
                if users and all(
                    i.op in ("dynamic-slice", "slice") and i.operands()[0] == param for i in users
                ):
                    read[k] = sum(i.nbytes() for i in users)
                if (
                    root is not None
                    and root.op == "dynamic-update-slice"
                    and root.operands()[0] == param
                ):
                    update = self.instructions.get(root.operands()[1])
                    read[k] = 0
                    written = update.nbytes() if update is not None else written
        return written + sum(read)

    def _contains(self, name: str, ops: set, seen=None) -> bool:
        seen = set() if seen is None else seen
        if name in seen:
            return False
        seen.add(name)
        for ins in self.computations.get(name, []):
            if ins.op in ops:
                return True
            if ins.op == "fusion" and any(self._contains(c, ops, seen) for c in ins.callees()):
                return True
        return False

    def kind(self, ins: Instruction) -> str | None:
        """The profile category of an executed instruction (``None``: control flow)."""
        if ins.op in _CONTROL:
            return None
        if _GRU.search(ins.op_name()):
            return "gru"
        if ins.op in ("dot", "convolution"):
            return "matmul"
        if ins.op == "fusion":
            callees = ins.callees()
            if any(self._contains(c, {"dot", "convolution"}) for c in callees):
                return "matmul"
            if any(self._contains(c, _NORM_OPS) for c in callees):
                return "softmax/norms"
            return "elementwise"
        if ins.op in _NORM_OPS:
            return "softmax/norms"
        if ins.op == "custom-call" and re.search(r"matmul|gemm|dot", ins.rest, re.I):
            return "matmul"
        return "elementwise"


KINDS = ("matmul", "softmax/norms", "gru", "elementwise")


def profile_by_kind(
    program: Program, run, top: list | None = None, stems: dict | None = None
) -> dict[str, float]:
    """Seconds per kind of executed instruction over one call of ``run`` (traced); with a
    list ``top``, appends the 15 costliest instructions to it as
    ``(seconds, kind, name, op_name)``; with a dict ``stems``, adds each instruction's time
    and calls under its name without the numeric suffix (``wrapped_reduce-window.108`` ->
    ``wrapped_reduce-window``: the instructions of one kind of kernel, summed) as
    ``stems[stem] = [seconds, calls]``."""
    import jax

    directory = tempfile.mkdtemp(prefix="ncljax_profile_")
    with jax.profiler.trace(directory):
        run()
    files = glob.glob(directory + "/**/*.xplane.pb", recursive=True)
    data = jax.profiler.ProfileData.from_file(files[0])
    seconds, per_instruction = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                ins = program.instructions.get(event.name)
                if ins is None:
                    continue
                kind = program.kind(ins)
                if kind is not None:
                    seconds[kind] += event.duration_ns * 1e-9
                    per_instruction[ins.name] += event.duration_ns * 1e-9
                    if stems is not None:
                        entry = stems.setdefault(re.sub(r"\.\d+$", "", ins.name), [0.0, 0])
                        entry[0] += event.duration_ns * 1e-9
                        entry[1] += 1
    if top is not None:
        for name, t in per_instruction.most_common(15):
            ins = program.instructions[name]
            top.append((round(t, 3), program.kind(ins), name, ins.op_name()[-120:]))
    return {k: seconds.get(k, 0.0) for k in KINDS}
