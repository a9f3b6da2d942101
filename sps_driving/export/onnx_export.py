"""ONNX export of a per-patch extractor as two graphs plus a metadata file.

An export directory holds:
- backbone.onnx: pixel_values float32 [1, 3, H, W] -> tokens float32 [T, E] (the per-frame work);
- patches.onnx: tokens [T, E], bias float32 [k, T] (SPS eq. 1's (1 - m^(j)) r over all T tokens,
  prefix tokens first) and, for ViT backbones, patch_index int64 [k] -> descriptors float32 [k, D].
  k is a dynamic axis: one call computes any batch of patches and the per-frame shared work inside
  it (e.g. the Q-Former's image-token keys and values) runs once per call;
- export.json: backbone name, grid, D, preprocessing (resize, mean, std; not the roi, cropped
  before the graph by whichever runtime opens it), prefix tokens, the mask settings at export
  time (the mask is an input, so a runtime may change them), graph input names, model hash;
- position_table.npy: the backbone's patch position embeddings [N, P] (SPPS / MSPPS policies).

A token-dropping export (DINOv2 with tokens "kept", export.json "vit_tokens": "kept") has the same
files and inputs, split elsewhere: backbone.onnx embeds the frame (tokens [T, E]: the patch
embedding with the position embeddings added), and patches.onnx gathers CLS and the k patches of
patch_index and runs every layer on them (MaskedViT.kept_forward), the bias's columns of the kept
tokens masking the masked layer; one call must hold all of a frame's kept patches.

Graphs are traced with torch.onnx.export(opset 17, dynamo=False) in fp32; files over 2 GB (the
protobuf limit, ViT-g is about 4 GB) keep their weights in one external data file beside them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from sps_driving.core.backbones.runtimes import BACKBONE_FILE, META_FILE, PATCHES_FILE, POSITION_FILE

OPSET = 17
PROTOBUF_LIMIT = 2**31 - 1  # bytes


@dataclass
class ExportSpec:
    """What an exporter needs from an extractor: two traceable modules and how to feed them."""

    name: str
    backbone: nn.Module  # pixel_values [1, 3, H, W] -> tokens [T, E]
    patches: nn.Module  # (*patch_inputs) -> [k, D]
    patch_inputs: tuple[str, ...]  # names, in order: "tokens", "bias", optionally "patch_index"
    input_size: tuple[int, int]  # (H, W) px
    resize: str  # "cubic" | "area" (cv2 interpolation of the preprocessing)
    pixel_mean: tuple[float, float, float]
    pixel_std: tuple[float, float, float]
    grid: tuple[int, int]  # (rows, cols)
    dim: int
    prefix_tokens: int  # non-patch tokens before the patches (CLS)
    prefix_mask: float  # mask value m of the prefix tokens
    mask: dict = field(default_factory=dict)  # falloff, alpha, suppression at export time
    position_table: np.ndarray | None = None
    tokens: str = "all"  # "kept": token dropping (module docstring)


def export_spec(extractor) -> ExportSpec:
    """The ExportSpec of a torch extractor (BLIP-2 or DINOv2)."""
    from sps_driving.core.backbones.blip2 import PIXEL_MEAN, PIXEL_STD, Blip2Extractor

    if isinstance(extractor, Blip2Extractor):
        opts = extractor.options
        return ExportSpec(
            name=extractor.name,
            backbone=extractor.backbone_module,
            patches=extractor.patch_module,
            patch_inputs=("tokens", "bias"),
            input_size=(extractor.image_size, extractor.image_size),
            resize="cubic",
            pixel_mean=PIXEL_MEAN,
            pixel_std=PIXEL_STD,
            grid=(extractor.grid.rows, extractor.grid.cols),
            dim=extractor.dim,
            prefix_tokens=1,
            prefix_mask=float(opts["cls_mask"]),
            mask={key: opts[key] for key in ("falloff", "alpha", "suppression")},
            position_table=extractor.position_table(),
        )
    from sps_driving.core.backbones.dinov2 import IMAGENET_MEAN, IMAGENET_STD, DinoV2Extractor

    if isinstance(extractor, DinoV2Extractor):
        encoder = extractor.encoder
        kept = extractor.drops_tokens
        return ExportSpec(
            name=extractor.name,
            backbone=DinoV2EmbeddingModule(extractor) if kept else DinoV2BackboneModule(extractor),
            patches=DinoV2KeptPatchModule(extractor) if kept else DinoV2PatchModule(extractor),
            patch_inputs=("tokens", "bias", "patch_index"),
            input_size=extractor.input_size,
            resize="area",
            pixel_mean=tuple(float(v) for v in IMAGENET_MEAN),
            pixel_std=tuple(float(v) for v in IMAGENET_STD),
            grid=(extractor.grid.rows, extractor.grid.cols),
            dim=extractor.dim,
            prefix_tokens=encoder.num_prefix_tokens,
            prefix_mask=1.0,
            mask={"falloff": encoder.falloff, "alpha": encoder.alpha, "suppression": encoder.suppression},
            position_table=extractor.position_table(),
            tokens=extractor.tokens,
        )
    raise TypeError(f"no ONNX export for extractor {type(extractor).__name__}")


class DinoV2BackboneModule(nn.Module):
    """pixel_values -> the hidden states [T, D] entering the masked layer."""

    def __init__(self, extractor):
        super().__init__()
        self.model = extractor.model
        self.encoder = extractor.encoder

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        tokens = self.model.embeddings(pixel_values.to(self.model.embeddings.patch_embeddings.projection.weight.dtype))
        return self.encoder.prefix(tokens)[0]


class DinoV2PatchModule(nn.Module):
    """(hidden [T, D], bias [k, T], patch_index [k]) -> descriptors [k, D]: MaskedViT.patch_forward,
    the extractor's own per-patch pass, with its layers registered here as the graph's weights; the
    patch batch stays a dynamic axis when traced."""

    def __init__(self, extractor):
        super().__init__()
        self.encoder = extractor.encoder
        self.layers = nn.ModuleList(self.encoder.layers)
        self.final_norm = self.encoder.final_norm

    def forward(self, hidden: torch.Tensor, bias: torch.Tensor, patch_index: torch.Tensor) -> torch.Tensor:
        return self.encoder.patch_forward(hidden[None], bias, patch_index + self.encoder.num_prefix_tokens)


class DinoV2EmbeddingModule(nn.Module):
    """Token dropping: pixel_values -> the embedded tokens [T, D] (position embeddings added)."""

    def __init__(self, extractor):
        super().__init__()
        self.model = extractor.model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model.embeddings(pixel_values.to(self.model.embeddings.patch_embeddings.projection.weight.dtype))[0]


class DinoV2KeptPatchModule(DinoV2PatchModule):
    """Token dropping: (tokens [T, D], bias [k, T], patch_index [k]) -> descriptors [k, D] of the ViT
    run on CLS and those k patches only (MaskedViT.kept_forward); k stays a dynamic axis."""

    def forward(self, tokens: torch.Tensor, bias: torch.Tensor, patch_index: torch.Tensor) -> torch.Tensor:
        return self.encoder.kept_forward(tokens[None], bias, patch_index)


def example_patch_inputs(spec: ExportSpec, tokens: torch.Tensor, patches: int = 3) -> tuple[torch.Tensor, ...]:
    """A small batch of patches in the spec's input order (the trace example; k stays dynamic)."""
    from sps_driving.core.grid import PatchGrid, token_bias

    grid = PatchGrid(*spec.grid)
    index = np.linspace(0, grid.n - 1, patches).astype(np.int64)
    bias = torch.from_numpy(token_bias(grid, index, **spec.mask, prefix_tokens=spec.prefix_tokens, prefix_mask=spec.prefix_mask))
    values = {"tokens": tokens, "bias": bias, "patch_index": torch.from_numpy(index)}
    return tuple(values[name] for name in spec.patch_inputs)


def export_onnx(extractor, out_dir: str | Path, external_data_threshold: int = PROTOBUF_LIMIT) -> Path:
    """Export `extractor` (torch, fp32) to `out_dir`; returns the path of export.json."""
    spec = export_spec(extractor)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for module in (spec.backbone, spec.patches):
        module.float().eval()
    height, width = spec.input_size
    pixels = torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        tokens = spec.backbone(pixels).float()
    patch_example = example_patch_inputs(spec, tokens)
    _export_graph(
        spec.backbone, (pixels,), out_dir / BACKBONE_FILE, ["pixel_values"], ["tokens"], {}, external_data_threshold
    )
    dynamic = {"bias": {0: "patches"}, "patch_index": {0: "patches"}, "descriptors": {0: "patches"}}
    _export_graph(
        spec.patches,
        patch_example,
        out_dir / PATCHES_FILE,
        list(spec.patch_inputs),
        ["descriptors"],
        {name: axes for name, axes in dynamic.items() if name in spec.patch_inputs or name == "descriptors"},
        external_data_threshold,
    )
    np.save(out_dir / POSITION_FILE, np.asarray(spec.position_table, dtype=np.float32))
    meta = {
        "name": spec.name,
        "grid": list(spec.grid),
        "dim": spec.dim,
        "tokens": int(tokens.shape[0]),
        "token_dim": int(tokens.shape[1]),
        "input_size": list(spec.input_size),
        "resize": spec.resize,
        "pixel_mean": list(spec.pixel_mean),
        "pixel_std": list(spec.pixel_std),
        "prefix_tokens": spec.prefix_tokens,
        "prefix_mask": spec.prefix_mask,
        "mask": {k: (float(v) if k != "falloff" else v) for k, v in spec.mask.items()},
        "patch_inputs": list(spec.patch_inputs),
        "vit_tokens": spec.tokens,
        "model_hash": {name: file_hash(out_dir / name) for name in (BACKBONE_FILE, PATCHES_FILE)},
    }
    meta_path = out_dir / META_FILE
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta_path


def _export_graph(module, args, path: Path, input_names, output_names, dynamic_axes, threshold: int) -> None:
    import onnx

    for stale in (path, path.with_name(path.name + ".data")):
        stale.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        # torch spills weights of > 2 GB models into many files next to the graph: trace into a
        # scratch folder, then write one graph (+ one data file when needed) to the export folder.
        traced = Path(scratch) / path.name
        with torch.inference_mode(False), torch.no_grad():
            torch.onnx.export(
                module,
                args,
                str(traced),
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=dynamic_axes,
                opset_version=OPSET,
                do_constant_folding=True,
                dynamo=False,
            )
        model = onnx.load(str(traced))
        if model.ByteSize() > threshold:
            onnx.save_model(
                model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data"
            )
        else:
            shutil.move(str(traced), str(path))


def file_hash(path: Path) -> str:
    """sha256 of an ONNX graph and its external data file, if any."""
    digest = hashlib.sha256()
    for part in (path, path.with_name(path.name + ".data")):
        if part.is_file():
            with open(part, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 24), b""):
                    digest.update(block)
    return digest.hexdigest()
