"""The thread pools of a node process (sps_driving/ros/nodes/__init__.py): numpy's OpenBLAS on one
thread, whose idle workers would otherwise spin beside the extractor's threads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import sps_driving

SOURCE_ROOT = Path(sps_driving.__file__).resolve().parent.parent
BLAS_THREADS = """
import ctypes, sys
if sys.argv[1] == "node":
    import sps_driving.ros.nodes.policy  # as `python -m sps_driving.ros.nodes.policy` and `ros2 run` load it
import numpy
lib = ctypes.CDLL(next(line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower() and ".so" in line))
print(next(getattr(lib, name) for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                                           "openblas_get_num_threads") if hasattr(lib, name))())
"""


def blas_threads(kind: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    return int(subprocess.run([sys.executable, "-c", BLAS_THREADS, kind], capture_output=True, text=True, check=True,
                              cwd=SOURCE_ROOT, env=env).stdout)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS runs one thread on one core anyway")
def test_a_node_process_runs_numpy_on_one_blas_thread():
    assert blas_threads("plain") == min(os.cpu_count(), 64) > 1  # numpy alone: a thread per core
    assert blas_threads("node") == 1
