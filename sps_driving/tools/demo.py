"""`sps-driving demo`: the main job on the shipped defaults.

1. Replays the bundled drive (data/demo_drive, a rosbag2 recorded in the driving world) through
   the live ROS 2 graph (selection, extractor, policy, vehicle interface, safety monitor as
   separate processes over DDS on loopback) with the embedded DINOv2 backbone and the shipped
   SPS-50% policy, and prints the replay report.
2. Drives a few closed-loop episodes in two out-of-distribution scenarios with the same policy
   and prints their scores (normalized success duration, failures, interventions).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sps_driving.core.resources import SHIPPED_POLICY, package_path, shipped_policy

DEMO_BAG = "data/demo_drive"
DEMO_SCENARIOS = ("rural-winter-snow-day-animal", "urban-summer-dry-night-unseencar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="folder for the replay bag and episode results")
    parser.add_argument("--bag", type=Path, help=f"drive to replay (default: the bundled {DEMO_BAG})")
    parser.add_argument("--checkpoint", type=Path, help=f"policy folder (default: the shipped {SHIPPED_POLICY})")
    parser.add_argument("--episodes", type=int, default=2, help="closed-loop episodes per scenario (0 skips them)")
    parser.add_argument("--episode-s", type=float, default=10.0, help="length of each closed-loop episode in s")
    parser.add_argument("--scenarios", nargs="+", default=list(DEMO_SCENARIOS), metavar="NAME", help="closed-loop scenarios")
    parser.add_argument("--json", action="store_true", help="print the replay report as JSON")


def _require(path: Path, what: str, how: str) -> bool:
    if path.exists():
        return True
    print(f"error: {what} not found at {path}; {how}")
    return False


def run(args: argparse.Namespace) -> int:
    from sps_driving.tools import replay

    bag = args.bag or package_path(DEMO_BAG)
    checkpoint = args.checkpoint or shipped_policy()
    if not (
        _require(bag, "the demo drive", "it ships in data/demo_drive of the repository, or pass --bag")
        and _require(checkpoint / "config.json", "the demo policy", f"it ships in {SHIPPED_POLICY}, or pass --checkpoint")
    ):
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out / stamp
    out.mkdir(parents=True, exist_ok=True)

    print(f"== 1/2 replay of {bag} through the live ROS 2 graph with {checkpoint}", flush=True)
    try:
        report = replay.replay_bag(bag, out / "replay_bag", checkpoint=checkpoint, log_dir=out / "logs")
    except replay.ReplayError as exc:
        print(f"error: {exc}")
        return 2
    print(json.dumps(report, indent=2) if args.json else replay.format_report(report))
    if args.episodes < 1:
        return 0

    from sps_driving.core.policies.checkpoint import read_policy_config
    from sps_driving.export.extractors import extractor_for_policy
    from sps_driving.sim.config import load_sim_config
    from sps_driving.sim.evaluate import evaluate
    from sps_driving.sim.results import RESULTS_FILE, EvalSettings, read_results
    from sps_driving.sim.tables import method_name, write_tables

    print(f"\n== 2/2 closed loop: {args.episodes} episode(s) of {args.episode_s:g} s in {', '.join(args.scenarios)}")
    # What each evaluation worker (one thread each) runs: the settings of the graph's extractor.
    print(extractor_for_policy(checkpoint, {"device": "cpu", "threads": 1}).describe(), flush=True)
    config = load_sim_config(profile="quick")
    config["episode_s"] = float(args.episode_s)
    cam = config["camera"]
    settings = EvalSettings(
        method_name(read_policy_config(checkpoint)), str(checkpoint.resolve()), "quick", args.episodes,
        float(args.episode_s), int(cam["render_width"]), int(cam["render_height"]),
    )
    evaluate(config, settings, list(args.scenarios), out / "closed_loop", workers=2)
    write_tables(read_results(out / "closed_loop" / RESULTS_FILE), out / "closed_loop", "sps-driving demo")
    print((out / "closed_loop" / "details.md").read_text())
    print(f"everything the demo wrote is in {out}")
    return 0
