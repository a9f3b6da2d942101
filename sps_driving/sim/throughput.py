"""`sps-driving bench --eval`: how many episodes an hour `sps-driving eval` drives on this machine,
where the time of a frame goes, and what other paths would give, side by side in one run.

Each configuration (`CONFIGURATIONS`) drives the same episodes (scenario, layout seed) of one
policy in process:

- throughput: the episodes through `run_episodes` (the pool of worker processes `eval` uses,
  process start and model loading included, as an eval run pays them), timed on the wall clock:
  episodes per hour;
- split: one more episode in this process with its renderer, extractor, policy and world step
  timed (their share of a frame; "other" is the rest of the episode loop: frame stamps, patch
  selection, the state inputs, the expert-free bookkeeping);
- same results: whether each of its episodes' results (score, failures, frames dropped, smallest
  gap) equal the default configuration's on the same episode: an option that changes them stays
  opt-in until a closed-loop comparison validates it (README, "Extraction settings and backends").

Configurations run interleaved, one round of all of them per --repeats, so that load on the
machine affects all alike. "threads" runs one worker on all the threads instead of a worker per
thread; "int8" the onnxruntime int8 graph; "kept" and "kept-int8" token dropping, on a timing copy
of the policy (its weights at its rate with tokens kept: for the time only, not for its driving).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from sps_driving.core.resources import source_revision

# name: (workers, threads per worker, precision, tokens)
CONFIGURATIONS = {
    "default": (2, 1, "fp32", None),  # what `eval` runs: 2 workers of 1 thread, the policy's own descriptors
    "threads": (1, 2, "fp32", None),
    "int8": (2, 1, "int8", None),
    "kept": (2, 1, "fp32", "kept"),
    "kept-int8": (2, 1, "int8", "kept"),
}
STAGES = ("render", "extraction", "policy", "world", "other")
SAME_KEYS = ("score", "failures", "dropped_frames", "min_gap_m")  # an episode's results that must not change


class StageClock:
    """Seconds spent in wrapped methods, by stage."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, stage: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - start

        setattr(owner, name, timed)


def stage_split(config: dict, policy_dir: str, task: tuple[str, int], threads: int, precision: str,
                backbone_config: str | None = None) -> dict:
    """ms per frame of each stage (STAGES) of one episode driven in this process, as an eval worker drives it."""
    import torch

    from sps_driving.sim.episodes import PolicyDriver, drive_episode, episode_steps
    from sps_driving.sim.render import get_renderer
    from sps_driving.sim.scenarios import get_scenario
    from sps_driving.sim.world import World, make_episode

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        driver = PolicyDriver(policy_dir, "cpu", threads, backbone_config, precision=precision)
        renderer = get_renderer(config)
        clock = StageClock()
        clock.wrap(renderer, "render", "render")
        clock.wrap(driver.extractor, "encode", "extraction")
        clock.wrap(driver.extractor, "descriptors", "extraction")
        clock.wrap(driver.streaming, "step", "policy")
        scenario, seed = task
        world = World(config, make_episode(config, get_scenario(scenario), seed))
        clock.wrap(world, "step", "world")
        start = time.perf_counter()
        drive_episode(config, world, seed, driver.drive, renderer=renderer)
        total = time.perf_counter() - start
    finally:
        torch.set_num_threads(before)
    steps = episode_steps(config)
    split = {stage: 1e3 * clock.seconds[stage] / steps for stage in STAGES[:-1]}
    split["other"] = 1e3 * total / steps - sum(split.values())
    return {"ms_per_frame": split, "frame_ms": 1e3 * total / steps}


def drive(config: dict, policy_dir: str, tasks: list, workers: int, threads: int, precision: str) -> tuple[float, list[dict]]:
    """(wall s, result rows) of `tasks` through eval's worker pool."""
    from sps_driving.sim.episodes import run_episodes

    config = {**config, "eval": {**config.get("eval", {}), "torch_threads_per_worker": threads}}
    rows = []
    start = time.perf_counter()
    run_episodes(config, policy_dir, tasks, workers, "cpu", lambda row: rows.append(row), precision=precision)
    return time.perf_counter() - start, rows


def same_results(rows: list[dict], reference: list[dict]) -> bool:
    """Whether every episode of `rows` has the results of the same episode in `reference`."""
    def keyed(items):
        return {(r["scenario"], r["episode"]): tuple(json.dumps(r.get(k), sort_keys=True) for k in SAME_KEYS) for r in items}

    mine, theirs = keyed(rows), keyed(reference)
    return all(theirs.get(key) == value for key, value in mine.items())


def bench_eval(config: dict, policy_dir: Path, tasks: list[tuple[str, int]], names: list[str], repeats: int = 1) -> dict:
    """Each configuration of `names` on `tasks`, interleaved `repeats` times (module docstring)."""
    from sps_driving.core.policies.checkpoint import timing_copy

    unknown = sorted(set(names) - set(CONFIGURATIONS))
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; known: {list(CONFIGURATIONS)}")
    names = ["default", *[name for name in names if name != "default"]]  # the reference comes first
    results = {name: {"walls": [], "rows": []} for name in names}
    with tempfile.TemporaryDirectory(prefix="sps_bench_eval_") as scratch:
        policies = {name: str(policy_dir if CONFIGURATIONS[name][3] is None
                              else timing_copy(policy_dir, Path(scratch) / f"policy_{CONFIGURATIONS[name][3]}",
                                               tokens=CONFIGURATIONS[name][3]))
                    for name in names}
        for _ in range(repeats):
            for name in names:
                workers, threads, precision, _tokens = CONFIGURATIONS[name]
                wall, rows = drive(config, policies[name], tasks, workers, threads, precision)
                results[name]["walls"].append(wall)
                results[name]["rows"] = rows
        for name in names:
            workers, threads, precision, tokens = CONFIGURATIONS[name]
            results[name]["split"] = stage_split(config, policies[name], tasks[0], threads, precision)
    out = {"policy": str(policy_dir), "tasks": [list(task) for task in tasks], "episode_s": float(config["episode_s"]),
           "repeats": repeats, "cores": len(os.sched_getaffinity(0)), "revision": source_revision(),
           "load_average": list(os.getloadavg()),
           "configurations": []}
    reference = results["default"]
    for name in names:
        workers, threads, precision, tokens = CONFIGURATIONS[name]
        wall = float(np.median(results[name]["walls"]))
        out["configurations"].append({
            "name": name, "workers": workers, "threads_per_worker": threads, "precision": precision,
            "tokens": tokens or "the policy's", "timing_copy": tokens is not None,
            "wall_s": wall, "episodes_per_hour": 3600 * len(tasks) / wall,
            "speedup": float(np.median(reference["walls"])) / wall,
            "same_results": same_results(results[name]["rows"], reference["rows"]),
            **results[name]["split"],
        })
    return out


def format_eval(result: dict) -> str:
    lines = [f"{len(result['tasks'])} episode(s) of {result['episode_s']:g} s of {result['policy']} per configuration, "
             f"{result['repeats']} round(s), {result['cores']} core(s), load average "
             f"{' '.join(f'{v:.2f}' for v in result['load_average'])}",
             f"{'configuration':<14}{'workers x threads':>18}{'episodes/h':>12}{'speed-up':>10}{'same results':>14}"
             f"{'frame ms':>10}" + "".join(f"{stage:>12}" for stage in STAGES)]
    for c in result["configurations"]:
        split = c["ms_per_frame"]
        lines.append(f"{c['name']:<14}{c['workers']:>11} x {c['threads_per_worker']:<4}{c['episodes_per_hour']:>12.1f}"
                     f"{c['speedup']:>9.2f}x{'yes' if c['same_results'] else 'no':>14}{c['frame_ms']:>10.1f}"
                     + "".join(f"{split[stage]:>7.1f} {100 * split[stage] / c['frame_ms']:>3.0f}%" for stage in STAGES))
    lines.append("stage columns: ms per frame in one episode in process, and its share of the frame; "
                 "kept, kept-int8: a timing copy of the policy (token dropping), not its driving")
    return "\n".join(lines)
