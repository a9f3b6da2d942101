"""The extractor of a config, on the backend it names: the one module that imports every backbone
(each only when chosen, so loading one never loads another's dependencies)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from sps_driving.core.backbones import AUTO, resolve_config
from sps_driving.core.extraction import PatchExtractor


def load_extractor(config: Mapping | str | Path | None = None) -> PatchExtractor:
    """The PatchExtractor for `config` (a dict, a YAML file path, or None for the defaults), on a
    backend that exists: backend auto for masked DINOv2 is sps_driving.export.extractors.open_extractor's
    to choose (it exports the model on first use)."""
    config = resolve_config(config)
    if config["backend"] == AUTO:
        raise ValueError(
            "backend auto for masked DINOv2 is chosen by sps_driving.export.extractors.open_extractor, which exports the "
            "model on first use; load_extractor takes torch, onnxruntime or tensorrt"
        )
    if config["backend"] != "torch":
        from sps_driving.core.backbones.runtimes import load_runtime_extractor

        return load_runtime_extractor(config)
    if config["backbone"] == "blip2":
        from sps_driving.core.backbones.blip2 import Blip2Extractor

        return Blip2Extractor.from_config(config)
    if config["backbone"] == "pixels":
        from sps_driving.core.backbones.pixels import PixelExtractor

        return PixelExtractor.from_config(config)
    from sps_driving.core.backbones.dinov2 import DinoV2Extractor

    return DinoV2Extractor.from_config(config)
