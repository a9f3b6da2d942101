"""The machine's measured GEMM peak: what a stage's FLOPs per second are compared with.

A short calibration (a few seconds) times single matrix products on the threads the extractor
runs on, at the shapes of the ViT's Linear layers (T tokens x D -> D, D -> 4D, 4D -> D) and at one
large square product (what a GEMM library runs closest to the hardware's limit):

- fp32: onnxruntime's MatMul (MLAS, the library the extractor's exported graphs run on) with the
  extractor's session options, and torch.matmul (the torch backend's); the peak is the best of both;
- int8: onnxruntime's dynamic quantization of the same product (the activations quantized per
  call, int8 x int8 -> int32 with the weights int8 per channel, then dequantized): the path of
  `precision: int8`, counted as 2 operations per multiply-add, like fp32.

Each product's rate is the best of repeated runs over `seconds` (the least disturbed by other
load on the machine); the peak is the largest of the shapes'. A run on a busy machine measures
less than the machine can do: efficiencies against it are then too high, never too low.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

LARGE = (1024, 1024, 1024)  # (M, K, N) of the large square product
DEFAULT_SECONDS = 0.4  # s of repeated runs per product and library


def vit_gemm_shapes(tokens: int, hidden: int, mlp_hidden: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of a ViT layer's Linear products on `tokens` rows, and the large square one."""
    return [(tokens, hidden, hidden), (tokens, hidden, mlp_hidden), (tokens, mlp_hidden, hidden), LARGE]


def _matmul_model(k: int, n: int, seed: int = 0):
    """An ONNX graph Y = A B with A [M, K] an input (M dynamic) and B [K, N] a weight."""
    from onnx import TensorProto, helper, numpy_helper

    weight = (np.random.default_rng(seed).standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "B"], ["Y"])], "gemm",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(weight, "B")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _quantized(model):
    """`model` with onnxruntime's dynamic int8 quantization, as the int8 extractor graphs are made."""
    import tempfile
    from pathlib import Path

    import onnx

    from sps_driving.export.cache import quantize_int8

    with tempfile.TemporaryDirectory(prefix="sps_gemm_") as scratch:
        source, target = Path(scratch) / "fp32.onnx", Path(scratch) / "int8.onnx"
        onnx.save(model, source)
        quantize_int8(source, target)
        return onnx.load(str(target))


def _best_rate(run, flops: int, seconds: float, clock=time.perf_counter) -> float:
    """The largest FLOP/s of `run()` over repeated calls for about `seconds` (one untimed first), timed
    by `clock` (wall time; `cpu_clock` for one thread on a shared machine)."""
    run()
    best, spent = float("inf"), 0.0
    while spent < seconds or best == float("inf"):
        start, wall = clock(), time.perf_counter()
        run()
        best, spent = min(best, max(clock() - start, 1e-9)), spent + time.perf_counter() - wall
    return flops / best


def cpu_clock(threads: int):
    """The clock of a product's time on `threads` threads that other load on the machine does not
    stretch: the process's CPU time on one thread (torch runs it on the calling thread), else wall time."""
    return time.process_time if threads == 1 else time.perf_counter


def _onnxruntime_rates(shapes, threads: int, seconds: float, int8: bool) -> list[float]:
    import onnxruntime as ort

    from sps_driving.core.backbones.runtimes import session_options

    rates = []
    for m, k, n in shapes:
        model = _matmul_model(k, n)
        if int8:
            model = _quantized(model)
        session = ort.InferenceSession(model.SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"])
        feed = {"A": np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)}
        rates.append(_best_rate(lambda session=session, feed=feed: session.run(["Y"], feed), 2 * m * k * n, seconds))
    return rates


def _torch_rates(shapes, threads: int, seconds: float, device: str = "cpu", dtype: str = "float32",
                 clock=time.perf_counter) -> list[float]:
    """FLOP/s of torch.matmul at each shape (M, K, N), or (batch, M, K, N) for a batched product."""
    import torch

    device = torch.device(device)
    cuda = device.type == "cuda"

    def product(a, b):
        out = torch.matmul(a, b)
        if cuda:
            torch.cuda.synchronize()
        return out

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rates = []
        generator = torch.Generator().manual_seed(0)
        for shape in shapes:
            *batch, m, k, n = shape
            a, b = (torch.randn(*batch, *size, generator=generator).to(device, getattr(torch, dtype))
                    for size in ((m, k), (k, n)))
            with torch.inference_mode():
                rates.append(_best_rate(lambda a=a, b=b: product(a, b), 2 * math.prod(shape), seconds, clock))
        return rates
    finally:
        torch.set_num_threads(before)


def product_rates(shapes, threads: int, seconds: float = DEFAULT_SECONDS) -> list[float]:
    """FLOP/s torch reaches on the CPU on `threads` threads for products of each shape (M, K, N) or
    (batch, M, K, N), each timed alone by `cpu_clock`: a training step's products (sps_driving.tools.bench_train)."""
    return _torch_rates([tuple(int(v) for v in shape) for shape in shapes], threads, seconds, clock=cpu_clock(threads))


def attention_rates(shape, threads: int, seconds: float = DEFAULT_SECONDS) -> tuple[float, float]:
    """(forward, backward) FLOP/s of torch's fused scaled_dot_product_attention on the CPU at `shape`
    (batch, heads, tokens, head width), timed by `cpu_clock`, counted as torch's FLOP counter counts it (`attention_flops`):
    with 16-wide heads it runs several times faster than its products as separate batched matmuls,
    so a bound from those would not be one."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention as attention

    forward_flops, backward_flops = attention_flops(shape)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(*shape, generator=generator, requires_grad=True) for _ in range(3))
        grad = torch.randn(*shape, generator=generator)
        with torch.no_grad():
            forward = _best_rate(lambda: attention(q, k, v), forward_flops, seconds, cpu_clock(threads))
        both = _best_rate(lambda: torch.autograd.grad(attention(q, k, v), (q, k, v), grad), forward_flops + backward_flops,
                          seconds, cpu_clock(threads))
    finally:
        torch.set_num_threads(before)
    # The backward's share of the fused pass's time, with the forward's share at the forward's rate.
    backward_s = (forward_flops + backward_flops) / both - forward_flops / forward
    return forward, backward_flops / max(backward_s, 1e-12)


def attention_flops(shape) -> tuple[int, int]:
    """(forward, backward) FLOPs of fused attention at (batch, heads, tokens, head width), 2 per
    multiply-add: q k^T and p v forward; backward the scores again (the kernel recomputes them),
    dp, dv, dq and dk, as torch's FLOP counter counts it."""
    batch, heads, tokens, width = (int(v) for v in shape)
    product = 2 * batch * heads * tokens * tokens * width
    return 2 * product, 5 * product


def measure_peak(threads: int, shapes=(LARGE,), seconds: float = DEFAULT_SECONDS, device: str = "cpu",
                 dtype: str = "float32") -> dict:
    """The measured peak [GFLOP/s] on `threads` threads: {"threads", "seconds_per_product",
    "fp32": {"peak_gflops", "onnxruntime": [...], "torch": [...]}, "int8": {"peak_gops",
    "onnxruntime": [...]}}, each list one entry per shape {"m", "k", "n", "gflops"}. On a CUDA
    `device`: torch's products on it in `dtype` only (as "fp32", named by "dtype"), no int8."""
    shapes = [tuple(int(v) for v in shape) for shape in shapes]

    def listed(rates):
        return [{"m": m, "k": k, "n": n, "gflops": rate / 1e9} for (m, k, n), rate in zip(shapes, rates)]

    if str(device).startswith("cuda"):
        rates = _torch_rates(shapes, threads, seconds, device, dtype)
        return {"threads": threads, "seconds_per_product": seconds, "device": str(device), "dtype": dtype,
                "fp32": {"peak_gflops": max(rates) / 1e9, "onnxruntime": [], "torch": listed(rates)},
                "int8": {"peak_gops": float("nan"), "onnxruntime": []}}
    # onnxruntime's sessions run on a thread of their own, as the extractor's (their flush-to-zero stays there).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="onnxruntime") as pool:
        ort_fp32 = pool.submit(_onnxruntime_rates, shapes, threads, seconds, False).result()
        ort_int8 = pool.submit(_onnxruntime_rates, shapes, threads, seconds, True).result()
    torch_fp32 = _torch_rates(shapes, threads, seconds)
    return {
        "threads": threads, "seconds_per_product": seconds, "device": "cpu", "dtype": "float32",
        "fp32": {"peak_gflops": max(ort_fp32 + torch_fp32) / 1e9, "onnxruntime": listed(ort_fp32), "torch": listed(torch_fp32)},
        "int8": {"peak_gops": max(ort_int8) / 1e9, "onnxruntime": listed(ort_int8)},
    }


def peak_of(peak: dict, precision: str) -> float:
    """The measured peak [GFLOP/s] (int8: GOP/s) for a stage of `precision` (fp32 | int8)."""
    return peak["int8"]["peak_gops"] if precision == "int8" else peak["fp32"]["peak_gflops"]


def format_peak(peak: dict) -> str:
    """Two lines: each library's rate per shape and the peak."""
    def rates(entries):
        return ", ".join(f"{e['m']}x{e['k']}x{e['n']} {e['gflops']:.0f}" for e in entries)

    fp32, int8 = peak["fp32"], peak["int8"]
    if peak.get("given"):
        return f"GEMM peak given (--peak-gflops): {fp32['peak_gflops']:g} GFLOP/s, not measured"
    if peak.get("device", "cpu") != "cpu":
        return f"measured GEMM peak on {peak['device']}: {peak['dtype']} {fp32['peak_gflops']:.1f} GFLOP/s (torch {rates(fp32['torch'])})"
    return (f"measured GEMM peak on {peak['threads']} thread(s): fp32 {fp32['peak_gflops']:.1f} GFLOP/s "
            f"(onnxruntime {rates(fp32['onnxruntime'])}; torch {rates(fp32['torch'])} GFLOP/s)\n"
            f"                                int8 {int8['peak_gops']:.1f} GOP/s (onnxruntime dynamic quantization "
            f"{rates(int8['onnxruntime'])} GOP/s)")
