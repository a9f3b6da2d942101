"""The extractor a node or tool runs: where each extraction setting comes from, and what "auto" runs.

Every extraction setting (the keys of config/extraction.yaml) comes from the first of, highest first:

1. a node parameter or command-line option (the extractor node's backend, backbone, model_path,
   device; `--backbone`, `--device`, ... of the tools);
2. the policy checkpoint (`checkpoint`): what its descriptors are (DESCRIPTOR_KEYS: backbone,
   input size, region of interest, masked layer, mask) and where its weights were (WEIGHTS_KEYS);
   a checkpoint that records no roi was trained on the whole frame (roi null);
3. the settings file (the node's backbone_config, `--backbone-config`, `--extractor-config`);
4. config/extraction.yaml.

A checkpoint wins every descriptor key it records: a node parameter or file that gives another
value is an error (ExtractionConflict), since the policy would get descriptors it was not trained
on (a policy trained on dense descriptors, tokens all, refuses token-dropped ones, tokens kept, and
the other way round). For every other key a higher source wins over a lower one that gives another value, and the
settings carry a warning naming both values. A checkpoint's runtime keys (backend, device, ...)
say how its feature cache was computed, not what this machine should run: they are not read.

Backend "auto" (the default) is the fastest backend that gives the same descriptors: on the CPU
the onnxruntime export of the model when it matches torch within PARITY_TOLERANCE (made on first
use into the export cache, sps_driving/export/cache.py, and checked there once), else torch; on a
GPU tensorrt when its engines are built, else torch; torch for what only torch computes
(pixels, falloff none, BLIP-2). `open_extractor` says which it runs and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sps_driving.core.backbones import (
    ALL_TOKENS,
    AUTO,
    DESCRIPTOR_KEYS,
    WEIGHTS_KEYS,
    resolve_config,
    resolve_device,
    runtime_facts,
    torch_only_reason,
)
from sps_driving.core.backbones.loader import load_extractor
from sps_driving.core.overlay import FrameOverlay

PARAMETER = "node parameter"
DEFAULTS = "config/extraction.yaml"
# What the extractor node reports with every frame's timing (and the replay report and bench show).
FACT_KEYS = ("backend", "runtime", "precision", "threads")


class ExtractionConflict(ValueError):
    """Two sources give a descriptor setting different values and the checkpoint is one of them."""


@dataclass
class ExtractionSettings:
    config: dict  # complete (core.backbones.resolve_config); backend may be "auto"
    sources: dict[str, str] = field(default_factory=dict)  # key -> where its value came from (given keys only)
    warnings: list[str] = field(default_factory=list)  # a higher source overrode another value

    def describe(self) -> str:
        """The given settings with their sources, e.g. "falloff 'none' (checkpoint models/ivit)"."""
        given = [f"{key} {self.config.get(key)!r} ({source})" for key, source in sorted(self.sources.items())]
        return ", ".join(given) or f"all from {DEFAULTS}"


@dataclass
class OpenedExtractor:
    extractor: object  # a PatchExtractor
    facts: dict  # runtime_facts (backend, runtime, precision, threads, device) and "choice": why this backend
    settings: ExtractionSettings

    def describe(self) -> str:
        e, f = self.extractor, self.facts
        return (f"{e.name}: {e.grid.rows}x{e.grid.cols} patches, D={e.dim}; backend {f['backend']} ({f['choice']}), "
                f"{f['runtime']}, {f['precision']}, {f['threads']} thread(s), device {f['device']}")


def policy_extraction(policy_config: Mapping) -> dict:
    """The extraction settings a policy was trained with, from its config.json: the descriptor and
    weights keys of its recorded extractor (a policy without that record: its backbone only), and
    its roi, null (the whole frame) when it records none, and for DINOv2 its tokens, all (dense)
    when it records none: every policy before those keys was."""
    recorded = dict(policy_config.get("extractor") or {})
    recorded.setdefault("backbone", policy_config.get("backbone"))
    given = {key: value for key, value in recorded.items() if key in DESCRIPTOR_KEYS + WEIGHTS_KEYS and value is not None}
    if recorded["backbone"] == "dinov2_vits14":
        given.setdefault("tokens", ALL_TOKENS)
    return {**given, "roi": recorded.get("roi")}


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _shown(value) -> str:
    """A setting's value as the settings file writes it (None: null)."""
    return "null" if value is None else repr(value)


def extraction_settings(
    parameters: Mapping | None = None,
    checkpoint: str | Path | Mapping | None = None,
    config_file: str | Path | None = None,
    parameter_source: str = PARAMETER,
) -> ExtractionSettings:
    """The settings from `parameters` (None or "" = not given), the policy `checkpoint` (a folder
    or its config dict) and the settings file `config_file`, over config/extraction.yaml, by the
    precedence of the module docstring. Raises ExtractionConflict."""
    from sps_driving.core.policies.checkpoint import read_policy_config

    layers = []  # (source, values), highest first
    layers.append((parameter_source, {k: v for k, v in (parameters or {}).items() if v not in (None, "")}))
    if checkpoint not in (None, ""):
        policy = checkpoint if isinstance(checkpoint, Mapping) else read_policy_config(checkpoint)
        label = "checkpoint" if isinstance(checkpoint, Mapping) else f"checkpoint {checkpoint}"
        layers.append((label, policy_extraction(policy)))
    if config_file not in (None, ""):
        path = Path(config_file)
        if not path.is_file():
            raise FileNotFoundError(f"extraction settings file {path} not found")
        layers.append((f"file {path}", yaml.safe_load(path.read_text()) or {}))
    checkpoint_values = layers[1][1] if len(layers) > 1 and layers[1][0].startswith("checkpoint") else {}

    merged, sources, warnings = {}, {}, []
    for key in dict.fromkeys(k for _, values in layers for k in values):
        given = [(source, values[key]) for source, values in layers if key in values]
        if key in DESCRIPTOR_KEYS and key in checkpoint_values:
            wanted = checkpoint_values[key]
            for source, value in given:
                if not _same(value, wanted):
                    raise ExtractionConflict(
                        f"extraction setting {key}: {source} gives {_shown(value)}, but the policy was trained with "
                        f"{_shown(wanted)} ({next(s for s, _ in layers if s.startswith('checkpoint'))}); a policy must get "
                        f"the descriptors it was trained on: leave {key} out or set it to {_shown(wanted)}"
                    )
            chosen = next((s, v) for s, v in given if s.startswith("checkpoint"))
        else:
            chosen = given[0]
            for source, value in given[1:]:
                if not _same(value, chosen[1]):
                    warnings.append(f"extraction setting {key}: {chosen[0]} {chosen[1]!r} is used, not {source} {value!r}")
        merged[key], sources[key] = chosen[1], chosen[0]
    return ExtractionSettings(resolve_config(merged), sources, warnings)


def extractor_for_policy(policy: str | Path | Mapping, parameters: Mapping | None = None,
                         config_file: str | Path | None = None, parameter_source: str = "option",
                         view_width_scale: float = 1.0) -> OpenedExtractor:
    """The extractor a policy (a checkpoint folder or its config) must get its descriptors from,
    with runtime `parameters` (device, threads, ...): evaluation, graph evaluation, fine-tuning
    and replay all take the policy's settings this way (the extractor node with `checkpoint`).
    view_width_scale S != 1: for frames of a view S times as wide at the same focal length, the
    policy's input size and roi widened to match (sps_driving.core.view.widen_extraction)."""
    settings = extraction_settings(parameters, policy, config_file, parameter_source)
    if view_width_scale != 1.0:
        from sps_driving.core.view import widen_extraction

        settings.config = widen_extraction(settings.config, view_width_scale)
        settings.sources.update({key: f"view width scale {view_width_scale:g}" for key in ("input_size", "roi")})
    return open_extractor(settings)


def frame_overlay(extraction_config: Mapping, grid) -> FrameOverlay:
    """Where the patches of these (resolved) extraction settings lie on a camera frame, for
    drawing a policy's view; a backbone without an input_size setting (BLIP-2) tiles its roi evenly."""
    shape = (grid.rows, grid.cols)
    return FrameOverlay(extraction_config.get("roi"), extraction_config.get("input_size") or shape, shape)


def open_extractor(settings: ExtractionSettings | Mapping | None = None) -> OpenedExtractor:
    """The extractor of `settings` (or a plain config over the defaults), on the backend "auto"
    chooses, with what it runs (`facts`). Exports and checks the model on first use (CPU)."""
    if not isinstance(settings, ExtractionSettings):
        settings = ExtractionSettings(resolve_config(dict(settings or {})), {key: "given" for key in (settings or {})})
    config, choice = choose_backend(settings.config, settings.sources.get("backend", DEFAULTS))
    threads = config.get("threads")
    if config["backend"] == "torch" and threads:
        import torch

        torch.set_num_threads(int(threads))
    extractor = load_extractor(config)
    return OpenedExtractor(extractor, {**runtime_facts(extractor), "choice": choice}, settings)


def choose_backend(config: dict, source: str) -> tuple[dict, str]:
    """(config with a concrete backend, why that backend)."""
    if config["backend"] != AUTO:
        config = dict(config)
        if config["backend"] == "onnxruntime" and not config.get("export_dir") and config["backbone"] == "dinov2_vits14":
            config["export_dir"] = str(_export(config)[0])
        if config["backend"] == "onnxruntime" and config.get("precision") == "int8":
            _int8(config)
        reason = torch_only_reason(config) if config["backend"] == "torch" else None
        return config, f"only torch computes these: {reason}" if reason else f"set by {source}"
    device = resolve_device(config["device"])
    if device.type == "cuda":
        return _choose_on_gpu(config)
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return _torch(config, "auto: onnxruntime is not installed")
    try:
        export_dir, parity = _export(config)
    except (OSError, RuntimeError, ValueError) as error:
        return _torch(config, f"auto: the onnxruntime export could not be made ({error})")
    diff = parity["max_abs_diff"]
    if not parity["ok"]:
        return _torch(config, f"auto: the onnxruntime export differs from torch by {diff:.2g} > {parity['tolerance']:g}")
    config = {**config, "backend": "onnxruntime", "export_dir": str(export_dir), "device": "cpu"}
    if config.get("precision") == "int8":
        _int8(config)
    return config, f"auto: the onnxruntime export matches torch within {diff:.2g} (<= {parity['tolerance']:g})"


def _torch(config: dict, why: str) -> tuple[dict, str]:
    if config.get("precision") == "int8":
        raise ValueError(f"precision int8 runs on onnxruntime only, and {why.removeprefix('auto: ')}")
    return {**config, "backend": "torch"}, why


def _export(config: dict) -> tuple[Path, dict]:
    """The export directory of `config` and its parity record (made and checked on first use)."""
    from sps_driving.core.backbones.runtimes import read_parity
    from sps_driving.export.cache import ensure_export, parity_of

    if config.get("export_dir"):  # an export made by hand: checked now, it has no record
        return Path(config["export_dir"]), read_parity(config["export_dir"]) or parity_of(config)
    export_dir = ensure_export(config)
    return export_dir, read_parity(export_dir)


def _int8(config: dict) -> None:
    from sps_driving.export.cache import ensure_int8

    ensure_int8(Path(config["export_dir"]))


def _choose_on_gpu(config: dict) -> tuple[dict, str]:
    from sps_driving.core.backbones.runtimes import BACKBONE_FILE, PATCHES_FILE, cached_export_dir, engine_path

    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return _torch(config, "auto: on the GPU, tensorrt is not installed")
    try:
        export_dir = Path(config["export_dir"]) if config.get("export_dir") else cached_export_dir(config)
        engines = [engine_path(export_dir / graph) for graph in (BACKBONE_FILE, PATCHES_FILE)]
    except (OSError, KeyError, ImportError):  # no export, or none that names its hash; onnxruntime missing
        engines = []
    if engines and all(path.is_file() for path in engines):
        return {**config, "backend": "tensorrt", "export_dir": str(export_dir)}, "auto: TensorRT engines for this GPU"
    return _torch(config, f"auto: no TensorRT engines in {export_dir} (build them with "
                          f"`sps-driving export tensorrt --export-dir {export_dir}`)")
