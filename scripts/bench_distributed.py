"""Speed-up of `sps-driving extract` and `sps-driving eval` on 2 torchrun processes over 1, on this machine.

    .venv/bin/python scripts/bench_distributed.py --work runs/bench_distributed

Makes its inputs once in WORK (expert drives of `sps-driving collect`), then runs each command
under `torchrun --standalone --nproc-per-node=N` for N = 1 and 2, alternating, `--repeats` times,
each into a fresh output folder: `extract` of the drives with config/extraction.yaml's
extractor, and `eval` of `--policy` (default the shipped policy) on `--episodes`
layouts of two scenarios. It prints every run's wall-clock seconds (starting the processes and
loading the extractor included, as a user waits for them), the medians and the speed-up, and
checks that the two caches hold the same frames and the two result files the same episodes.

One process uses every core for its torch threads; under torchrun with 2 processes each gets one
thread (torchrun sets OMP_NUM_THREADS=1), so on a machine of few cores the speed-up is bounded
by the cores, not by the number of processes. On several GPUs each process has its own.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sps_driving.core.resources import shipped_policy

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ["rural-summer-dry-day-car", "urban-winter-snow-day-animal"]


def sps_driving(*args) -> None:
    subprocess.run([sys.executable, "-m", "sps_driving.cli", *map(str, args)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)


def timed_torchrun(processes: int, *args) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                    "-m", "sps_driving.cli", *map(str, args)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the drives and every run's output")
    parser.add_argument("--drives", type=int, default=4, help="expert drives to extract")
    parser.add_argument("--drive-s", type=float, default=10.0, help="length of each drive, s")
    parser.add_argument("--policy", type=Path, default=shipped_policy(), help="policy to evaluate")
    parser.add_argument("--episodes", type=int, default=2, help="evaluation layouts per scenario (two scenarios)")
    parser.add_argument("--episode-s", type=float, default=10.0, help="evaluation episode length, s")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each command and process count")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))  # this checkout's sps_driving, as the commands run it
    from sps_driving.train.cache import FeatureCache

    drives = args.work / "drives"
    if not drives.is_dir():
        sps_driving("collect", "--out", drives, "--episodes", args.drives, "--episode-s", args.drive_s, "--seed", 0)
    bags = sorted(p for p in drives.iterdir() if p.is_dir())
    jobs = {
        "extract": lambda out: ["extract", "--out", out, *bags],
        "eval": lambda out: ["eval", "--policy", args.policy, "--first-seed", 0, "--episodes", args.episodes,
                             "--episode-s", args.episode_s, "--no-failure-strips", "--scenarios", *SCENARIOS, "--out", out],
    }
    seconds = {(job, n): [] for job in jobs for n in (1, 2)}
    for repeat in range(args.repeats):
        for job, command in jobs.items():
            for n in (1, 2):
                out = args.work / f"{job}_{n}_{repeat}"
                shutil.rmtree(out, ignore_errors=True)
                seconds[job, n].append(timed_torchrun(n, *command(out)))
                print(f"{job} on {n} process(es), run {repeat}: {seconds[job, n][-1]:.1f} s", flush=True)

    one, two = FeatureCache(args.work / "extract_1_0"), FeatureCache(args.work / "extract_2_0")
    assert len(one) == len(two) and (one.stamps == two.stamps).all(), "the two caches differ"
    rows = {n: {(r["scenario"], r["seed"]): r["score"] for r in map(json.loads, (args.work / f"eval_{n}_0" / "results.jsonl")
                                                                     .read_text().splitlines())} for n in (1, 2)}
    assert rows[1] == rows[2], "the two evaluations differ"
    units = {"extract": (len(one), "frames"), "eval": (len(rows[1]), "episodes")}
    for job in jobs:
        count, unit = units[job]
        t1, t2 = (statistics.median(seconds[job, n]) for n in (1, 2))
        print(f"{job}: {count} {unit}; 1 process {t1:.1f} s ({count / t1:.2f} {unit}/s), 2 processes {t2:.1f} s "
              f"({count / t2:.2f} {unit}/s): speed-up {t1 / t2:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
