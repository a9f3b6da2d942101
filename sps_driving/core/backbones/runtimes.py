"""Exported per-patch extractors behind the PatchExtractor protocol: onnxruntime and TensorRT.

Both read an export directory written by `sps-driving export onnx` (see
sps_driving/export/onnx_export.py for its layout): the backbone graph runs once per frame, the
per-patch graph once per batch of kept patches with the eq. 1 bias as an input. TensorRT engines
are built from those graphs by `sps-driving export tensorrt` and cached by GPU, TensorRT version
and model hash. onnxruntime(-gpu) and tensorrt are optional: imported only when chosen.

Config keys (beside backbone and backend): export_dir (default models/export/<backbone>),
device ("auto" | "cpu" | "cuda"; onnxruntime picks CUDAExecutionProvider when available),
max_patch_batch (patches per call; TensorRT: at most the engine profile's maximum), and the mask
settings falloff, alpha, suppression (default: the values at export time).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sps_driving.core.backbones import UNMASKED_FALLOFF
from sps_driving.core.grid import PatchGrid

META_FILE = "export.json"
BACKBONE_FILE = "backbone.onnx"
PATCHES_FILE = "patches.onnx"
POSITION_FILE = "position_table.npy"
ENGINE_DIR = "engines"
DEFAULT_MAX_PATCH_BATCH = 256  # patches per per-patch call (the full 16x16 grid)


class RuntimeMissing(FileNotFoundError):
    """An export, engine or runtime library is missing; the message names the command that builds it."""


def default_export_dir(backbone: str) -> Path:
    return Path("models") / "export" / backbone


def export_command(config: dict) -> str:
    backbone = config.get("backbone", "dinov2_vits14")
    out = config.get("export_dir") or default_export_dir(backbone)
    model = f" --model-path {config['model_path']}" if config.get("model_path") else ""
    return f"sps-driving export onnx --backbone {backbone}{model} --out {out}"


def read_export(export_dir: str | Path, config: dict) -> dict:
    export_dir = Path(export_dir)
    meta_path = export_dir / META_FILE
    missing = [p for p in (meta_path, export_dir / BACKBONE_FILE, export_dir / PATCHES_FILE) if not p.is_file()]
    if missing:
        raise RuntimeMissing(
            f"no exported extractor in {export_dir}/ (missing {', '.join(p.name for p in missing)}): "
            f"build it with `{export_command(config)}`"
        )
    return json.loads(meta_path.read_text())


@dataclass
class ExportedFrame:
    tokens: np.ndarray  # [T, E] float32 (TensorRT: a CUDA tensor)


class ExportedExtractor:
    """The runtime-independent half: preprocessing, masks and batching from export.json."""

    def __init__(self, export_dir: str | Path, config: dict):
        if config.get("falloff") == UNMASKED_FALLOFF:
            raise ValueError(
                "falloff none (the ViT's own unmasked patch tokens) runs on backend torch only; the exported "
                "runtimes (onnxruntime, tensorrt) compute masked descriptors (falloff hard | exp2 | inverse)"
            )
        self.export_dir = Path(export_dir)
        self.meta = read_export(self.export_dir, config)
        self.name = self.meta["name"]
        self.grid = PatchGrid(*self.meta["grid"])
        self.dim = int(self.meta["dim"])
        self.mask = {key: config.get(key, value) for key, value in self.meta["mask"].items()}
        self.max_patch_batch = int(config.get("max_patch_batch") or DEFAULT_MAX_PATCH_BATCH)
        self._position_table = np.load(self.export_dir / POSITION_FILE)

    def pixels(self, image_rgb: np.ndarray) -> np.ndarray:
        from sps_driving.core.image import normalized_pixels

        meta = self.meta
        return normalized_pixels(image_rgb, tuple(meta["input_size"]), meta["resize"], meta["pixel_mean"], meta["pixel_std"])

    def patch_inputs(self, frame: ExportedFrame, indices: np.ndarray) -> dict[str, np.ndarray]:
        from sps_driving.core.grid import token_bias

        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= self.grid.n):
            raise IndexError(f"patch indices must lie in [0, {self.grid.n}), got {indices.min()}..{indices.max()}")
        bias = token_bias(
            self.grid, indices, self.mask["falloff"], self.mask.get("alpha", 0.0), self.mask["suppression"],
            self.meta["prefix_tokens"], self.meta["prefix_mask"],
        )
        values = {"tokens": frame.tokens, "bias": bias, "patch_index": indices}
        return {name: values[name] for name in self.meta["patch_inputs"]}

    def descriptors(self, state: ExportedFrame, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = [
            self.run_patches(self.patch_inputs(state, indices[i : i + self.max_patch_batch]))
            for i in range(0, len(indices), self.max_patch_batch)
        ]
        if not out:
            return np.zeros((0, self.dim), np.float32)
        result = np.concatenate(out).astype(np.float32, copy=False)
        if not np.isfinite(result).all():
            raise FloatingPointError(f"non-finite descriptors from the {type(self).__name__} runtime")
        return result

    def position_table(self) -> np.ndarray:
        return self._position_table

    def run_patches(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError


class OnnxRuntimeExtractor(ExportedExtractor):
    def __init__(self, export_dir: str | Path, config: dict):
        super().__init__(export_dir, config)
        try:
            import onnxruntime as ort
        except ImportError as error:
            raise RuntimeMissing("backend onnxruntime needs `pip install onnxruntime` (or onnxruntime-gpu)") from error
        available = ort.get_available_providers()
        device = config.get("device", "auto")
        providers = ["CPUExecutionProvider"]
        if device != "cpu" and "CUDAExecutionProvider" in available:
            providers.insert(0, "CUDAExecutionProvider")
        elif str(device).startswith("cuda"):
            raise RuntimeMissing("device cuda with backend onnxruntime needs `pip install onnxruntime-gpu`")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # suppressed tokens (finite r) leave subnormal probabilities, which are very slow on CPUs
        options.add_session_config_entry("session.set_denormal_as_zero", "1")
        self.backbone = ort.InferenceSession(str(self.export_dir / BACKBONE_FILE), options, providers=providers)
        self.patches = ort.InferenceSession(str(self.export_dir / PATCHES_FILE), options, providers=providers)

    def encode(self, image_rgb: np.ndarray) -> ExportedFrame:
        (tokens,) = self.backbone.run(["tokens"], {"pixel_values": self.pixels(image_rgb)})
        return ExportedFrame(tokens)

    def run_patches(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.patches.run(["descriptors"], inputs)[0]


class TensorRTExtractor(ExportedExtractor):
    """Engines built by `sps-driving export tensorrt`, run on torch CUDA buffers."""

    def __init__(self, export_dir: str | Path, config: dict):
        super().__init__(export_dir, config)
        try:
            import tensorrt  # noqa: F401
            import torch
        except ImportError as error:
            raise RuntimeMissing("backend tensorrt needs `pip install tensorrt` and a CUDA build of torch") from error
        if not torch.cuda.is_available():
            raise RuntimeMissing("backend tensorrt needs a CUDA GPU; use backend onnxruntime or torch here")
        fp16 = bool(config.get("fp16", True))
        engines = {}
        for graph in (BACKBONE_FILE, PATCHES_FILE):
            path = engine_path(self.export_dir / graph, fp16=fp16)
            if not path.is_file():
                raise RuntimeMissing(
                    f"no TensorRT engine {path} for this GPU and TensorRT version: build it with "
                    f"`sps-driving export tensorrt --export-dir {self.export_dir}`"
                    + ("" if fp16 else " --fp32")
                )
            engines[graph] = EngineRunner(path)
        self.backbone, self.patches = engines[BACKBONE_FILE], engines[PATCHES_FILE]
        self.max_patch_batch = min(self.max_patch_batch, self.patches.max_batch("bias"))

    def encode(self, image_rgb: np.ndarray) -> ExportedFrame:
        return ExportedFrame(self.backbone.run({"pixel_values": self.pixels(image_rgb)})["tokens"])

    def run_patches(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.patches.run(inputs)["descriptors"].float().cpu().numpy()


def tensorrt_logger():
    import tensorrt as trt

    return trt.Logger(trt.Logger.WARNING)


def engine_path(onnx_path: str | Path, fp16: bool = True) -> Path:
    """Where the engine of `onnx_path` for this GPU, TensorRT version and precision lives (beside
    the graph, in ENGINE_DIR): a different GPU or TensorRT never loads a stale engine."""
    import tensorrt as trt
    import torch

    onnx_path = Path(onnx_path)
    meta = json.loads((onnx_path.parent / META_FILE).read_text())
    model_hash = meta["model_hash"][onnx_path.name]
    gpu = torch.cuda.get_device_name()
    key = hashlib.sha256(f"{gpu}|{trt.__version__}|{fp16}|{model_hash}".encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-")
    precision = "fp16" if fp16 else "fp32"
    return onnx_path.parent / ENGINE_DIR / f"{onnx_path.stem}-{slug}-trt{trt.__version__}-{precision}-{key}.engine"


class EngineRunner:
    """One deserialized engine, run on torch CUDA tensors (inputs may be numpy or torch)."""

    def __init__(self, path: str | Path):
        import tensorrt as trt
        import torch

        self._trt, self._torch = trt, torch
        self.engine = trt.Runtime(tensorrt_logger()).deserialize_cuda_engine(Path(path).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"could not load TensorRT engine {path}: rebuild it with `sps-driving export tensorrt`")
        self.context = self.engine.create_execution_context()
        self.names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in self.names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in self.names if n not in self.inputs]

    def _dtype(self, name: str):
        trt, torch = self._trt, self._torch
        table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32, trt.int64: torch.int64}
        if hasattr(trt, "bfloat16"):
            table[trt.bfloat16] = torch.bfloat16
        return table[self.engine.get_tensor_dtype(name)]

    def max_batch(self, name: str) -> int:
        return int(self.engine.get_tensor_profile_shape(name, 0)[2][0])

    def run(self, inputs: dict) -> dict:
        torch = self._torch
        held = []
        for name in self.inputs:
            tensor = torch.as_tensor(inputs[name]).to(device="cuda", dtype=self._dtype(name)).contiguous()
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
            held.append(tensor)
        outputs = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            outputs[name] = torch.empty(shape, dtype=self._dtype(name), device="cuda")
            self.context.set_tensor_address(name, outputs[name].data_ptr())
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()
        return outputs


def load_runtime_extractor(config: dict):
    """PatchExtractor for backend "onnxruntime" or "tensorrt" from an export directory."""
    backend = config.get("backend")
    export_dir = config.get("export_dir") or default_export_dir(config.get("backbone", "dinov2_vits14"))
    if backend == "onnxruntime":
        return OnnxRuntimeExtractor(export_dir, config)
    if backend == "tensorrt":
        return TensorRTExtractor(export_dir, config)
    raise ValueError(f"unknown runtime backend {backend!r}; expected onnxruntime or tensorrt")
