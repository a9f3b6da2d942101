"""One thin rclpy node per executable: `sps_driving.ros.nodes.<name>.main`, each named in
sps_driving.ros.executables.NODES."""

import os

# Thread pools of every node process, set here, before a node module loads numpy or torch. Idle
# workers of numpy's OpenBLAS spin after each product, and torch's OpenMP threads after each op,
# for 100s of ms: on a few cores, beside the extractor's threads, that spinning takes the CPU they
# need. Measured (docs/results/bench_cpu.md): the extractor node at 1.57x its standalone time with
# the policy node's OOD score on and OpenBLAS at its default threads, 1.13x with one; the policy
# node's torch at 20 ms of CPU a frame for 2 ms of work without PASSIVE.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
