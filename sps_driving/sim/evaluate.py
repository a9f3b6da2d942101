"""`sps-driving eval`: closed-loop out-of-distribution evaluation in the driving world (SPS
section 4.2, Table 1), in process (renderer -> extractor -> patch selection -> policy -> vehicle)
or through the live ROS 2 graph (`--graph`: the sim_world node and the on-car nodes, with the
vehicle interface's limits and watchdogs; sps_driving.sim.graph_eval).

    sps-driving eval --policy models/sps50 --profile quick --out runs/eval
    sps-driving eval --policy models/sps50 --graph --episodes 1 --out runs/eval   # the exact on-car stack
    sps-driving eval --expert --profile quick --out runs/eval      # checks the world itself

Episodes run in worker processes (spawn); every finished episode is appended to
OUT/results.jsonl, and a rerun skips the episodes already there (resumable). Tables are
written from every method's rows in results.jsonl that share this run's episode length and
image size: OUT/table1.{csv,md} (methods: No-FM, I-ViT, DA, SPS-50 and any other named one) and
OUT/table2.{csv,md} (DA and SPS/SPPS/MSPPS at rates 0.7, 0.5, 0.3), each with one column per
method, the ID row then the 14 OOD rows, an average over the OOD rows and the gain over DA in
points; OUT/accuracy_vs_rate.png (Figure 5: score against keep rate per selection family); and
OUT/details.md (per scenario: mean with 95% interval, failures by type, interventions, mean speed).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing as mp
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

from sps_driving.resources import source_revision
from sps_driving.sim.config import PROFILES, frame_stamp_ns, load_sim_config
from sps_driving.sim.scenarios import SCENARIO_NAMES, SCENARIOS, get_scenario
from sps_driving.sim.world import World, make_episode

RESULTS_FILE = "results.jsonl"
EXPERT = "expert"
# Evaluation episodes use seeds EVAL_SEED_BASE + 0..N-1; collection seeds start at 1,000,000
# (sps_driving.sim.collect.episode_seed), so training never sees an evaluation layout.
EVAL_SEED_BASE = 0
SELECTION_FAMILIES = ("SPS", "SPPS", "MSPPS")
RATES_PERCENT = (70, 50, 30)
# Column sets of the paper's tables: methods (Table 1) and selection variants by rate (Table 2).
TABLE1_METHODS = ("No-FM", "I-ViT", "DA", "SPS-50")
TABLE2_METHODS = ("DA",) + tuple(f"{family}-{rate}" for family in SELECTION_FAMILIES for rate in RATES_PERCENT)
_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
         12: 2.18, 15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04, 40: 2.02, 60: 2.00, 120: 1.98}


def method_name(policy_config: dict) -> str:
    """The table column of a policy: No-FM (pixels backbone), I-ViT (the backbone's unmasked patch
    tokens), else by its selection: DA at rate 1.0, e.g. SPS-50 below."""
    if policy_config.get("backbone") == "pixels":
        return "No-FM"
    if (policy_config.get("extractor") or {}).get("falloff") == "none":
        return "I-ViT"
    selection = policy_config.get("selection", {})
    rate = float(selection.get("rate", 1.0))
    variant = str(selection.get("variant", "sps"))
    if rate >= 1.0:
        return "DA"
    label = {"sps": "SPS", "spps": "SPPS", "mspps": "MSPPS", "threshold": "SPS-v1"}.get(variant, variant.upper())
    return f"{label}-{int(round(rate * 100))}"


# ------------------------------------------------------------------------------ drivers
class PolicyDriver:
    """Camera frame -> selected patches -> descriptors -> policy command."""

    def __init__(self, policy_dir: str, device: str = "cpu", threads: int | None = None, backbone_config: str | None = None):
        from sps_driving.core.policy import load_policy
        from sps_driving.extractors import extractor_for_policy

        self.policy = load_policy(policy_dir, device=device)
        self.extractor = extractor_for_policy(self.policy.config, {"device": device, "threads": threads}, backbone_config).extractor
        if self.extractor.grid != self.policy.grid or self.extractor.dim != self.policy.descriptor_dim:
            raise ValueError(
                f"policy {policy_dir} expects a {self.policy.grid.rows}x{self.policy.grid.cols}x{self.policy.descriptor_dim} "
                f"descriptor grid but the extractor gives {self.extractor.grid.rows}x{self.extractor.grid.cols}x{self.extractor.dim}"
            )
        self.selector = self.policy.selector
        self.last = (0.0, 0.0)
        self.drops = 0

    def reset(self) -> None:
        self.last = (0.0, 0.0)

    def __call__(self, image: np.ndarray, stamp_ns: int) -> tuple[float, float]:
        try:
            indices = self.selector.select(stamp_ns)
            state = self.extractor.encode(image)
            command = self.policy.predict(self.extractor.descriptors(state, indices), indices)
        except (ValueError, RuntimeError):
            # A frame the stack cannot use is dropped and counted; the car holds the last
            # command, as the vehicle interface does within its staleness timeout.
            self.drops += 1
            return self.last
        if not all(math.isfinite(c) for c in command):
            self.drops += 1
            return self.last
        self.last = command
        return command


def run_episode(config: dict, scenario_name: str, episode_index: int, driver=None, renderer=None) -> dict:
    """One closed-loop episode; `driver` None means the privileged expert (no camera needed)."""
    from sps_driving.sim.expert import Expert

    episode = make_episode(config, get_scenario(scenario_name), EVAL_SEED_BASE + episode_index)
    world = World(config, episode)
    steps = int(round(float(config["episode_s"]) * float(config["control_rate_hz"])))
    expert = Expert(config) if driver is None else None
    drops_before = getattr(driver, "drops", 0)
    if driver is not None:
        driver.reset()
    for step in range(steps):
        if expert is not None:
            command = expert.command(world)
            steering, throttle = command.steering, command.throttle
        else:
            image = renderer.render(world)
            steering, throttle = driver(image, frame_stamp_ns(config, episode_index, step))
        world.step(steering, throttle)
    result = world.result(steps * world.dt).as_dict()
    result["episode"] = episode_index
    result["dropped_frames"] = getattr(driver, "drops", 0) - drops_before
    return result


# ------------------------------------------------------------------------------ workers
_WORKER: dict = {}


def _init_worker(config: dict, policy_dir: Optional[str], device: str, threads: int, backbone_config: Optional[str]) -> None:
    _WORKER["config"] = config
    if policy_dir is not None:
        import torch

        from sps_driving.sim.render import get_renderer

        torch.set_num_threads(threads)
        _WORKER["renderer"] = get_renderer(config)
        _WORKER["driver"] = PolicyDriver(policy_dir, device, threads, backbone_config)


def _run_task(task: tuple[str, int]) -> dict:
    scenario_name, episode_index = task
    return run_episode(_WORKER["config"], scenario_name, episode_index, _WORKER.get("driver"), _WORKER.get("renderer"))


@dataclass(frozen=True)
class EvalSettings:
    method: str
    policy_dir: Optional[str]
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


def _missing_tasks(settings: EvalSettings, scenarios: list[str], path: Path) -> list[tuple[str, int]]:
    done = {_row_key(r) for r in read_results(path)}
    tasks = [(s, e) for s in scenarios for e in range(settings.episodes) if settings.key(s, e) not in done]
    if not tasks:
        print(f"all {len(scenarios) * settings.episodes} episodes of {settings.method} already in {path}")
    return tasks


class _Recorder:
    """Appends finished episodes to results.jsonl (flushed: a killed run resumes from there)."""

    def __init__(self, settings: EvalSettings, path: Path, total: int, **extra):
        self.extra = {"method": settings.method, "profile": settings.profile, "episode_s": settings.episode_s,
                      "width": settings.width, "height": settings.height, "policy": settings.policy_dir, **extra}
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


def evaluate(config: dict, settings: EvalSettings, scenarios: list[str], out: Path, workers: int, device: str = "cpu",
             backbone_config: Optional[str] = None) -> list[dict]:
    """Run the missing episodes of `scenarios` in process, appending each to out/results.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_FILE
    tasks = _missing_tasks(settings, scenarios, path)
    if not tasks:
        return []
    threads = int(config.get("eval", {}).get("torch_threads_per_worker", 1))
    init = (config, settings.policy_dir, device, threads, backbone_config)
    record = _Recorder(settings, path, len(tasks))
    try:
        if workers <= 1:
            _init_worker(*init)
            for task in tasks:
                record(_run_task(task))
        else:
            with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=init) as pool:
                for row in pool.imap_unordered(_run_task, tasks):
                    record(row)
    finally:
        record.close()
    return record.rows


def evaluate_graph(config: dict, settings: EvalSettings, scenarios: list[str], out: Path, real_time_factor: float,
                   device: str = "cpu") -> list[dict]:
    """Run the missing episodes of `scenarios` through the live ROS 2 graph (one graph per
    scenario; sps_driving.sim.graph_eval), appending each to out/results.jsonl."""
    from sps_driving.sim.graph_eval import run_scenario

    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_FILE
    tasks = _missing_tasks(settings, scenarios, path)
    if not tasks:
        return []
    record = _Recorder(settings, path, len(tasks), via="graph", real_time_factor=real_time_factor)
    try:
        for scenario in dict.fromkeys(s for s, _ in tasks):
            missing = [e for s, e in tasks if s == scenario]
            # sim_world runs consecutive episode indices: one graph per run of them.
            runs = [[missing[0]]]
            for episode in missing[1:]:
                if episode == runs[-1][-1] + 1:
                    runs[-1].append(episode)
                else:
                    runs.append([episode])
            for episodes in runs:
                for row in run_scenario(config, Path(settings.policy_dir), scenario, episodes, out / "graph", real_time_factor, device):
                    record(row)
    finally:
        record.close()
    return record.rows


# ------------------------------------------------------------------------------ tables
def interval95(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of the 95% t-interval (0 half-width for one value)."""
    n = len(values)
    mean = float(np.mean(values))
    if n < 2:
        return mean, 0.0
    df = n - 1
    t = next((v for k, v in sorted(_T975.items()) if k >= df), 1.96)
    return mean, float(t * np.std(values, ddof=1) / math.sqrt(n))


def summarize(rows: list[dict]) -> dict:
    """{method: {scenario: stats}} from result rows."""
    grouped: dict = defaultdict(lambda: defaultdict(list))
    for row in rows:
        grouped[row["method"]][row["scenario"]].append(row)
    summary = {}
    for method, by_scenario in grouped.items():
        summary[method] = {}
        for scenario, episodes in by_scenario.items():
            mean, half = interval95([e["score"] for e in episodes])
            failures: dict = defaultdict(int)
            for e in episodes:
                for kind, count in e["failures"].items():
                    failures[kind] += count
            summary[method][scenario] = {
                "mean": mean,
                "ci95": half,
                "episodes": len(episodes),
                "interventions": sum(e["interventions"] for e in episodes),
                "failures": dict(failures),
                "mean_speed_mps": float(np.mean([e["mean_speed_mps"] for e in episodes])),
                "dropped_frames": sum(e.get("dropped_frames", 0) for e in episodes),
                "episode_s": episodes[0]["episode_s"],
                "size": f"{episodes[0]['width']}x{episodes[0]['height']}",
            }
    return summary


def _method_sort_key(name: str) -> tuple:
    if name in TABLE1_METHODS:
        return (0, TABLE1_METHODS.index(name), name)
    if name in TABLE2_METHODS:
        return (1, TABLE2_METHODS.index(name), name)
    return (3 if name == EXPERT else 2, 0, name)


def table_rows(summary: dict, methods: list[str] | None = None) -> tuple[list[str], list[list[str]]]:
    """Table layout: header and rows (ID, OOD rows, average over OOD, gain over DA in points)."""
    methods = sorted(summary if methods is None else methods, key=_method_sort_key)
    header = ["scenario"] + methods
    rows = []
    for scenario in SCENARIO_NAMES:
        if any(scenario in summary[m] for m in methods):
            rows.append([scenario] + [f"{summary[m][scenario]['mean']:.2f}" if scenario in summary[m] else "" for m in methods])
    averages = {m: ood_average(summary[m]) for m in methods}
    rows.append(["average"] + [f"{averages[m]:.3f}" if averages[m] is not None else "" for m in methods])
    if averages.get("DA") is not None:
        rows.append(["gain_over_DA_points"] + [f"{100 * (averages[m] - averages['DA']):+.1f}" if averages[m] is not None else "" for m in methods])
    return header, rows


def ood_average(by_scenario: dict) -> float | None:
    """Mean score over the OOD scenarios present (every Table 1 row but the first, the ID one)."""
    ood = [by_scenario[s]["mean"] for s in SCENARIO_NAMES[1:] if s in by_scenario]
    return float(np.mean(ood)) if ood else None


def table_methods(summary: dict) -> dict:
    """{table name: methods present}: Table 1 holds the method families (and any other named
    method, and the expert as a reference), Table 2 DA and the selection variants by rate."""
    tables = {
        "table1": [m for m in summary if m not in TABLE2_METHODS or m in TABLE1_METHODS],
        "table2": [m for m in summary if m in TABLE2_METHODS],
    }
    return {name: methods for name, methods in tables.items() if methods}


def write_tables(rows: list[dict], out: Path, command: str) -> None:
    """OUT/table1.{csv,md}, table2.{csv,md}, details.md and accuracy_vs_rate.png from `rows`."""
    summary = summarize(rows)
    if not summary:
        return
    labels = {s.name: s.label for s in SCENARIOS}
    settings = sorted({(r["profile"], r["episode_s"], r["width"], r["height"]) for r in rows})
    for name, methods in table_methods(summary).items():
        header, table = table_rows(summary, methods)
        with (out / f"{name}.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(table)
        expected = TABLE1_METHODS if name == "table1" else TABLE2_METHODS
        missing = [m for m in expected if m not in summary]
        counts = {m: sorted({v["episodes"] for v in summary[m].values()}) for m in header[1:]}
        lines = [
            f"# {'Table 1: methods' if name == 'table1' else 'Table 2: selection variants and rates'}"
            " (closed loop, normalized success duration)",
            "",
            f"Command: `{command}`  ",
            f"Git revision: {source_revision()}  ",
            "Settings (profile, episode s, rendered size): " + "; ".join(f"{p}, {e:g} s, {w}x{h}" for p, e, w, h in settings) + "  ",
            "Episodes per scenario: " + ", ".join(f"{m}: {'/'.join(map(str, c))}" for m, c in counts.items()) + "  ",
            "Not yet run: " + (", ".join(missing) if missing else "none") + "  ",
            "Episode seeds: 0..N-1 (layouts shared by all scenarios and methods). Score: time until the first "
            "failure / episode length. Average: over the OOD rows. Gain: average minus DA's, in points.",
            "",
            "| " + " | ".join(["Scenario"] + header[1:]) + " |",
            "|" + "---|" * len(header),
        ]
        for row in table:
            lines.append("| " + " | ".join([labels.get(row[0], row[0])] + row[1:]) + " |")
        (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    details = ["# Per-scenario details", ""]
    for method in sorted(summary, key=_method_sort_key):
        details += [f"## {method}", "", "| Scenario | Score (95% CI) | Episodes | Interventions | Lane | Collision | Heading | Speed m/s | Dropped frames |",
                    "|---|---|---|---|---|---|---|---|---|"]
        for scenario in SCENARIO_NAMES:
            s = summary[method].get(scenario)
            if s is None:
                continue
            f = s["failures"]
            details.append(
                f"| {labels[scenario]} | {s['mean']:.2f} ± {s['ci95']:.2f} | {s['episodes']} | {s['interventions']} | "
                f"{f.get('lane_boundary', 0)} | {f.get('collision', 0)} | {f.get('heading', 0)} | {s['mean_speed_mps']:.1f} | {s['dropped_frames']} |"
            )
        details.append("")
    (out / "details.md").write_text("\n".join(details))
    curves = rate_curves(summary)
    if any(len(points) > 1 for points in curves.values()):
        plot_rate_curves(curves, out / "accuracy_vs_rate.png")


def rate_curves(summary: dict) -> dict:
    """{family: [(keep rate, OOD average, ID score)]} for SPS, SPPS and MSPPS, each ending at DA (rate 1)."""
    curves = {}
    for family in SELECTION_FAMILIES:
        points = []
        for rate, method in [(r / 100, f"{family}-{r}") for r in RATES_PERCENT] + [(1.0, "DA")]:
            ood = ood_average(summary[method]) if method in summary else None
            if ood is not None:
                points.append((rate, ood, summary[method].get(SCENARIO_NAMES[0], {}).get("mean", math.nan)))
        if any(rate < 1.0 for rate, _, _ in points):
            curves[family] = sorted(points)
    return curves


def plot_rate_curves(curves: dict, path: Path) -> None:
    """Figure 5's layout: average OOD score (solid) and ID score (dashed) against the keep rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for (family, points), color in zip(curves.items(), ("tab:blue", "tab:orange", "tab:green")):
        rates, ood, in_dist = zip(*points)
        ax.plot(rates, ood, "o-", color=color, label=f"{family}: OOD average")
        ax.plot(rates, in_dist, "s--", color=color, alpha=0.5, label=f"{family}: ID")
    ax.set_xlabel("keep rate (1.0 = DA, dense)")
    ax.set_ylabel("normalized success duration")
    ax.set_ylim(0.0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--policy", help="policy checkpoint folder (policy.safetensors + config.json)")
    who.add_argument("--expert", action="store_true", help="drive with the privileged expert (checks the world)")
    parser.add_argument("--name", help="method column name (default from the policy's selection, e.g. DA, SPS-50)")
    parser.add_argument("--profile", choices=PROFILES, default="quick", help="episodes, episode length and image size (config/sim.yaml)")
    parser.add_argument("--episodes", type=int, help="episodes per scenario (overrides the profile)")
    parser.add_argument("--episode-s", type=float, help="episode length in s (overrides the profile)")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIO_NAMES), metavar="NAME", help="scenario names (default: Table 1's 15)")
    parser.add_argument("--out", required=True, help="output folder: results.jsonl, table1/table2 .csv and .md, details.md, accuracy_vs_rate.png")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--device", default="cpu", help="torch device for the extractor and policy")
    parser.add_argument("--backbone-config", help="extraction settings file under the policy's own (e.g. precision: int8)")
    parser.add_argument("--sim-config", help="simulator YAML (default config/sim.yaml)")
    parser.add_argument("--graph", action="store_true",
                        help="drive through the live ROS 2 graph (sim_world node + the on-car nodes) instead of in process; "
                             "the method is named with ' (graph)' appended")
    parser.add_argument("--real-time-factor", type=float, default=0.25,
                        help="--graph: world seconds per wall second (default 0.25 for a CPU; 1.0 on the car's GPU)")


def run(args) -> int:
    import sys

    config = load_sim_config(args.sim_config, profile=args.profile)
    try:
        for name in args.scenarios:
            get_scenario(name)
    except ValueError as exc:
        raise SystemExit(f"eval: {exc}") from None
    if args.episode_s is not None:
        config["episode_s"] = float(args.episode_s)
    episodes = args.episodes if args.episodes is not None else int(config["profile"]["episodes"])
    if episodes < 1:
        raise SystemExit("--episodes must be at least 1")
    if args.expert:
        method, policy_dir = args.name or EXPERT, None
    else:
        from sps_driving.core.policy import read_policy_config

        try:
            policy_config = read_policy_config(args.policy)
        except (FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"eval: {exc}") from None
        method, policy_dir = args.name or method_name(policy_config), str(Path(args.policy).resolve())
    if args.graph:
        if args.expert:
            raise SystemExit("eval: --graph drives with a policy; the expert runs in process")
        if args.backbone_config:
            raise SystemExit("eval: --backbone-config is for the in-process run; --graph takes config/graph.yaml's")
        if not (math.isfinite(args.real_time_factor) and args.real_time_factor > 0):
            raise SystemExit(f"eval: --real-time-factor must be positive, got {args.real_time_factor}")
        from sps_driving.sim.graph_eval import GRAPH_SUFFIX

        method += GRAPH_SUFFIX
    cam = config["camera"]
    settings = EvalSettings(method, policy_dir, args.profile, episodes, float(config["episode_s"]), int(cam["render_width"]), int(cam["render_height"]))
    out = Path(args.out)
    how = (f"through the live graph at real-time factor {args.real_time_factor:g} (node logs in {out / 'graph'})"
           if args.graph else f"{args.workers} worker(s)")
    print(f"{method}: profile {args.profile}, {episodes} episode(s) of {settings.episode_s:g} s per scenario, "
          f"{settings.width}x{settings.height} px, {len(args.scenarios)} scenario(s), {how}")
    if args.graph:
        evaluate_graph(config, settings, args.scenarios, out, args.real_time_factor, args.device)
    else:
        evaluate(config, settings, args.scenarios, out, max(1, args.workers), args.device, args.backbone_config)
    # Tables compare methods under the same settings: rows of other profiles stay in the file only.
    same = (settings.episode_s, settings.width, settings.height)
    rows = [r for r in read_results(out / RESULTS_FILE) if (r["episode_s"], r["width"], r["height"]) == same]
    write_tables(rows, out, "sps-driving " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["eval"] else "sps-driving eval ...")
    for name in ("table1.md", "table2.md"):
        if (out / name).is_file():
            print((out / name).read_text())
    return 0
