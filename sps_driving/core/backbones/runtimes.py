"""Exported per-patch extractors behind the PatchExtractor protocol: onnxruntime and TensorRT, and
where their exports are.

Both read an export directory written by `sps-driving export onnx` (see
sps_driving/export/onnx_export.py for its layout): the backbone graph runs once per frame, the
per-patch graph once per batch of kept patches with the eq. 1 bias as an input. TensorRT engines
are built from those graphs by `sps-driving export tensorrt` and cached by GPU, TensorRT version
and model hash. onnxruntime(-gpu) and tensorrt are optional: imported only when chosen.

Config keys (beside backbone and backend): export_dir (default: this model's entry in the export
cache, `cached_export_dir`), cache_dir, device ("auto" | "cpu" | "cuda"; onnxruntime picks
CUDAExecutionProvider when available), precision ("int8": the graph with the ViT's layers
quantized by `sps-driving export int8`, onnxruntime only: `quantized_graph`), threads (onnxruntime's intra-op threads; None = the
cores this process may use), max_patch_batch (patches per call; TensorRT: at most the engine
profile's maximum), the mask settings falloff, alpha, suppression (default: the values at
export time), and roi: the frame's region of interest is cropped in the numpy preprocessing
before the backbone graph, so one export serves every roi (it is not an export key) and a
runtime applies the roi of the config it is opened with (None: the whole frame). tokens ("all" |
"kept") must be the export's own (export.json "vit_tokens"): a token-dropping export runs a frame's
kept patches in one per-patch call (sps_driving/export/onnx_export.py).

The export cache holds one folder per DINOv2 model file (its sha256), export settings and the
versions that make an export and check it (CACHE_FORMAT, torch, onnxruntime). A folder appears
only complete, with PARITY_FILE (how far the export is from torch): it is built in a scratch
folder and renamed into place (sps_driving/export/cache.py builds it; this module only finds it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sps_driving.core.backbones import ALL_TOKENS, KEPT_TOKENS, UNMASKED_FALLOFF
from sps_driving.core.grid import PatchGrid
from sps_driving.core.image import check_roi, normalized_pixels

META_FILE = "export.json"
BACKBONE_FILE = "backbone.onnx"
BACKBONE_INT8_FILE = "backbone.int8.onnx"
PATCHES_FILE = "patches.onnx"
PATCHES_INT8_FILE = "patches.int8.onnx"
INT8_FILES = {BACKBONE_FILE: BACKBONE_INT8_FILE, PATCHES_FILE: PATCHES_INT8_FILE}
POSITION_FILE = "position_table.npy"
PARITY_FILE = "parity.json"  # {"max_abs_diff", "tolerance", "ok", ...}: the export against torch fp32
ENGINE_DIR = "engines"
DEFAULT_MAX_PATCH_BATCH = 256  # patches per per-patch call (the full 16x16 grid)
CACHE_VARIABLE = "SPS_DRIVING_CACHE_DIR"
CACHE_FORMAT = 2  # raise when the export or its parity check changes: older cache entries are then not used
# The settings an export is made and checked with (the mask is an input, but parity was checked at these);
# roi is not one: the crop comes before the graph.
EXPORT_KEYS = ("input_size", "tokens", "masked_layer", "falloff", "alpha", "suppression")


class RuntimeMissing(FileNotFoundError):
    """An export, engine or runtime library is missing; the message names the command that builds it."""


def export_command(config: dict, out: str | Path = "DIR") -> str:
    backbone = config.get("backbone", "dinov2_vits14")
    model = f" --model-path {config['model_path']}" if config.get("model_path") else ""
    return f"sps-driving export onnx --backbone {backbone}{model} --out {out}"


def cache_root(config: dict) -> Path:
    """The export cache: config cache_dir, else $SPS_DRIVING_CACHE_DIR, else the user's cache folder."""
    if config.get("cache_dir"):
        return Path(config["cache_dir"]).expanduser()
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sps_driving"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def cached_export_dir(config: dict) -> Path:
    """Where the export cache keeps the export of `config`'s model (DINOv2 only; it may not exist yet)."""
    if config.get("backbone", "dinov2_vits14") != "dinov2_vits14":
        raise RuntimeMissing(
            f"exports of {config['backbone']} are not made on first use: build one with "
            f"`{export_command(config)}` and set export_dir to DIR"
        )
    import onnxruntime
    import torch

    from sps_driving.core.backbones.dinov2 import resolve_onnx_path

    settings = {key: config[key] for key in EXPORT_KEYS}
    settings["input_size"] = [int(v) for v in settings["input_size"]]
    key = {
        "model_sha256": file_sha256(resolve_onnx_path(config.get("model_path"))),
        "settings": settings,
        "format": CACHE_FORMAT,
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root(config) / "exports" / f"{config['backbone']}-{digest}"


def read_parity(export_dir: str | Path) -> dict | None:
    """The parity record of an export (None when it has none, e.g. one made by `sps-driving export onnx`)."""
    path = Path(export_dir) / PARITY_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def export_dir_of(config: dict) -> Path:
    """config's export_dir, else its entry in the export cache."""
    return Path(config["export_dir"]) if config.get("export_dir") else cached_export_dir(config)


def read_export(export_dir: str | Path, config: dict) -> dict:
    export_dir = Path(export_dir)
    meta_path = export_dir / META_FILE
    missing = [p for p in (meta_path, export_dir / BACKBONE_FILE, export_dir / PATCHES_FILE) if not p.is_file()]
    if missing:
        how = (f"sps_driving.export.extractors.open_extractor (every node and tool) makes it on first use, or `{export_command(config)}`"
               " then set export_dir to DIR") if not config.get("export_dir") else f"build it with `{export_command(config, export_dir)}`"
        raise RuntimeMissing(f"no exported extractor in {export_dir}/ (missing {', '.join(p.name for p in missing)}): {how}")
    return json.loads(meta_path.read_text())


def export_tokens(meta: dict) -> str:
    """Which tokens an export runs its ViT on (exports from before token dropping: all)."""
    return meta.get("vit_tokens", ALL_TOKENS)


def quantized_graph(meta: dict) -> str:
    """The graph that precision int8 quantizes: the one with the ViT's layers (dense: the backbone
    graph, every layer before the masked one; token dropping: the per-patch graph, every layer)."""
    return PATCHES_FILE if export_tokens(meta) == KEPT_TOKENS else BACKBONE_FILE


def available_threads() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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
        self.tokens = export_tokens(self.meta)
        wanted = config.get("tokens", ALL_TOKENS)
        if wanted != self.tokens:
            raise ValueError(f"the export in {self.export_dir}/ runs its ViT on tokens {self.tokens!r}, the settings ask for "
                             f"tokens {wanted!r}: export it with those settings ({export_command(config)} --tokens {wanted})")
        self.name = self.meta["name"]
        self.grid = PatchGrid(*self.meta["grid"])
        self.dim = int(self.meta["dim"])
        self.mask = {key: config.get(key, value) for key, value in self.meta["mask"].items()}
        self.max_patch_batch = int(config.get("max_patch_batch") or DEFAULT_MAX_PATCH_BATCH)
        self.roi = check_roi(config.get("roi"))
        self._position_table = np.load(self.export_dir / POSITION_FILE)

    def pixels(self, image_rgb: np.ndarray) -> np.ndarray:
        meta = self.meta
        return normalized_pixels(image_rgb, tuple(meta["input_size"]), meta["resize"], meta["pixel_mean"], meta["pixel_std"],
                                 self.roi)

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

    @property
    def drops_tokens(self) -> bool:
        return self.tokens == KEPT_TOKENS

    def descriptors(self, state: ExportedFrame, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if self.drops_tokens:  # the kept patches are one sequence: one call
            if len(np.unique(indices)) != len(indices):
                raise ValueError("token dropping needs distinct patch indices: a repeated token would weigh twice in attention")
            batches = [indices] if len(indices) else []
        else:
            batches = [indices[i : i + self.max_patch_batch] for i in range(0, len(indices), self.max_patch_batch)]
        out = [self.run_patches(self.patch_inputs(state, batch)) for batch in batches]
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


def session_options(threads: int):
    """The onnxruntime session options the extractor runs with (the GEMM peak is measured with them too)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # suppressed tokens (finite r) leave subnormal probabilities, which are very slow on CPUs
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1  # the graphs are one chain of ops: nothing runs beside it
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Idle pool threads sleep instead of busy-waiting for the next op or frame: on a few cores
    # shared with the graph's other processes, spinning threads take the CPU they need.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


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
        self.precision = config.get("precision") or "fp32"
        files = {BACKBONE_FILE: BACKBONE_FILE, PATCHES_FILE: PATCHES_FILE}
        if self.precision == "int8":
            quantized = quantized_graph(self.meta)
            files[quantized] = INT8_FILES[quantized]
            if not (self.export_dir / files[quantized]).is_file():
                raise RuntimeMissing(
                    f"no int8 graph {files[quantized]} in {self.export_dir}/: build it with `sps-driving export int8 --export-dir "
                    f"{self.export_dir}` (sps_driving.export.extractors.open_extractor builds it on first use)"
                )
        self.threads = int(config.get("threads") or available_threads())
        options = session_options(self.threads)
        # set_denormal_as_zero also switches the thread that creates a session to flush-to-zero,
        # for every float computed there afterwards: the sessions are made and run on a thread
        # of their own, so the caller's arithmetic (a simulation, tests) stays IEEE.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onnxruntime")
        self.backbone, self.patches = self._thread.submit(lambda: tuple(
            ort.InferenceSession(str(self.export_dir / name), options, providers=providers)
            for name in (files[BACKBONE_FILE], files[PATCHES_FILE])
        )).result()
        self.provider = self.backbone.get_providers()[0]
        self._version = ort.__version__

    def encode(self, image_rgb: np.ndarray) -> ExportedFrame:
        pixels = self.pixels(image_rgb)
        (tokens,) = self._thread.submit(self.backbone.run, ["tokens"], {"pixel_values": pixels}).result()
        return ExportedFrame(tokens)

    def run_patches(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self._thread.submit(self.patches.run, ["descriptors"], inputs).result()[0]

    def runtime_facts(self) -> dict:
        device = "cuda" if self.provider == "CUDAExecutionProvider" else "cpu"
        return {"backend": "onnxruntime", "runtime": f"onnxruntime {self._version} {self.provider}",
                "precision": self.precision, "threads": self.threads, "device": device, "export_dir": str(self.export_dir)}


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
        if self.drops_tokens and self.max_patch_batch < self.grid.n:
            raise RuntimeMissing(
                f"the per-patch engine of {self.export_dir} takes at most {self.max_patch_batch} patches, and token dropping "
                f"runs all of a frame's kept patches (up to {self.grid.n}) in one call: rebuild it with `sps-driving export "
                f"tensorrt --export-dir {self.export_dir} --force` (its profile then reaches {self.grid.n})"
            )
        self.fp16 = fp16

    def encode(self, image_rgb: np.ndarray) -> ExportedFrame:
        return ExportedFrame(self.backbone.run({"pixel_values": self.pixels(image_rgb)})["tokens"])

    def run_patches(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.patches.run(inputs)["descriptors"].float().cpu().numpy()

    def runtime_facts(self) -> dict:
        import tensorrt

        return {"backend": "tensorrt", "runtime": f"tensorrt {tensorrt.__version__}", "precision": "fp16" if self.fp16 else "fp32",
                "threads": None, "device": "cuda", "export_dir": str(self.export_dir)}


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
    export_dir = export_dir_of(config)
    if backend == "onnxruntime":
        return OnnxRuntimeExtractor(export_dir, config)
    if backend == "tensorrt":
        return TensorRTExtractor(export_dir, config)
    raise ValueError(f"unknown runtime backend {backend!r}; expected onnxruntime or tensorrt")
