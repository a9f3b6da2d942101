"""The CPU code path of the math libraries, pinned where a closed loop would amplify its last bits.

A closed-loop episode feeds each command back into the next camera frame, so one rounding
difference in a frame's forward becomes another trajectory a few frames later, and another score
for the cell. MKL, oneDNN and ATen pick their kernels by the CPU's instruction set: measured on an
AVX-512 machine, the shipped policy on one layout (urban day with an animal, 10 s) drives the same
trajectory run after run, and another one from the third frame on with MKL or oneDNN held to their
AVX2 paths. Evaluations and DAgger roll-outs therefore pin all three to AVX2, a path every CPU
with AVX2 runs (for MKL, with the same results: its conditional numerical reproducibility), at no
measured cost there (21.6-22.4 s for that episode either way). A variable already set is kept, so
`MKL_CBWR=AUTO` (and the like) turns the pin off. The car and the benchmarks run the fastest path.
"""

from __future__ import annotations

import os
from pathlib import Path

PINNED = {"MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def pin() -> None:
    """Set the pins this process and its children read; call before torch runs its first op."""
    for name, value in PINNED.items():
        os.environ.setdefault(name, value)


def describe() -> str:
    """The math path this process runs, for a result's provenance: ATen's dispatch level, the pins
    as set, and the CPU model."""
    import torch

    pins = ", ".join(f"{name}={os.environ.get(name, 'unset')}" for name in PINNED)
    return f"ATen {torch.backends.cpu.get_cpu_capability()} ({pins}) on {cpu_model()}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
