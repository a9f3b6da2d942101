"""The kind of CPU a closed-loop result was driven on.

A closed-loop episode feeds each command back into the next camera frame, so one rounding
difference in a frame's forward becomes another trajectory a few frames later, and another score
for the cell. The kernels that round differently are chosen by the CPU's instruction set: ATen,
MKL and oneDNN (measured: holding MKL or oneDNN to their AVX2 paths on an AVX-512 host drives the
shipped policy on another trajectory from the third frame on) and onnxruntime's MLAS, which has no
switch. Pinning the first three to AVX2 would cost 1.5x on the backbone's torch forward (305 against
455-480 ms a 448x280 frame on one thread) and would still leave onnxruntime's. So a result is
reproducible bit for bit on a host of the same kind, and every evaluated episode records which
kind that was (`describe`).
"""

from __future__ import annotations

import functools
from pathlib import Path

ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile")  # the ones kernels dispatch on


def describe() -> str:
    """'<CPU model>; <ISA flags present>; ATen <its dispatch level>', e.g. for a row's `host`."""
    import torch

    model, flags = _cpuinfo()
    present = " ".join(f for f in ISA_FLAGS if f in flags) or "none of " + " ".join(ISA_FLAGS)
    return f"{model}; {present}; ATen {torch.backends.cpu.get_cpu_capability()}"


@functools.cache  # read once per process, not once per episode
def _cpuinfo() -> tuple[str, frozenset[str]]:
    import platform

    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = frozenset(value.split())
                break
    except OSError:
        pass
    return model, flags
