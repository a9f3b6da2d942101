"""The results store of `sps-driving eval`: OUT/results.jsonl, one JSON row per finished episode.

Every finished episode is appended (and flushed) as it comes, and a rerun skips the episodes
already there, so an interrupted evaluation resumes. A row records the method, its settings
(profile, episode length, rendered size), the policy (as `resources.portable_path` names it:
relative to the repository, so a result file names no folder of the machine that wrote it; older
rows hold absolute paths: `resources.recorded_path` resolves either) and the episode's result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from sps_driving.resources import portable_path

RESULTS_FILE = "results.jsonl"


@dataclass(frozen=True)
class EvalSettings:
    method: str
    policy_dir: str | None
    profile: str
    episodes: int
    episode_s: float
    width: int
    height: int

    def key(self, scenario: str, episode: int) -> tuple:
        return (self.method, scenario, episode, self.episode_s, self.width, self.height)


def _row_key(row: dict) -> tuple:
    return (row["method"], row["scenario"], row["episode"], row["episode_s"], row["width"], row["height"])


def read_results(path: Path) -> list[dict]:
    """The rows of a results file, in the order written."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by an interrupted run; that episode reruns
    return rows


def missing_tasks(settings: EvalSettings, scenarios: list[str], path: Path) -> list[tuple[str, int]]:
    done = {_row_key(r) for r in read_results(path)}
    tasks = [(s, e) for s in scenarios for e in range(settings.episodes) if settings.key(s, e) not in done]
    if not tasks:
        print(f"all {len(scenarios) * settings.episodes} episodes of {settings.method} already in {path}")
    return tasks


class Recorder:
    """Appends finished episodes to results.jsonl (flushed: a killed run resumes from there)."""

    def __init__(self, settings: EvalSettings, path: Path, total: int, **extra):
        self.extra = {"method": settings.method, "profile": settings.profile, "episode_s": settings.episode_s,
                      "width": settings.width, "height": settings.height,
                      "policy": None if settings.policy_dir is None else portable_path(settings.policy_dir), **extra}
        self.sink = path.open("a")
        self.bar = tqdm(total=total, desc=f"eval {settings.method}", unit="episode")
        self.rows: list[dict] = []

    def __call__(self, row: dict) -> None:
        row = {**self.extra, **row}
        self.sink.write(json.dumps(row) + "\n")
        self.sink.flush()
        self.rows.append(row)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.sink.close()
