"""Where the dense fp32 backbone's time goes, by ONNX operator, from onnxruntime's own profiler.

    python -m sps_driving.tools.op_profile --frames 20 --out runs/bench/ops.json

The exported backbone graph that `bench` times as encode (the shipped policy's road band, fp32,
every token) runs `frames` times, after warm-up runs, with the extractor's session options and
profiling on. Each node's kernel time is summed by operator type; each matrix product's FLOPs are
counted from the input and output shapes the profiler records, so the products' own rate at each
shape stands beside the GEMM peak measured in the same run at the ViT's shapes
(sps_driving.tools.peak). The profiler's own bookkeeping makes a profiled frame a little slower
than an unprofiled one; the shares are what this measures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

PRODUCTS = ("Gemm", "MatMul", "FusedMatMul")  # the operators that hold the counted FLOPs


def product_shape(args: dict) -> tuple[int, int, int, int]:
    """(batch, M, K, N) of a profiled product node from its first input's and its output's shapes.

    K = size(A) * N / size(output) holds for A = [..., M, K] and for a transposed A = [..., K, M],
    so the node's transpose attributes, which the profiler does not record, are not needed."""
    first_input = next(iter(args["input_type_shape"][0].values()))
    output = next(iter(args["output_type_shape"][0].values()))
    output_size = math.prod(output)
    n = output[-1]
    k = math.prod(first_input) * n // output_size
    m = output[-2] if len(output) > 1 else 1
    return output_size // (m * n), m, k, n


def calibration_rate(peak: dict, product: dict) -> float | None:
    """onnxruntime's calibrated fp32 rate [GFLOP/s] at a product's (M, K, N), if the calibration ran that shape."""
    if product["batch"] != 1:
        return None
    return next((entry["gflops"] for entry in peak["fp32"]["onnxruntime"]
                 if (entry["m"], entry["k"], entry["n"]) == (product["m"], product["k"], product["n"])), None)


def _frame_windows(events: list[dict], warmup: int) -> list[tuple[int, int]]:
    runs = sorted((event["ts"], event["ts"] + event["dur"]) for event in events if event.get("name") == "model_run")
    return runs[warmup:]


def summarize(events: list[dict], warmup: int) -> dict:
    """Per-frame operator times and product rates from an onnxruntime profile's events, the first
    `warmup` runs left out."""
    windows = _frame_windows(events, warmup)
    if not windows:
        raise ValueError("op_profile: the profile holds no timed run after the warm-up")
    frames = len(windows)
    by_op: dict[str, float] = defaultdict(float)
    by_shape: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])  # nodes, us
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        if not any(start <= event["ts"] <= end for start, end in windows):
            continue
        op = event["args"]["op_name"]
        by_op[op] += event["dur"]
        if op in PRODUCTS:
            entry = by_shape[(op, *product_shape(event["args"]))]
            entry[0] += 1
            entry[1] += event["dur"]
    kernel_us = sum(by_op.values())
    frame_ms = statistics.median((end - start) / 1e3 for start, end in windows)
    ops = [{"op": op, "ms": us / 1e3 / frames, "share": us / kernel_us} for op, us in sorted(by_op.items(), key=lambda item: -item[1])]
    products = []
    for (op, batch, m, k, n), (nodes, us) in sorted(by_shape.items(), key=lambda item: -item[1][1]):
        flop = 2 * batch * m * k * n * nodes
        products.append({"op": op, "batch": batch, "m": m, "k": k, "n": n, "nodes_per_frame": nodes // frames,
                         "ms": us / 1e3 / frames, "gflop": flop / 1e9 / frames, "gflops": flop / (us * 1e3)})
    product_us = sum(by_op[op] for op in PRODUCTS)
    return {"frames": frames, "frame_ms": frame_ms, "kernel_ms": kernel_us / 1e3 / frames,
            "product_share": product_us / kernel_us, "ops": ops, "products": products}


def profile_graph(graph: Path, inputs: dict[str, np.ndarray], threads: int, frames: int, warmup: int) -> dict:
    """Run `graph` warmup + frames times with profiling on; the summary of its profile."""
    import onnxruntime as ort

    from sps_driving.core.backbones.runtimes import session_options

    def profiled() -> list[dict]:
        options = session_options(threads)
        options.enable_profiling = True
        with tempfile.TemporaryDirectory() as folder:
            options.profile_file_prefix = str(Path(folder) / "ops")
            session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
            for _ in range(warmup + frames):
                session.run(None, inputs)
            return json.loads(Path(session.end_profiling()).read_text())

    # on a thread of its own, as the extractor's sessions (their flush-to-zero stays there)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="onnxruntime") as pool:
        events = pool.submit(profiled).result()
    return summarize(events, warmup)


def run(frames: int, warmup: int, seed: int, policy=None) -> dict:
    from sps_driving.core.backbones import resolve_config
    from sps_driving.core.backbones.dinov2 import load_dinov2
    from sps_driving.core.backbones.runtimes import BACKBONE_FILE
    from sps_driving.core.flops import ViTShape
    from sps_driving.core.policies.checkpoint import read_policy_config
    from sps_driving.core.resources import shipped_policy, source_revision
    from sps_driving.export.extractors import open_extractor, policy_extraction
    from sps_driving.tools.peak import measure_peak, vit_gemm_shapes

    recorded = policy_extraction(read_policy_config(policy or shipped_policy()))
    extractor = open_extractor(resolve_config({**recorded, "backend": "onnxruntime", "precision": "fp32", "tokens": "all",
                                               "device": "cpu"})).extractor
    shape = ViTShape.of(load_dinov2(recorded.get("model_path")))
    tokens = 1 + extractor.grid.n
    image = np.random.default_rng(seed).integers(0, 256, (600, 960, 3), dtype=np.uint8)
    peak = measure_peak(extractor.threads, vit_gemm_shapes(tokens, shape.hidden, shape.mlp_hidden))
    result = {"revision": source_revision(), "load_average": list(os.getloadavg()), "threads": extractor.threads,
              "tokens": tokens, "peak": peak}
    result["profile"] = profile_graph(extractor.export_dir / BACKBONE_FILE, {"pixel_values": extractor.pixels(image)},
                                      extractor.threads, frames, warmup)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=20, help="profiled frames (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="runs before them, left out (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random camera image")
    parser.add_argument("--policy", type=Path, help="policy whose extraction settings to profile (default: the shipped one)")
    parser.add_argument("--out", type=Path, help="also write the JSON result to this file")
    args = parser.parse_args(argv)
    result = run(args.frames, args.warmup, args.seed, args.policy)
    text = json.dumps(result)
    if args.out:
        args.out.write_text(text + "\n")
    profile = result["profile"]
    print(f"{profile['frame_ms']:.1f} ms a frame, {100 * profile['product_share']:.0f}% of kernel time in matrix products")
    for entry in profile["products"]:
        calibrated = calibration_rate(result["peak"], entry)
        print(f"  {entry['op']} {entry['batch']}x{entry['m']}x{entry['k']}x{entry['n']}: {entry['ms']:.1f} ms, "
              f"{entry['gflops']:.0f} GFLOP/s" + (f" (calibration {calibrated:.0f})" if calibrated else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
