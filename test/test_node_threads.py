"""The thread pools of a node process (sps_driving.ros.nodes.common.quiet_thread_pools): numpy's
OpenBLAS on one thread, whose idle workers would otherwise spin beside the extractor's threads; and
importing a node module changes nothing of the importing process (eval workers, tests)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sps_driving

SOURCE_ROOT = Path(sps_driving.__file__).resolve().parent.parent
BLAS_THREADS = """
import json
import os
import numpy
from threadpoolctl import threadpool_info
import sps_driving.ros.nodes.policy  # as `ros2 run` and `python -m` load a node
from sps_driving.ros.nodes.common import quiet_thread_pools

def openblas():
    return [pool["num_threads"] for pool in threadpool_info() if pool["internal_api"] == "openblas"]

imported = {"openblas": openblas(), "env": sorted(k for k in ("OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ)}
quiet_thread_pools()  # what every node's `run` does first
print(json.dumps({"imported": imported, "quiet": openblas(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS runs one thread on one core anyway")
def test_a_node_process_runs_numpy_on_one_blas_thread_and_an_import_changes_nothing():
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY")}
    out = json.loads(subprocess.run([sys.executable, "-c", BLAS_THREADS], capture_output=True, text=True, check=True,
                                    cwd=SOURCE_ROOT, env=env).stdout)
    cores = min(os.cpu_count(), 64)
    assert out["imported"]["openblas"] and set(out["imported"]["openblas"]) == {cores}  # numpy's (and scipy's): a thread per core
    assert out["imported"]["env"] == []  # importing a node module leaves the process as it was
    assert out["quiet"] == [1] * len(out["imported"]["openblas"]) and out["omp_wait_policy"] == "PASSIVE"
