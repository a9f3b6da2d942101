"""`sps-driving record OUT`: record a data drive or a field test on the car.

Runs `ros2 bag record` (the ROS 2 distro's rosbag2) with the recording profile
config/recording.yaml: its storage (mcap) and its topics, which hold everything `sps-driving
extract`, `replay` and `interventions` read. The camera is kept JPEG-compressed (the profile's
`camera:`): image_transport's compressed republisher runs beside the recorder, from the camera
topic to its /compressed topic, and stops with it. With the vendor camera driver, `--camera-topic`
and `--camera-info-topic` record its topics instead of the graph's; read such a bag with `extract
--camera-topic` and `replay --topic VENDOR:=GRAPH` (docs/training.md). `--print` prints the
commands instead of running them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from sps_driving.core import topics
from sps_driving.core.resources import config_path

PROFILE = config_path("recording.yaml")


def load_profile(path=PROFILE) -> dict:
    """{"storage": plugin, "camera": {"compression", "jpeg_quality"}, "topics": {topic: what reads it}}
    of a recording profile."""
    profile = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(profile.get("topics"), dict) or not profile["topics"] or not profile.get("storage"):
        raise ValueError(f"{path} needs `storage` and a `topics` mapping (topic: what reads it)")
    camera = profile.setdefault("camera", {"compression": "none"})
    if camera.get("compression") not in COMPRESSIONS:
        raise ValueError(f"{path}: camera compression must be one of {COMPRESSIONS}, got {camera.get('compression')!r}")
    if camera["compression"] == "jpeg" and not (isinstance(camera.get("jpeg_quality"), int) and 1 <= camera["jpeg_quality"] <= 100):
        raise ValueError(f"{path}: camera jpeg_quality must be an integer in 1..100, got {camera.get('jpeg_quality')!r}")
    return profile


COMPRESSIONS = ("jpeg", "none")


def record_command(out, profile: dict, camera_topic: str | None = None, camera_info_topic: str | None = None) -> list[str]:
    """The `ros2 bag record` command line of `profile` into the new bag folder `out`."""
    camera = camera_topic or topics.IMAGE
    renamed = {topics.IMAGE: camera, topics.IMAGE_COMPRESSED: f"{camera}/compressed",
               topics.CAMERA_INFO: camera_info_topic or topics.CAMERA_INFO}
    recorded = [renamed.get(topic, topic) for topic in profile["topics"]]
    return ["ros2", "bag", "record", "-s", str(profile["storage"]), "-o", str(out), *recorded]


def republish_command(profile: dict, camera_topic: str | None = None) -> list[str] | None:
    """The image_transport republisher that compresses the camera for the recorder (None when the
    profile records it raw). Its JPEG quality parameter is named after its output topic: `out.` on
    Humble, `out.compressed.` on newer distros; both are set."""
    if profile["camera"]["compression"] == "none":
        return None
    camera, quality = camera_topic or topics.IMAGE, int(profile["camera"]["jpeg_quality"])
    return ["ros2", "run", "image_transport", "republish", "raw", "compressed", "--ros-args",
            "-r", f"in:={camera}", "-r", f"out/compressed:={camera}/compressed",
            "-p", f"out.jpeg_quality:={quality}", "-p", f"out.compressed.jpeg_quality:={quality}"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="bag folder to create (e.g. drives/2026-11-03_loop_a)")
    parser.add_argument("--profile", type=Path, default=PROFILE, help="recording profile (default: config/recording.yaml)")
    parser.add_argument("--camera-topic", help=f"image topic of a vendor camera driver (default {topics.IMAGE})")
    parser.add_argument("--camera-info-topic", help=f"its camera-info topic (default {topics.CAMERA_INFO})")
    parser.add_argument("--print", action="store_true", dest="print_only", help="print the command instead of running it")


def run(args) -> int:
    try:
        profile = load_profile(args.profile)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    command = record_command(args.out, profile, args.camera_topic, args.camera_info_topic)
    republish = republish_command(profile, args.camera_topic)
    if args.print_only:
        print("\n".join(shlex.join(c) for c in (republish, command) if c))
        return 0
    if args.out.exists():
        print(f"error: {args.out} exists; rosbag2 records into a new folder", file=sys.stderr)
        return 2
    if shutil.which("ros2") is None:
        print("error: `ros2` not found: source the ROS 2 distro (setup.bash) first, or run the printed commands "
              "(--print) where it is", file=sys.stderr)
        return 2
    if republish is None:
        os.execvp(command[0], command)  # the recorder takes over this process: Ctrl-C stops it and closes the bag
    compressor = subprocess.Popen(republish)
    recorder = subprocess.Popen(command)
    try:
        while True:
            try:
                return recorder.wait()
            except KeyboardInterrupt:  # Ctrl-C reached the recorder too (one process group): wait while it closes the bag
                continue
    finally:
        compressor.terminate()
        compressor.wait(timeout=10)
