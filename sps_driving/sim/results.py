"""The results store of `sps-driving eval`: OUT/results.jsonl, one JSON row per finished episode.

Every finished episode is appended (and flushed) as it comes, and a rerun skips the episodes
already there, so an interrupted evaluation resumes. A row records the method, its settings
(profile, episode length, rendered size), the layout (`seed`, the episode seed; `first_seed`, the
first layout of the run that drove it), the policy (as `resources.portable_path` names it:
relative to the repository, so a result file names no folder of the machine that wrote it; older
rows hold absolute paths: `resources.recorded_path` resolves either) and the policy's training
seed (`training_seed`; several checkpoints of one method, trained from different seeds, are rows
of the same method) and the episode's result. An episode is done once a row of the same method,
training seed, scenario, layout seed, episode length and size is there, whichever run wrote it.
Rows from before layout seeds were chosen lack `first_seed` and `training_seed`: their layouts
were 0..N-1 (`seed`) and their training seed is unknown (None).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from sps_driving.core.resources import portable_path

OOD_RULE_SUFFIX = "+OOD"  # a method evaluated with --ood-rule

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
    first_seed: int = 0  # layouts first_seed .. first_seed + episodes - 1
    training_seed: int | None = None  # the policy's (sps_driving.sim.tables.training_seed); None for the expert

    @property
    def seeds(self) -> range:
        return range(self.first_seed, self.first_seed + self.episodes)

    def key(self, scenario: str, seed: int) -> tuple:
        return (self.method, self.training_seed, scenario, seed, self.episode_s, self.width, self.height)


def row_key(row: dict) -> tuple:
    """What makes a row one episode: method, training seed, scenario, layout seed, episode length, size."""
    return (row["method"], row.get("training_seed"), row["scenario"], row["seed"], row["episode_s"], row["width"], row["height"])


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


def merge_results(paths: list[str]) -> list[dict]:
    """The episodes of every results file (or eval folder) given; where two files hold the same
    episode (method, training seed, scenario, layout, length, size, and the OOD rule or cruise scale
    it drove under), the later file's row wins. Where both drove it alike frame for frame (the same
    frame times, steering and failures: the closed loop is deterministic), the later row also takes
    the per-frame scores only the earlier one logged, so scores logged by runs with different
    calibrations can be read side by side. Rows of one method name driven under several conditions
    (`eval --name` with `--ood-rule` or `--cruise-scale`) are told apart by the suffix eval gives
    such a run when it names it itself (`condition_suffix`)."""
    rows: dict = {}
    for given in paths:
        path = Path(given)
        path = path / RESULTS_FILE if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"no results at {path}: give an `sps-driving eval --out` folder or its {RESULTS_FILE}")
        for row in read_results(path):
            key = (*row_key(row), driving_condition(row))
            earlier = rows.get(key)
            if earlier is not None and _same_drive(earlier, row):
                row["ood"]["scores"] = {**earlier["ood"].get("scores", {}), **row["ood"].get("scores", {})}
            rows[key] = row
    conditions: dict = {}
    for (*_, condition), row in rows.items():
        conditions.setdefault(row["method"], set()).add(condition)
    for (*_, condition), row in rows.items():
        if condition is not None and len(conditions[row["method"]]) > 1:
            row["method"] += condition_suffix(*condition)
    return list(rows.values())


def driving_condition(row: dict) -> tuple | None:
    """(OOD rule on, cruise scale, what slows the car) of an episode driven with the rule or a constant
    cruise scale; None for one driven as the policy drives."""
    ood = row.get("ood") or {}
    rule, scale = bool(ood.get("rule")), float(ood.get("cruise_scale", 1.0))
    return (rule, scale, ood.get("slow_by")) if slows(rule, scale) else None


def slows(ood_rule: bool, cruise_scale: float) -> bool:
    """Whether a run slows the car: the OOD rule acts, or every frame's cruise target is scaled."""
    return ood_rule or cruise_scale != 1.0


def condition_suffix(ood_rule: bool, cruise_scale: float, slow_by: str | None) -> str:
    """What driving with the OOD rule or a constant cruise scale adds to a method's name: "+OOD",
    "-slow0.51", and "-cap" where the speed cap slows the car."""
    return ((OOD_RULE_SUFFIX if ood_rule else "") + (f"-slow{cruise_scale:g}" if cruise_scale != 1.0 else "")
            + ("-cap" if slows(ood_rule, cruise_scale) and slow_by == "speed_cap" else ""))


def _same_drive(a: dict, b: dict) -> bool:
    logs = a.get("ood"), b.get("ood")
    if not all(logs):
        return False
    return all(logs[0].get(name) is not None and logs[0].get(name) == logs[1].get(name)
               for name in ("time_s", "steering_rad", "failure_times_s"))


def missing_tasks(settings: EvalSettings, scenarios: list[str], path: Path) -> list[tuple[str, int]]:
    """The (scenario, layout seed) pairs of `settings` that `path` has no row of yet. Rows of the
    same method and training seed from another policy are refused (ValueError): they would be
    taken for this policy's episodes."""
    rows = read_results(path)
    policy = None if settings.policy_dir is None else portable_path(settings.policy_dir)
    others = {r["policy"] for r in rows if (r["method"], r.get("training_seed")) == (settings.method, settings.training_seed)} - {policy}
    if others:
        raise ValueError(f"{path} already holds {settings.method} rows of training seed {settings.training_seed} from "
                         f"{', '.join(sorted(map(str, others)))}, not {policy}: evaluate into another folder or name the method (--name)")
    done = {row_key(r) for r in rows}
    tasks = [(s, seed) for s in scenarios for seed in settings.seeds if settings.key(s, seed) not in done]
    if not tasks:
        print(f"all {len(scenarios) * settings.episodes} episodes of {settings.method} on layouts "
              f"{settings.first_seed}..{settings.seeds[-1]} already in {path}")
    return tasks


class Recorder:
    """Appends finished episodes to results.jsonl (flushed: a killed run resumes from there)."""

    def __init__(self, settings: EvalSettings, path: Path, total: int, **extra):
        self.extra = {"method": settings.method, "profile": settings.profile, "episode_s": settings.episode_s,
                      "width": settings.width, "height": settings.height, "first_seed": settings.first_seed,
                      "policy": None if settings.policy_dir is None else portable_path(settings.policy_dir),
                      "training_seed": settings.training_seed, **extra}
        if path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            with path.open("a") as cut:
                cut.write("\n")  # a row cut by a killed run stays on its own line (and is rerun)
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
