"""Exports made on first use: the export cache's entries (where they are: core/backbones/runtimes.py,
`cached_export_dir`), and the int8 backbone graph of an export.

A token-dropping entry (tokens kept) is checked at every patch (rate 1.0) and at a seeded half of
them, whose descriptors depend on which patches are kept.

An entry is built in a scratch folder beside it (the ONNX export of the torch extractor, then its
parity against torch fp32, PARITY_FILE) and renamed into place, so a reader sees a complete entry
or none, whatever happens to the builder. Builders of one entry take turns on a lock file (fcntl),
so several processes starting at once (a graph's nodes, evaluation workers) export it once; a
folder left by a builder that was killed is removed by the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np

from sps_driving.core.backbones.runtimes import (
    INT8_FILES,
    PARITY_FILE,
    cached_export_dir,
    load_runtime_extractor,
    quantized_graph,
    read_export,
)

PARITY_TOLERANCE = 1e-4  # max |descriptor difference| for the export to stand in for torch fp32
PARITY_FRAME = (600, 960, 3)  # px, a camera frame's size
PARITY_SEED = 0
PARITY_HALF = 0.5  # token dropping: the kept fraction of the second check
SCRATCH_PREFIX = ".building-"


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on `path` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def torch_reference(config: dict):
    """The fp32 torch extractor on the CPU that an export is made from and checked against."""
    from sps_driving.core.backbones.loader import load_extractor

    return load_extractor({**config, "backend": "torch", "precision": "fp32", "device": "cpu", "dtype": "float32",
                           "export_dir": None})


def parity_subsets(extractor) -> list[np.ndarray]:
    """The patch sets a parity check asks for: every patch, and for token dropping (whose
    descriptors depend on the kept set) also a seeded half of them."""
    n = extractor.grid.n
    subsets = [np.arange(n)]
    if getattr(extractor, "drops_tokens", False):
        rng = np.random.default_rng(PARITY_SEED)
        subsets.append(np.sort(rng.choice(n, max(1, round(PARITY_HALF * n)), replace=False)))
    return subsets


def parity(reference, runtime, images: list | None = None, tolerance: float = PARITY_TOLERANCE) -> dict:
    """The descriptors of `runtime` against `reference` on `images` (default: one seeded random
    camera frame), of every patch (`parity_subsets`: token dropping also a seeded half): max
    |difference|, cosines, relative error |got - expected| / |expected| (per frame and patch set;
    mean and max), descriptor scale, and ok (max |difference| within tolerance)."""
    if images is None:
        images = [np.random.default_rng(PARITY_SEED).integers(0, 256, PARITY_FRAME, dtype=np.uint8)]
    diff, cosines, relative, scale = 0.0, [], [], 0.0
    for image, indices in ((image, indices) for image in images for indices in parity_subsets(reference)):
        expected = reference.descriptors(reference.encode(image), indices)
        got = runtime.descriptors(runtime.encode(image), indices)
        diff = max(diff, float(np.abs(got - expected).max()))
        norms = np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1) + 1e-12
        cosines.append(np.sum(got * expected, 1) / norms)
        relative.append(float(np.linalg.norm(got - expected) / np.linalg.norm(expected)))
        scale = max(scale, float(np.abs(expected).max()))
    cosines = np.concatenate(cosines)
    return {"frames": len(images), "max_abs_diff": diff, "min_cosine": float(cosines.min()),
            "mean_cosine": float(cosines.mean()), "relative_error": float(np.mean(relative)),
            "max_relative_error": float(np.max(relative)), "descriptor_scale": scale, "tolerance": tolerance,
            "ok": diff <= tolerance}


def parity_of(config: dict, reference=None) -> dict:
    """Parity of the onnxruntime export at config's export_dir (fp32) against torch."""
    runtime = load_runtime_extractor({**config, "backend": "onnxruntime", "precision": "fp32", "device": "cpu"})
    return parity(reference or torch_reference(config), runtime)


def ensure_export(config: dict) -> Path:
    """The export cache's entry of `config` (DINOv2), exported and checked now if it is missing."""
    from sps_driving.export.onnx_export import export_onnx

    entry = cached_export_dir(config)
    if entry.is_dir():
        return entry
    with _locked(entry.parent / f".{entry.name}.lock"):
        if entry.is_dir():  # built by another process while this one waited
            return entry
        for stale in entry.parent.glob(f"{SCRATCH_PREFIX}{entry.name}-*"):  # a killed builder's
            shutil.rmtree(stale, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{entry.name}-", dir=entry.parent))
        try:
            reference = torch_reference(config)
            with warnings.catch_warnings():  # the tracer's notes on constant shapes, for whoever exports by hand
                warnings.simplefilter("ignore")
                export_onnx(reference, scratch)
            record = parity_of({**config, "export_dir": str(scratch)}, reference)
            (scratch / PARITY_FILE).write_text(json.dumps(record, indent=2) + "\n")
            scratch.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache_dir from other users
            os.rename(scratch, entry)
        except OSError:
            shutil.rmtree(scratch, ignore_errors=True)
            if not entry.is_dir():  # else: another builder's rename came first (a lock that did not hold)
                raise
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    return entry


def ensure_int8(export_dir: Path) -> Path:
    """export_dir's graph with the ViT's layers (runtimes.quantized_graph: dense, the backbone graph;
    token dropping, the per-patch graph) with onnxruntime's dynamic int8 quantization (weights int8,
    the activations' scale computed per call), made now if it is missing; returns its path."""
    export_dir = Path(export_dir)
    source = quantized_graph(read_export(export_dir, {"export_dir": str(export_dir)}))
    target = export_dir / INT8_FILES[source]
    if target.is_file():
        return target
    with _locked(export_dir / ".int8.lock"):
        if target.is_file():
            return target
        quantize_int8(export_dir / source, target)
    return target


def quantize_int8(source: Path, target: Path) -> None:
    """Write `source` quantized (dynamic int8, MatMul weights per channel) to `target`, atomically."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX, dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        root.setLevel(logging.ERROR)  # the quantizer's advice on static pre-processing, which dynamic does not use
        try:
            quantize_dynamic(str(source), str(partial), weight_type=QuantType.QInt8, per_channel=True,
                             op_types_to_quantize=["MatMul"])
        finally:
            root.setLevel(level)
        os.replace(partial, target)
