"""`sps-driving collect --out DIR --episodes N --seed S`: expert drives recorded as rosbag2.

One bag per episode (DIR/episode_00000, ...), on the topics the car records
(sps_driving.core.topics), so `sps-driving extract DIR/episode_*` reads them like car bags:
camera image and camera info, the reference command, vehicle speed, the episode's cruise target
speed, lane pose and the nearest-obstacle gap, all stamped with the frame's time.

The car is pushed around (perturbed start, steering pulses, throttle noise) so the data holds
recoveries; the reference command is always the expert's clean command for the frame's state
(guided policy learning), not the pushed command that actually moved the car.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

from tqdm import tqdm

from sps_driving.core import topics
from sps_driving.ros import bagio, msgs
from sps_driving.sim.config import command_sim_config
from sps_driving.sim.episodes import Frame, drive_episode, follow_label
from sps_driving.sim.expert import Command, Disturbance, Expert
from sps_driving.sim.scenarios import get_scenario
from sps_driving.sim.world import COLLECTION_SEED_BASE, World, make_episode, rng_for

# Episodes of one collection seed before its layouts run into the next seed's.
COLLECTION_EPISODES = 10_000


def episode_seed(seed: int, index: int) -> int:
    """Episode seeds of a collection: disjoint from evaluation layouts, which lie below COLLECTION_SEED_BASE."""
    return COLLECTION_SEED_BASE + seed * COLLECTION_EPISODES + index


class BagSink:
    """An episode loop sink (sps_driving.sim.episodes) that writes every frame on the car's topics,
    all stamped with the frame's stamp; the reference command is the frame's label (the expert's
    clean command), whatever command moved the car."""

    def __init__(self, bag: bagio.BagWriter, config: dict):
        self.bag = bag
        self.hfov = math.radians(float(config["camera"]["hfov_deg"]))

    def __call__(self, frame: Frame, applied: Command) -> None:
        bag, stamp, image, world = self.bag, frame.stamp_ns, frame.image, frame.world
        bag.write(topics.IMAGE, msgs.image_fields(image, stamp, "camera"), stamp)
        bag.write(topics.CAMERA_INFO, msgs.camera_info_fields(image.shape[0], image.shape[1], stamp, "camera", self.hfov), stamp)
        bag.write(topics.REFERENCE_COMMAND, msgs.command_fields(frame.label.steering, frame.label.throttle, stamp), stamp)
        bag.write(topics.VEHICLE_TWIST, msgs.twist_fields(world.state.speed, stamp), stamp)
        bag.write(topics.TARGET_SPEED, msgs.twist_fields(world.episode.cruise_speed, stamp), stamp)
        bag.write(topics.LANE_POSE, msgs.lane_pose_fields(world.lane.lateral, world.lane.heading_error, stamp), stamp)
        bag.write(topics.OBSTACLE_RANGE, msgs.range_fields(world.nearest_gap(), stamp), stamp)


def record_episode(config: dict, scenario_name: str, seed: int, bag_dir: Path, episode_index: int, storage: str,
                   disturb: bool = True) -> dict:
    """Drive one expert episode and write it as a rosbag2 at `bag_dir`; returns its summary."""
    from sps_driving.sim.render import get_renderer

    episode = make_episode(config, get_scenario(scenario_name), seed)
    disturbance = Disturbance(config, rng_for(seed, "disturbance"))
    start = disturbance.start_state(episode.cruise_speed) if disturb else {}
    world = World(config, episode, **start)

    def pushed(frame: Frame) -> Command:
        return disturbance.apply(frame.label, world.dt)

    with bagio.BagWriter(bag_dir, storage=storage) as bag:
        result = drive_episode(config, world, episode_index, pushed if disturb else follow_label, expert=Expert(config),
                               renderer=get_renderer(config), sinks=[BagSink(bag, config)])
    result["bag"] = bag_dir.name
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="folder for the episode bags (created)")
    parser.add_argument("--episodes", type=int, default=10, help="number of episodes (one bag each)")
    parser.add_argument("--seed", type=int, default=0, help="collection seed: episode layouts and disturbances derive from it")
    parser.add_argument("--scenario", help="scenario name (default: the in-distribution one from config/sim.yaml)")
    parser.add_argument("--episode-s", type=float, help="episode length in s (default from config/sim.yaml)")
    parser.add_argument("--width", type=int, help="rendered image width in px (height follows the camera aspect)")
    parser.add_argument("--storage", choices=sorted(bagio.STORAGES), help="rosbag2 storage (default from config/sim.yaml)")
    parser.add_argument("--flat", action="store_true", help="with --episodes 1: write the bag at --out itself (no episode folder)")
    parser.add_argument("--no-disturbance", action="store_true", help="clean expert drives: no perturbed start, no pushes")
    parser.add_argument("--sim-config", help="simulator YAML (default config/sim.yaml)")
    parser.add_argument("--resume", action="store_true",
                        help="continue a cut-short collection into --out: keep its finished episodes, redo the rest")


def run(args) -> int:
    config = command_sim_config(args.sim_config, args.episode_s, args.width)
    if args.episodes < 1:
        raise SystemExit("--episodes must be at least 1")
    if args.seed < 0:
        raise SystemExit(f"--seed must be at least 0, got {args.seed}: collection layouts stay apart from evaluation ones")
    if args.flat and (args.episodes != 1 or args.resume):
        raise SystemExit("--flat writes a single bag: use it with --episodes 1 and without --resume")
    collect = config["collect"]
    scenario = args.scenario or collect["scenario"]
    try:
        get_scenario(scenario)  # validates the name before any work
    except ValueError as exc:
        raise SystemExit(f"collect: {exc}") from None
    storage = args.storage or collect["storage"]
    out = Path(args.out)
    if args.flat:
        out.parent.mkdir(parents=True, exist_ok=True)
    else:
        out.mkdir(parents=True, exist_ok=True)
    # The manifest is written after every episode: a resumed run keeps the episodes it lists.
    finished = json.loads((out / "collect.json").read_text())["results"] if args.resume and (out / "collect.json").is_file() else []
    summaries = []
    for index in tqdm(range(args.episodes), desc=f"collect {scenario}", unit="episode"):
        bag_dir = out if args.flat else out / f"episode_{index:05d}"
        if index < len(finished) and bag_dir.is_dir():
            summaries.append(finished[index])
            continue
        if bag_dir.exists() and not args.resume:
            raise SystemExit(f"{bag_dir} exists; collect into a new folder, or continue it with --resume")
        shutil.rmtree(bag_dir, ignore_errors=True)  # an episode cut short is driven again
        summaries.append(record_episode(config, scenario, episode_seed(args.seed, index), bag_dir, index, storage, not args.no_disturbance))
        _write_manifest(out, args, config, scenario, storage, summaries)
    interventions = sum(s["interventions"] for s in summaries)
    print(f"{args.episodes} episode bag(s) in {out} ({scenario}); expert interventions: {interventions}")
    return 0


def _write_manifest(out: Path, args, config: dict, scenario: str, storage: str, summaries: list) -> None:
    command = [word for word in sys.argv[1:] if word != "--resume"]  # a resumed collection is the same collection
    manifest = {
        "command": "sps-driving " + " ".join(command) if command[:1] == ["collect"] else None,
        "scenario": scenario,
        "seed": args.seed,
        "episodes": args.episodes,
        "episode_s": config["episode_s"],
        "image_size": [config["camera"]["render_width"], config["camera"]["render_height"]],
        "disturbance": not args.no_disturbance,
        "storage": storage,
        "results": summaries,
    }
    written = out / "collect.json.part"  # replaced in one step: a kill never leaves half a manifest
    written.write_text(json.dumps(manifest, indent=1))
    written.replace(out / "collect.json")
