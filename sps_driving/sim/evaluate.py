"""`sps-driving eval`: closed-loop out-of-distribution evaluation in the driving world (SPS
section 4.2, Table 1), in process (renderer -> extractor -> patch selection -> policy -> vehicle;
sps_driving.sim.episodes) or through the live ROS 2 graph (`--graph`: the sim_world node and the
on-car nodes, with the vehicle interface's limits and watchdogs; sps_driving.sim.graph_eval).

    sps-driving eval --policy models/sps50 --profile quick --out runs/eval
    sps-driving eval --policy models/sps50 --first-seed 100 --episodes 20 --out runs/claim   # held-out layouts
    sps-driving eval --policy models/sps50 --graph --episodes 1 --out runs/eval   # the exact on-car stack
    sps-driving eval --expert --profile quick --out runs/eval      # checks the world itself
    torchrun --nproc-per-node=4 -m sps_driving.cli eval --policy models/sps50 --device cuda --out runs/eval   # docs/distributed.md

Layouts: episode seeds --first-seed .. --first-seed + episodes - 1, the same in every scenario and
for every method, below the first collection seed (sps_driving.sim.world.COLLECTION_SEED_BASE),
so no layout is ever trained on. Every finished episode is appended to OUT/results.jsonl, and a
rerun skips the episodes already there (sps_driving.sim.results). In process, each failure of a
policy's episode is drawn as a strip of its last 2 s, what the policy kept and where its steering
came from, into OUT/failures/<method>/ (sps_driving.sim.failure_strips; --no-failure-strips: none). In process,
a policy with an OOD calibration in its folder logs every frame's scores in its rows, and with
--ood-rule the safety monitor's rule acts on them (sps_driving.sim.ood_log). Tables and plots
(sps_driving.sim.tables) are written from every method's rows in results.jsonl on this run's
layouts with this run's episode length and image size.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict
from pathlib import Path

from sps_driving.core.ood import load_ood_config
from sps_driving.core.resources import source_revision
from sps_driving.sim.config import PROFILES, load_sim_config, widen_view
from sps_driving.sim.episodes import run_episodes
from sps_driving.sim.failure_strips import StripSettings, strips_folder
from sps_driving.sim.ood_log import SLOW_BY, ood_settings
from sps_driving.sim.results import (
    OOD_RULE_SUFFIX,
    RESULTS_FILE,
    EvalSettings,
    Recorder,
    condition_suffix,
    missing_tasks,
    read_results,
    slows,
)
from sps_driving.sim.scenarios import SCENARIO_NAMES, get_scenario
from sps_driving.sim.tables import EXPERT, method_name, training_seed, write_tables
from sps_driving.sim.world import COLLECTION_SEED_BASE
from sps_driving.train.distributed import Processes, file_digest, start_processes

INT8_SUFFIX = "-int8"  # a method evaluated with --precision int8


def evaluate(config: dict, settings: EvalSettings, scenarios: list[str], out: Path, workers: int, device: str = "cpu",
             backbone_config: str | None = None, failure_strips: bool = True, processes: Processes | None = None,
             precision: str | None = None) -> list[dict]:
    """Run the missing episodes of `scenarios` in process, appending each to out/results.jsonl
    (and, with `failure_strips`, a policy's failures drawn into out/failures/<method>/); `precision`
    is the extractor's (None: the settings'; int8: onnxruntime's int8 graph).

    With several `processes` (torchrun), each runs its share of the episodes on its own world
    and `device`; process 0 decides which episodes are missing, records every one's results and
    returns the rows (the others: none). They must agree on the settings, the policy's weights
    and the simulator configuration."""
    procs = processes or Processes()
    procs.agree("the evaluation settings, the policy and the simulator configuration",
                evaluation_agreement(config, settings, scenarios, backbone_config, failure_strips, precision))
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_FILE
    try:
        tasks = procs.first(lambda: missing_tasks(settings, scenarios, path))
    except ValueError as exc:
        raise SystemExit(f"eval: {exc}") from None
    if not tasks:
        return []
    folder = None
    if failure_strips and settings.policy_dir:
        try:
            StripSettings.from_config(config)  # a bad setting stops the run here, not in every worker
        except ValueError as exc:
            raise SystemExit(f"eval: {exc}") from None
        folder = strips_folder(out, settings.method)
    record = Recorder(settings, path, len(tasks)) if procs.main else None
    if procs.world_size > 1:
        procs.log(f"eval: {len(tasks[procs.rank::procs.world_size])} of {len(tasks)} episode(s), device {device}")
    try:
        run_episodes(config, settings.policy_dir, tasks, workers, device, record, backbone_config, folder, procs, precision)
    finally:
        if record is not None:
            record.close()
    return [] if record is None else record.rows


def evaluation_agreement(config: dict, settings: EvalSettings, scenarios: list[str], backbone_config: str | None,
                         failure_strips: bool, precision: str | None = None) -> dict:
    """What every process of an evaluation must share: the settings, the policy's files (their
    contents: the folder may lie elsewhere on another machine), the simulator configuration and
    the extraction settings file's contents."""
    from sps_driving.core.policies.checkpoint import CONFIG_FILE, WEIGHTS_FILE

    policy = settings.policy_dir
    return {"settings": {**asdict(settings), "policy_dir": None},
            "policy": None if policy is None else file_digest(Path(policy) / CONFIG_FILE, Path(policy) / WEIGHTS_FILE),
            "scenarios": scenarios, "sim_config": config, "failure_strips": failure_strips, "precision": precision,
            "backbone_config": None if backbone_config is None else Path(backbone_config).read_text()}


def evaluate_graph(config: dict, settings: EvalSettings, scenarios: list[str], out: Path, real_time_factor: float,
                   device: str = "cpu") -> list[dict]:
    """Run the missing episodes of `scenarios` through the live ROS 2 graph (one graph per
    scenario; sps_driving.sim.graph_eval), appending each to out/results.jsonl."""
    from sps_driving.sim.graph_eval import run_scenario

    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_FILE
    tasks = _missing(settings, scenarios, path)
    if not tasks:
        return []
    record = Recorder(settings, path, len(tasks), via="graph", real_time_factor=real_time_factor)
    try:
        for scenario in dict.fromkeys(s for s, _ in tasks):
            missing = [seed for s, seed in tasks if s == scenario]
            # sim_world drives consecutive layout seeds: one graph per run of them.
            runs = [[missing[0]]]
            for seed in missing[1:]:
                if seed == runs[-1][-1] + 1:
                    runs[-1].append(seed)
                else:
                    runs.append([seed])
            for seeds in runs:
                for row in run_scenario(config, Path(settings.policy_dir), scenario, seeds, out / "graph", real_time_factor, device):
                    record(row)
    finally:
        record.close()
    return record.rows


def _check_wider_view(policy_dir: str, policy_config: dict, scale: float) -> None:
    """Exit with the reason unless the policy can read the grid of a view `scale` times as wide
    (checked here: a worker that cannot start its policy would be started again and again)."""
    from sps_driving.core.grid import PatchGrid
    from sps_driving.core.policies.checkpoint import load_policy
    from sps_driving.core.view import wider_grid

    grid = PatchGrid(int(policy_config["grid"]["rows"]), int(policy_config["grid"]["cols"]))
    try:
        load_policy(policy_dir, grid=wider_grid(grid, scale))
    except ValueError as exc:
        raise SystemExit(f"eval: --view-width-scale {scale:g}: {exc}") from None


def _method_suffix(args) -> str:
    """What the options add to the method's name: the int8 graph, the OOD rule, a constant cruise scale,
    a slow-down by speed cap."""
    return (INT8_SUFFIX if args.precision == "int8" else "") + condition_suffix(args.ood_rule, args.cruise_scale, _slow_by(args))


def _slows(args) -> bool:
    return slows(args.ood_rule, args.cruise_scale)


def _slow_by(args) -> str:
    return args.slow_by or SLOW_BY[0]


def _ood_settings(args) -> dict:
    """The `ood` entry of the simulator config (sps_driving.sim.ood_log.ood_settings) the options ask for."""
    if (_slows(args) or args.selection_draws) and (args.graph or args.expert):
        raise SystemExit("eval: --ood-rule, --cruise-scale and --selection-draws drive a policy in process")
    if args.slow_by is not None and not _slows(args):
        raise SystemExit(f"eval: --slow-by {args.slow_by} is how --ood-rule or --cruise-scale slows the car; give one")
    try:
        ood = load_ood_config(args.ood_config)
        return ood_settings(ood["rule"] if args.ood_rule else None, ood["score"]["method"], args.cruise_scale,
                            args.selection_draws, _slow_by(args))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"eval: {exc}") from None


def _check_calibration(policy_dir: str, policy_config: dict, method: str) -> None:
    """Exit with the reason unless the policy's OOD calibration is there, its own and has the rule's
    score `method` (a worker that cannot start would be started again and again)."""
    from sps_driving.core.ood import CalibrationError, load_calibration
    from sps_driving.core.policies.checkpoint import WEIGHTS_FILE

    try:
        load_calibration(policy_dir, policy_config, Path(policy_dir) / WEIGHTS_FILE, method=method)
    except CalibrationError as exc:
        raise SystemExit(f"eval: {exc}") from None


def _missing(settings: EvalSettings, scenarios: list[str], path: Path) -> list[tuple[str, int]]:
    try:
        return missing_tasks(settings, scenarios, path)
    except ValueError as exc:
        raise SystemExit(f"eval: {exc}") from None


# ------------------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--policy", help="policy checkpoint folder (policy.safetensors + config.json)")
    who.add_argument("--expert", action="store_true", help="drive with the privileged expert (checks the world)")
    parser.add_argument("--name", help="method column name (default from the policy's selection, e.g. DA, SPS-50)")
    parser.add_argument("--profile", choices=PROFILES, default="quick", help="episodes, episode length and image size (config/sim.yaml)")
    parser.add_argument("--episodes", type=int, help="episodes per scenario (overrides the profile)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="episode seed of the first layout; the run drives layouts N .. N+episodes-1 in every scenario "
                             "(development: 0..99; held-out claims: from 100; see the README)")
    parser.add_argument("--episode-s", type=float, help="episode length in s (overrides the profile)")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIO_NAMES), metavar="NAME",
                        help="scenario names (default: Table 1's 15)")
    parser.add_argument("--out", required=True,
                        help="output folder: results.jsonl, table1/table2 .csv and .md, details.md, accuracy_vs_rate.png")
    parser.add_argument("--workers", type=int,
                        help="worker processes (default 2; under torchrun every process is one worker)")
    parser.add_argument("--device", default="cpu", help="torch device for the extractor and policy")
    parser.add_argument("--backbone-config", help="extraction settings file under the policy's own (e.g. precision: int8)")
    parser.add_argument("--precision", choices=("fp32", "int8"),
                        help="in process: the extractor's precision (default the settings', fp32); int8 runs onnxruntime's "
                             "int8 graph (the README's \"Extraction settings and backends\"), and the method is named with "
                             "-int8 appended unless --name is given")
    parser.add_argument("--no-failure-strips", dest="failure_strips", action="store_false",
                        help="in process: draw no strip of the frames before each failure (OUT/failures/<method>/)")
    parser.add_argument("--view-width-scale", type=float, default=1.0, metavar="S",
                        help="in process: render S times as wide at the same focal length (the nominal frame is the central "
                             "1/S) and widen the policy's extraction to match (16x16 -> 16x24 at 1.5); for policies that "
                             "read a window about the roi's centre (relative_query, mlp with a canvas)")
    parser.add_argument("--ood-rule", action="store_true",
                        help="in process: the safety monitor's OOD rule acts (config/ood.yaml: the car slowed, a "
                             "requested handover ends the episode); needs the policy's calibration; the method is named "
                             f"with '{OOD_RULE_SUFFIX}' appended")
    parser.add_argument("--cruise-scale", type=float, default=1.0, metavar="S",
                        help="in process: every frame's cruise target times S (the rule's constant-slow baseline); the "
                             "method is named with '-slowS' appended")
    parser.add_argument("--slow-by", choices=SLOW_BY,
                        help="how the rule or a cruise scale slows the car: a speed cap at the scaled cruise target, "
                             "enforced on the throttle while the policy reads its own target (default, as the vehicle "
                             "interface does; the method is named with '-cap' appended), or the policy's cruise target "
                             "times the scale")
    parser.add_argument("--selection-draws", type=int, default=0, metavar="K",
                        help="in process: also log each frame's steering spread (rad) over K other selections of it "
                             "(`selection_disagreement` in the rows' per-frame scores; every patch is extracted)")
    parser.add_argument("--ood-config", help="OOD score and rule settings (default config/ood.yaml)")
    parser.add_argument("--sim-config", help="simulator YAML (default config/sim.yaml)")
    parser.add_argument("--graph", action="store_true",
                        help="drive through the live ROS 2 graph (sim_world node + the on-car nodes) instead of in process; "
                             "the method is named with ' (graph)' appended")
    parser.add_argument("--real-time-factor", type=float, default=0.25,
                        help="--graph: world seconds per wall second (default 0.25 for a CPU; 1.0 on the car's GPU)")


def run(args) -> int:
    config = load_sim_config(args.sim_config, profile=args.profile)
    try:
        for name in args.scenarios:
            get_scenario(name)
    except ValueError as exc:
        raise SystemExit(f"eval: {exc}") from None
    if args.episode_s is not None:
        config["episode_s"] = float(args.episode_s)
    config["ood"] = _ood_settings(args)
    if args.view_width_scale != 1.0:
        if args.graph:
            raise SystemExit("eval: --view-width-scale runs in process; the live graph's extractor takes the checkpoint's settings")
        try:
            widen_view(config, args.view_width_scale)
        except ValueError as exc:
            raise SystemExit(f"eval: {exc}") from None
    episodes = args.episodes if args.episodes is not None else int(config["profile"]["episodes"])
    if episodes < 1:
        raise SystemExit("--episodes must be at least 1")
    if not 0 <= args.first_seed <= COLLECTION_SEED_BASE - episodes:
        raise SystemExit(f"eval: layouts {args.first_seed}..{args.first_seed + episodes - 1} must lie in 0..{COLLECTION_SEED_BASE - 1}: "
                         f"seeds from {COLLECTION_SEED_BASE} belong to training collections")
    if args.expert:
        method, policy_dir, seed = args.name or EXPERT, None, None
    else:
        from sps_driving.core.policies.checkpoint import read_policy_config

        try:
            policy_config = read_policy_config(args.policy)
        except (FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"eval: {exc}") from None
        method, policy_dir = args.name or method_name(policy_config), str(Path(args.policy).resolve())
        if not args.name:
            method += _method_suffix(args)
        if _slows(args):
            _check_calibration(args.policy, policy_config, config["ood"]["method"])
        seed = training_seed(policy_config)
        if args.view_width_scale != 1.0:
            _check_wider_view(args.policy, policy_config, args.view_width_scale)
    if args.graph:
        if args.expert:
            raise SystemExit("eval: --graph drives with a policy; the expert runs in process")
        if args.backbone_config or args.precision:
            raise SystemExit("eval: --backbone-config and --precision are for the in-process run; --graph takes "
                             "config/graph.yaml's")
        if not (math.isfinite(args.real_time_factor) and args.real_time_factor > 0):
            raise SystemExit(f"eval: --real-time-factor must be positive, got {args.real_time_factor}")
        from sps_driving.sim.graph_eval import GRAPH_SUFFIX

        method += GRAPH_SUFFIX
    cam = config["camera"]
    settings = EvalSettings(method, policy_dir, args.profile, episodes, float(config["episode_s"]), int(cam["render_width"]),
                            int(cam["render_height"]), args.first_seed, seed)
    procs = start_processes(args.device)
    try:
        return _run(args, config, settings, procs)
    finally:
        procs.close()


def _run(args, config: dict, settings: EvalSettings, procs: Processes) -> int:
    import sys

    if procs.world_size > 1 and args.graph:
        raise SystemExit("eval: --graph drives one live graph on this machine: run it without torchrun")
    if procs.world_size > 1 and args.workers not in (None, 1):
        raise SystemExit("eval: under torchrun every process is one worker: start more processes (--nproc-per-node) "
                         "instead of --workers")
    workers = 2 if args.workers is None else max(1, args.workers)
    method, seed, policy_dir = settings.method, settings.training_seed, settings.policy_dir
    out = Path(args.out)
    how = (f"through the live graph at real-time factor {args.real_time_factor:g} (node logs in {out / 'graph'})"
           if args.graph else f"{procs.world_size} torchrun processes" if procs.world_size > 1 else f"{workers} worker(s)")
    if procs.main:
        print(f"{method}{'' if seed is None else f' (training seed {seed})'}: profile {args.profile}, {settings.episodes} "
              f"episode(s) of {settings.episode_s:g} s per scenario on layouts {settings.first_seed}..{settings.seeds[-1]}, "
              f"{settings.width}x{settings.height} px"
              + (f" (view {args.view_width_scale:g} times as wide)" if args.view_width_scale != 1.0 else "")
              + f", {len(args.scenarios)} scenario(s), {how}")
    revision = source_revision()  # before the results are written: an output folder inside the checkout would count as a change
    if args.graph:
        evaluate_graph(config, settings, args.scenarios, out, args.real_time_factor, args.device)
    else:
        evaluate(config, settings, args.scenarios, out, workers, str(procs.device), args.backbone_config,
                 args.failure_strips, procs, args.precision)
        if not procs.main:
            return 0
        folder = strips_folder(out, method)
        if policy_dir is not None and folder.is_dir():
            print(f"failure strips: {sum(1 for _ in folder.glob('*.png'))} in {folder}")
    # Tables compare methods under the same settings on this run's layouts: rows of other profiles
    # and other layouts (development ones beside held-out ones) stay in the file only.
    same = (settings.episode_s, settings.width, settings.height)
    rows = [r for r in read_results(out / RESULTS_FILE)
            if (r["episode_s"], r["width"], r["height"]) == same and r["seed"] in settings.seeds]
    write_tables(rows, out, "sps-driving " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["eval"] else "sps-driving eval ...",
                 revision)
    for name in ("table1.md", "table2.md"):
        if (out / name).is_file():
            print((out / name).read_text())
    return 0
