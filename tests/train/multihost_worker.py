"""One process of a multi-process CPU run (used by test_multihost.py, not collected)."""

import json
import os
import sys

process_id, num_processes, port, workdir, out = sys.argv[1:6]
race_folder = sys.argv[6] if len(sys.argv) > 6 else None  # a division race on this folder
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.train import test_multihost  # noqa: E402

# The config's own path: distributed=True and the cluster section (ncljax.cluster).
cluster = {
    "coordinator_address": f"localhost:{port}",
    "num_processes": int(num_processes),
    "process_id": int(process_id),
}
if race_folder is None:
    results = test_multihost.run(workdir, cluster)
else:
    results = test_multihost.run_race(workdir, cluster, race_folder)
with open(out, "w") as f:
    json.dump(results, f)
