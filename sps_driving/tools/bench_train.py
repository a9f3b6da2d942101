"""`sps-driving bench --train`: training throughput against the bound of the model's own products.

For each case (the positional transformer of Table 2, width 64, depth 2, 4 heads, and the grid
MLP of config/train.yaml, each at rates 0.5 and 1.0 with the sps variant, batch 64, the road
band's 12 x 24 patches of 384-d descriptors, both state inputs) it builds a synthetic feature
cache in a scratch folder (random float16 descriptors, labels and states: the speed does not
depend on what the numbers are), and times the trainer's real epochs on it: the cache reader,
the selection, the training step and the optimizer of `sps_driving.train.trainer`, on 1 and 2
torch threads, interleaved so that load on the machine affects all alike.

Per case and thread count it prints:

- frames/s of the training pass (the best of `repeats` epochs, after one untimed epoch), and its
  CPU time per frame (all threads);
- FLOPs per frame, forward and backward, counted from the shapes (`training_products`: every
  matrix product of a step; the elementwise work is not counted) and by torch's FLOP counter on
  one real step (they must agree);
- the bound: the time the step's products take at the rates the machine reaches for each of
  their shapes (a torch product timed alone, the attention torch's fused kernel alone:
  sps_driving.tools.peak), and the fraction of it the epoch reached (bound time / measured time).
  On one thread both are timed in CPU time (`peak.cpu_clock`), which other people's load on a
  shared machine does not stretch as it stretches wall time; on two, in wall time;
- where the epoch's time goes: reading the batch from the cache (and converting it), the
  selection and moving to the device, forward with the loss, backward, the optimizer step,
  validation, and the rest (Python around them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from sps_driving.core.resources import source_revision
from sps_driving.core.state import STATE_NAMES
from sps_driving.tools.peak import DEFAULT_SECONDS, attention_flops, attention_rates, product_rates
from sps_driving.train.cache import FeatureCacheWriter

GRID = (12, 24)  # the road band's patches (rows, cols)
DESCRIPTOR_DIM = 384  # DINOv2 ViT-S/14
TRANSFORMER = {"architecture": "positional_transformer", "width": 64, "depth": 2, "heads": 4}
# (label, TrainConfig overrides on config/train.yaml's defaults)
CASES = (
    ("PT-50", {**TRANSFORMER, "rate": 0.5}),
    ("PT-100", {**TRANSFORMER, "rate": 1.0}),
    ("MLP-50", {"architecture": "mlp", "rate": 0.5}),
    ("MLP-100", {"architecture": "mlp", "rate": 1.0}),
)
PHASES = ("read", "select", "forward", "backward", "optimizer", "validation", "python")
SOURCES = 9  # drives of the synthetic cache: one (a ninth) is held out for validation
FRAMES_PER_SOURCE = 64


def synthetic_cache(directory: Path, grid=GRID, dim: int = DESCRIPTOR_DIM, sources: int = SOURCES,
                    frames_per_source: int = FRAMES_PER_SOURCE, seed: int = 0) -> Path:
    """A feature cache of random frames in `directory`, written by the real writer (float16 descriptors)."""
    rng = np.random.default_rng(seed)
    meta = {"backbone": "synthetic", "grid": {"rows": grid[0], "cols": grid[1]}, "descriptor_dim": dim}
    with FeatureCacheWriter(directory, meta, shard_size=512) as writer:
        for source in range(sources):
            for frame in range(frames_per_source):
                state = {STATE_NAMES[0]: float(rng.uniform(2, 8)), STATE_NAMES[1]: float(rng.uniform(2, 8))}
                writer.add(rng.standard_normal((grid[0] * grid[1], dim)).astype(np.float16), float(rng.normal(0, 0.02)),
                           float(rng.normal(0, 0.1)), (source * frames_per_source + frame) * 33_000_000,
                           f"drive_{source:02d}", state)
    return directory


# ---- FLOPs from the shapes --------------------------------------------------------------------


def _linear(name: str, rows: int, inputs: int, outputs: int, input_grad: bool = True, count: int = 1) -> list[dict]:
    """A Linear layer on `rows` rows: its forward product and the backward ones (input gradient
    unless the input needs none, weight gradient), each (batch, m, k, n)."""
    products = [{"name": name, "pass": "forward", "shape": (1, rows, inputs, outputs), "count": count},
                {"name": name, "pass": "backward (weight)", "shape": (1, outputs, rows, inputs), "count": count}]
    if input_grad:
        products.append({"name": name, "pass": "backward (input)", "shape": (1, rows, outputs, inputs), "count": count})
    return products


def training_products(settings: dict, grid_n: int, dim: int, state_dim: int, batch: int) -> list[dict]:
    """Every matrix product of one training step of `batch` frames (forward and backward) of the
    grid MLP or the positional transformer of `settings` (TrainConfig fields), as
    {name, pass, shape (batch, m, k, n), count}: 2 * batch * m * k * n * count FLOPs each."""
    width, reduce = int(settings["width"]), int(settings["reduce"])
    rows = batch * grid_n
    if settings["architecture"] == "mlp":  # the reduction reads data (no input gradient); then the readout
        products = _linear("reduce", rows, dim, reduce, input_grad=False)
        return (products + _linear("mlp.1", batch, grid_n * reduce + state_dim, width)
                + _linear("mlp.2", batch, width, width // 2) + _linear("head", batch, width // 2, 2))
    if settings["architecture"] != "positional_transformer":
        raise ValueError(f"FLOPs of a training step are counted for mlp and positional_transformer, not {settings['architecture']}")
    depth, heads = int(settings["depth"]), int(settings["heads"])
    hidden, head_dim = int(width * float(settings["mlp_ratio"])), width // int(settings["heads"])
    products = _linear("input_proj", rows, dim, width, input_grad=False)
    products += _linear("qkv", rows, width, 3 * width, count=depth)
    products += [  # softmax(q k^T) v, torch's fused kernel (peak.attention_flops)
        {"name": "attention", "pass": "forward", "shape": (batch, heads, grid_n, head_dim), "count": depth,
         "attention": True},
        {"name": "attention", "pass": "backward", "shape": (batch, heads, grid_n, head_dim), "count": depth,
         "attention": True},
    ]
    products += _linear("out_proj", rows, width, width, count=depth)
    products += _linear("linear1", rows, width, hidden, count=depth) + _linear("linear2", rows, hidden, width, count=depth)
    products += _linear("reduce", rows, width, reduce)
    return (products + _linear("mlp.1", batch, grid_n * reduce + state_dim, width)
            + _linear("mlp.2", batch, width, width // 2) + _linear("head", batch, width // 2, 2))


def product_flops(product: dict) -> int:
    """FLOPs of one entry of `training_products`, 2 per multiply-add (attention: `peak.attention_flops`)."""
    if product.get("attention"):
        forward, backward = attention_flops(product["shape"])
        return (forward if product["pass"] == "forward" else backward) * int(product["count"])
    batch, m, k, n = product["shape"]
    return 2 * batch * m * k * n * int(product["count"])


def counted_step_flops(run, batch) -> int:
    """FLOPs of one real training step (forward, loss, backward) of `run` on `batch`, by torch's counter."""
    from torch.utils.flop_counter import FlopCounterMode

    from sps_driving.train.trainer import UNTIMED

    count_cpu_attention_flops()
    grids, target, _, index = batch
    generator = torch.Generator().manual_seed(0)
    with FlopCounterMode(display=False) as counter:
        loss = run.batch_loss(grids, target, index, generator, UNTIMED)
        loss.backward()
    run.optimizer.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


_REGISTERED_OPS = []


def count_cpu_attention_flops() -> None:
    """torch's FLOP counter knows the CUDA fused-attention kernels; teach it the CPU one (forward and
    backward, the latter for bench --train) too."""
    from torch.utils import flop_counter

    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", flop_counter.sdpa_flop),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", flop_counter.sdpa_backward_flop)):
        op = getattr(torch.ops.aten, name, None)
        if op is not None and op not in _REGISTERED_OPS and op not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op, get_raw=True)(formula)
            _REGISTERED_OPS.append(op)


# ---- timing -----------------------------------------------------------------------------------


class PhaseTimes:
    """A trainer clock (sps_driving.train.trainer.PhaseClock) that sums each phase's wall and CPU seconds."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu_seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start
            self.cpu_seconds[phase] += time.process_time() - cpu_start


def _timed_epoch(run, epoch: int) -> dict:
    """One training epoch and its validation, timed by phase: {"train_s", "train_cpu_s" (the process's CPU
    time, all threads: beside train_s it shows how much of the wall time other load took), "epoch_s",
    "frames", "wall": {phase: s}, "cpu": {phase: s}}; "python" is the rest of the epoch."""
    from sps_driving.train.trainer import validation_errors

    clock = PhaseTimes()
    start, cpu_start = time.perf_counter(), time.process_time()
    with contextlib.redirect_stderr(io.StringIO()):  # the epoch's progress bar
        _, frames = run.train_epoch(epoch, clock)
    train_s, train_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    with clock("validation"):
        validation_errors(run.policy, run.cache, run.val_frames, run.selector, run.state_names, run.cfg.batch_size,
                          run.procs.device)
    epoch_s, epoch_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    phases = {}
    for name, sums, total in (("wall", clock.seconds, epoch_s), ("cpu", clock.cpu_seconds, epoch_cpu_s)):
        phases[name] = {p: sums.get(p, 0.0) for p in PHASES if p != "python"}
        phases[name]["python"] = total - sum(phases[name].values())
    return {"train_s": train_s, "train_cpu_s": train_cpu_s, "epoch_s": epoch_s, "epoch_cpu_s": epoch_cpu_s,
            "frames": frames, **phases}


def _bound(products: list[dict], threads: int, seconds: float) -> dict:
    """The step's products at the machine's measured rate for each shape (attention: the fused
    kernel's): {"seconds", "gflops", "shapes"}."""
    shapes = sorted({p["shape"] for p in products if not p.get("attention")})
    rates = {(shape, None): rate for shape, rate in zip(shapes, product_rates(shapes, threads, seconds))}
    for shape in sorted({p["shape"] for p in products if p.get("attention")}):
        rates[(shape, "forward")], rates[(shape, "backward")] = attention_rates(shape, threads, seconds)

    def rate(product):
        return rates[(product["shape"], product["pass"] if product.get("attention") else None)]

    bound_s = sum(product_flops(p) / rate(p) for p in products)
    return {"seconds": bound_s, "gflops": sum(map(product_flops, products)) / bound_s / 1e9,
            "shapes": [{"shape": list(shape), "kind": kind or "matmul", "gflops": r / 1e9}
                       for (shape, kind), r in rates.items()]}


def bench_train(repeats: int = 2, threads=(1, 2), seconds: float = DEFAULT_SECONDS, cases=CASES, grid=GRID,
                dim: int = DESCRIPTOR_DIM, sources: int = SOURCES, frames_per_source: int = FRAMES_PER_SOURCE,
                seed: int = 0) -> dict:
    """Every case on every thread count, interleaved: the result `format_train` prints."""
    from sps_driving.train.distributed import start_processes
    from sps_driving.train.trainer import TrainConfig, TrainingRun

    before = torch.get_num_threads()
    result = {"revision": source_revision(), "load_average": list(os.getloadavg()), "repeats": repeats,
              "threads": list(threads), "batch_size": None, "grid": list(grid), "descriptor_dim": dim,
              "data": f"synthetic cache of {sources} drives x {frames_per_source} frames (float16), built in the run",
              "cases": []}
    procs = start_processes("cpu")
    with tempfile.TemporaryDirectory(prefix="sps_bench_train_") as scratch:
        cache = synthetic_cache(Path(scratch) / "cache", grid, dim, sources, frames_per_source, seed)
        runs = []
        for label, overrides in cases:
            cfg = TrainConfig.from_yaml(cache=str(cache), out=str(Path(scratch) / label), device="cpu", seed=seed,
                                        **overrides)
            run = TrainingRun(cfg, procs, None, None)
            batch = next(iter(run.loader))
            products = training_products(dataclasses.asdict(cfg), run.cache.grid.n, run.cache.descriptor_dim,
                                         len(run.state_names), cfg.batch_size)
            shape_flops = sum(map(product_flops, products))
            runs.append((run, products, {
                "label": label, "settings": overrides, "batch_size": cfg.batch_size,
                "train_frames": int(len(run.train_idx)), "validation_frames": int(len(run.val_idx)),
                "flops_per_frame": shape_flops / cfg.batch_size,
                "counted_flops_per_frame": counted_step_flops(run, batch) / len(batch[0]),
                "by_threads": {}}))
            result["batch_size"] = cfg.batch_size
        try:
            for count in threads:  # the bound of each case on each thread count, before any timing
                for _, products, record in runs:
                    record["by_threads"][str(count)] = {"bound": _bound(products, count, seconds), "epochs": []}
            for repeat in range(repeats + 1):
                for run, _, record in runs:
                    for count in threads:
                        torch.set_num_threads(count)
                        epoch = _timed_epoch(run, repeat * len(threads) + list(threads).index(count))
                        if repeat:  # the first is untimed: allocator, caches, lazy initialization
                            record["by_threads"][str(count)]["epochs"].append(epoch)
        finally:
            torch.set_num_threads(before)
            procs.close()
    for *_, record in runs:
        for count, entry in record["by_threads"].items():
            # Against the bound, the epochs on the bound's clock (peak.cpu_clock): CPU time on one thread.
            entry["timed_by"] = "cpu" if int(count) == 1 else "wall"
            clocked = "train_cpu_s" if entry["timed_by"] == "cpu" else "train_s"
            best = min(entry["epochs"], key=lambda e, clocked=clocked: e[clocked])
            step_bound_s = entry["bound"]["seconds"]
            entry["best"] = best
            entry["frames_per_s"] = best["frames"] / best["train_s"]
            entry["clock_frames_per_s"] = best["frames"] / best[clocked]
            entry["gflops"] = record["flops_per_frame"] * entry["clock_frames_per_s"] / 1e9
            entry["bound_frames_per_s"] = record["batch_size"] / step_bound_s
            entry["fraction_of_bound"] = entry["clock_frames_per_s"] / entry["bound_frames_per_s"]
        result["cases"].append(record)
    return result


def format_train(result: dict) -> str:
    """Two tables: throughput against the bound, and where an epoch's time goes."""
    lines = [f"training throughput (bench --train; {result['data']}; batch {result['batch_size']}, "
             f"grid {result['grid'][0]}x{result['grid'][1]} x {result['descriptor_dim']}; load average "
             f"{', '.join(f'{v:.2f}' for v in result['load_average'])}; revision {result['revision']})", "",
             "| case | threads | frames/s | ms/frame | CPU ms/frame | GFLOP/frame (shapes / torch counter) | GFLOP/s | "
             "bound GFLOP/s (own shapes) | bound frames/s | fraction of bound (clock) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for case in result["cases"]:
        for threads, entry in case["by_threads"].items():
            cpu_ms = 1e3 * entry["best"]["train_cpu_s"] / entry["best"]["frames"]
            lines.append(f"| {case['label']} | {threads} | {entry['frames_per_s']:.0f} | {1e3 / entry['frames_per_s']:.2f} | "
                         f"{cpu_ms:.2f} | "
                         f"{case['flops_per_frame'] / 1e9:.3f} / {case['counted_flops_per_frame'] / 1e9:.3f} | "
                         f"{entry['gflops']:.1f} | {entry['bound']['gflops']:.1f} | {entry['bound_frames_per_s']:.0f} | "
                         f"{entry['fraction_of_bound']:.0%} ({entry['timed_by']}) |")
    lines += ["", "where the best epoch's time goes, on the bound's clock (ms per training frame; validation per "
              "validation frame)", "",
              "| case | threads | " + " | ".join(PHASES) + " |", "| --- | --- | " + " | ".join("---" for _ in PHASES) + " |"]
    for case in result["cases"]:
        for threads, entry in case["by_threads"].items():
            best = entry["best"]
            cells = [1e3 * best[entry["timed_by"]][p] / (case["validation_frames"] if p == "validation" else best["frames"])
                     for p in PHASES]
            lines.append(f"| {case['label']} | {threads} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


def run_train(args) -> int:
    import json

    cases = [case for case in CASES if not args.train_cases or case[0] in args.train_cases]
    result = bench_train(repeats=args.repeats or 2, seconds=args.calibration_seconds, seed=args.seed,
                         threads=tuple(args.train_threads), cases=cases)
    text = json.dumps(result, indent=None if args.json else 2, default=_plain)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else format_train(result))
    return 0


def _plain(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"{type(value)} is not JSON")
