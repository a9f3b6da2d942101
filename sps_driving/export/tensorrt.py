"""Building TensorRT engines for the exported graphs, through the `tensorrt` Python API (GPU
machines only); loading and running them is the runtime's (core/backbones/runtimes.py).

fp16 engines keep LayerNorm, softmax and reductions (the ITC normalization) in fp32: transformers'
LayerNorm overflows in fp16. The per-patch graph gets one optimization profile over the patch
batch (min / opt / max patches). Engines are cached beside the ONNX files, named by GPU, TensorRT
version, precision and the graph's hash (`engine_path`).
`tensorrt` is imported only inside these functions: it is an optional extra.
"""

from __future__ import annotations

from pathlib import Path

from sps_driving.core.backbones.runtimes import engine_path, tensorrt_logger

DEFAULT_WORKSPACE_GB = 4  # builder scratch memory [GiB]


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


def default_profile(meta: dict) -> tuple[int, int, int]:
    """(min, opt, max) patches of the per-patch engine for an export (its export.json): up to the
    whole grid (token dropping runs all of a frame's kept patches in one call), at least 1, 128, 256."""
    rows, cols = meta["grid"]
    return 1, max(128, rows * cols // 2), max(256, rows * cols)


def ensure_engines(export_dir: str | Path, fp16: bool = True) -> list[Path]:
    """The engines of both graphs of an export, built now where missing (default profile)."""
    from sps_driving.core.backbones.runtimes import BACKBONE_FILE, PATCHES_FILE, read_export

    export_dir = Path(export_dir)
    profile = default_profile(read_export(export_dir, {"export_dir": str(export_dir)}))
    return [build_engine(export_dir / graph, fp16=fp16, patches=profile) for graph in (BACKBONE_FILE, PATCHES_FILE)]


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
    logger = tensorrt_logger()
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
