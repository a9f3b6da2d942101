"""TensorRT engines for the exported graphs, through the `tensorrt` Python API (GPU machines only).

fp16 engines keep LayerNorm, softmax and reductions (the ITC normalization) in fp32: transformers'
LayerNorm overflows in fp16. The per-patch graph gets one optimization profile over the patch
batch (min / opt / max patches). Engines are cached beside the ONNX files, named by GPU, TensorRT
version, precision and the graph's hash, so a different GPU or TensorRT never loads a stale one.
`tensorrt` is imported only inside these functions: it is an optional extra.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from sps_driving.core.backbones.runtimes import ENGINE_DIR, META_FILE

DEFAULT_WORKSPACE_GB = 4  # builder scratch memory [GiB]


def _logger():
    import tensorrt as trt

    return trt.Logger(trt.Logger.WARNING)


def engine_path(onnx_path: str | Path, fp16: bool = True) -> Path:
    """Where the engine of `onnx_path` for this GPU, TensorRT version and precision lives."""
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


def keep_fp32(network) -> int:
    """Pin LayerNorm, softmax and reduction layers to fp32; returns how many were pinned."""
    import tensorrt as trt

    pinned_types = {trt.LayerType.NORMALIZATION, trt.LayerType.SOFTMAX, trt.LayerType.REDUCE}
    floating = {trt.float32, trt.float16}
    pinned = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        # reductions also appear in integer shape arithmetic: pin floating-point ones only
        if layer.type in pinned_types and layer.get_output(0).dtype in floating:
            layer.precision = trt.float32
            for j in range(layer.num_outputs):
                layer.set_output_type(j, trt.float32)
            pinned += 1
    return pinned


def build_engine(
    onnx_path: str | Path,
    fp16: bool = True,
    patches: tuple[int, int, int] = (1, 128, 256),
    workspace_gb: float = DEFAULT_WORKSPACE_GB,
    force: bool = False,
) -> Path:
    """Build (or reuse from the cache) the engine of one exported graph. `patches` = (min, opt, max)
    of the dynamic patch axis."""
    import tensorrt as trt

    path = engine_path(onnx_path, fp16)
    if path.is_file() and not force:
        return path
    logger = _logger()
    builder = trt.Builder(logger)
    explicit = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)  # required before TensorRT 10
    network = builder.create_network(0 if explicit is None else 1 << int(explicit))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * 2**30))
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        keep_fp32(network)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shape = list(tensor.shape)
        if shape and shape[0] == -1:  # the dynamic patch axis
            rest = shape[1:]
            profile.set_shape(tensor.name, [patches[0], *rest], [patches[1], *rest], [patches[2], *rest])
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine for {onnx_path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(serialized))
    return path


class EngineRunner:
    """One deserialized engine, run on torch CUDA tensors (inputs may be numpy or torch)."""

    def __init__(self, path: str | Path):
        import tensorrt as trt
        import torch

        self._trt, self._torch = trt, torch
        self.engine = trt.Runtime(_logger()).deserialize_cuda_engine(Path(path).read_bytes())
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
