"""`sps-driving record OUT`: record a data drive or a field test on the car.

Runs `ros2 bag record` (the ROS 2 distro's rosbag2) with the recording profile
config/recording.yaml: its storage (mcap) and its topics, which hold everything `sps-driving
extract`, `replay` and `interventions` read. With the vendor camera driver, `--camera-topic` and
`--camera-info-topic` record its topics instead of the graph's; read such a bag with `extract
--camera-topic` and `replay --topic VENDOR:=GRAPH` (docs/training.md). `--print` prints the command
instead of running it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from pathlib import Path

import yaml

from sps_driving.core import topics
from sps_driving.core.resources import config_path

PROFILE = config_path("recording.yaml")


def load_profile(path=PROFILE) -> dict:
    """{"storage": plugin, "topics": {topic: what reads it}} of a recording profile."""
    profile = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(profile.get("topics"), dict) or not profile["topics"] or not profile.get("storage"):
        raise ValueError(f"{path} needs `storage` and a `topics` mapping (topic: what reads it)")
    return profile


def record_command(out, profile: dict, camera_topic: str | None = None, camera_info_topic: str | None = None) -> list[str]:
    """The `ros2 bag record` command line of `profile` into the new bag folder `out`."""
    renamed = {topics.IMAGE: camera_topic or topics.IMAGE, topics.CAMERA_INFO: camera_info_topic or topics.CAMERA_INFO}
    recorded = [renamed.get(topic, topic) for topic in profile["topics"]]
    return ["ros2", "bag", "record", "-s", str(profile["storage"]), "-o", str(out), *recorded]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="bag folder to create (e.g. drives/2026-11-03_loop_a)")
    parser.add_argument("--profile", type=Path, default=PROFILE, help="recording profile (default: config/recording.yaml)")
    parser.add_argument("--camera-topic", help=f"image topic of a vendor camera driver (default {topics.IMAGE})")
    parser.add_argument("--camera-info-topic", help=f"its camera-info topic (default {topics.CAMERA_INFO})")
    parser.add_argument("--print", action="store_true", dest="print_only", help="print the command instead of running it")


def run(args) -> int:
    try:
        command = record_command(args.out, load_profile(args.profile), args.camera_topic, args.camera_info_topic)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.print_only:
        print(shlex.join(command))
        return 0
    if args.out.exists():
        print(f"error: {args.out} exists; rosbag2 records into a new folder", file=sys.stderr)
        return 2
    if shutil.which("ros2") is None:
        print("error: `ros2` not found: source the ROS 2 distro (setup.bash) first, or run the printed command "
              "(--print) where it is", file=sys.stderr)
        return 2
    os.execvp(command[0], command)  # the recorder takes over this process: Ctrl-C stops it and closes the bag
