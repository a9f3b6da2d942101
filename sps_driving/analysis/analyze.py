"""`sps-driving analyze INPUT --out DIR`: redundancy analysis of patch descriptors.

INPUT is a feature cache directory (descriptors of every patch, written by `sps-driving
extract`) or a rosbag2 (a folder with metadata.yaml, or a .db3 / .mcap file), whose camera
frames are run through a backbone here. The output folder receives PNG figures (Figure 3a,
3b, similarity overlays as in Figure 6, the lemma sweep) and summary.json.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from sps_driving.analysis.redundancy import AnalysisSettings, RedundancyAnalysis
from sps_driving.core.grid import PatchGrid
from sps_driving.train.extract import extractor_config_from_args

CONFIG_NAME = "analysis.yaml"


def default_config_path(name: str = CONFIG_NAME) -> Path:
    """A shipped config file: the source tree's config/ (editable install), else the installed share/."""
    candidates = [
        Path(__file__).resolve().parents[2] / "config" / name,
        Path(sys.prefix) / "share" / "sps_driving" / "config" / name,
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"config file {name} not found in {', '.join(str(c.parent) for c in candidates)}")


def is_rosbag(path: Path) -> bool:
    return (path.is_dir() and (path / "metadata.yaml").is_file()) or path.suffix in (".db3", ".mcap")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="feature cache directory or rosbag2 (folder, .db3 or .mcap)")
    parser.add_argument("--out", type=Path, required=True, help="output folder for the figures and summary.json")
    parser.add_argument("--config", type=Path, default=None, help=f"analysis settings (default: the shipped {CONFIG_NAME})")
    parser.add_argument("--extractor-config", help="for a rosbag2: YAML extractor config passed to the backbone loader")
    parser.add_argument("--backbone", help="for a rosbag2: backbone name (overrides the extractor config)")
    parser.add_argument("--model-path", help="for a rosbag2: local weights for the backbone (overrides the extractor config)")
    parser.add_argument("--device", help="for a rosbag2: cpu, cuda, ... (overrides the extractor config)")
    parser.add_argument("--image-topic", default=None, help="camera topic of a rosbag2 input (default: the standard one)")
    parser.add_argument("--max-frames", type=int, default=None, help="analyse at most this many frames")
    parser.add_argument("--stride", type=int, default=1, help="analyse every this-many-th frame (default 1)")
    parser.add_argument("--rank", type=int, default=None,
                        help="principal rank r for the lemma sweep (default: per frame, components to the 90%% level)")
    parser.add_argument("--overlay-image", type=Path, default=None,
                        help="for a feature cache: the camera image of the overlay frame (bags carry their frames)")


def run(args: argparse.Namespace) -> int:
    if args.stride < 1 or (args.max_frames is not None and args.max_frames < 1):
        print("error: --stride and --max-frames must be at least 1", file=sys.stderr)
        return 2
    settings = AnalysisSettings.from_yaml(args.config or default_config_path())
    if args.rank is not None:
        settings = AnalysisSettings(**{**settings.__dict__, "lemma_rank": args.rank})
    if not args.input.exists():
        print(f"error: {args.input} does not exist", file=sys.stderr)
        return 2
    try:
        if is_rosbag(args.input):
            backbone, grid, total, frames = _bag_frames(args.input, args.stride, extractor_config_from_args(args), args.image_topic)
        else:
            backbone, grid, total, frames = _cache_frames(args.input, args.stride, settings.overlay_frame, args.overlay_image)
    except (OSError, ValueError, KeyError) as error:
        print(f"error: cannot read {args.input}: {error}", file=sys.stderr)
        return 2

    analysis = RedundancyAnalysis(settings, grid)
    if total is not None and args.max_frames is not None:
        total = min(total, args.max_frames)
    with tqdm(total=total, desc="analyse", unit="frame") as progress:
        for descriptors, image in frames:
            analysis.add_frame(descriptors, image)
            progress.update()
            if analysis.frames == args.max_frames:
                break
    if analysis.frames == 0:
        print(f"error: no frames in {args.input}", file=sys.stderr)
        return 1
    summary = analysis.write(args.out, {"input": str(args.input), "backbone": backbone})
    print(
        f"{backbone}: {summary['frames']} frames, grid {grid.rows}x{grid.cols}, D={summary['dim']}: "
        f"90% variance with {summary['components_90_all']} components (all patches), "
        f"{summary['components_90_top']} (top-{summary['top_patches']} by norm); "
        f"mean |off-diagonal correlation| {summary['correlation']['mean_abs_offdiagonal']:.3f}; "
        f"written to {args.out}"
    )
    return 0


FrameStream = Iterator[tuple[np.ndarray, "np.ndarray | None"]]


def _cache_frames(
    path: Path, stride: int, overlay_frame: int, overlay_image: Path | None
) -> tuple[str, PatchGrid, int, FrameStream]:
    """Every `stride`-th frame of a feature cache; the overlay frame (counted after the stride)
    comes with `overlay_image`, since a cache holds no images."""
    from sps_driving.train.cache import FeatureCache

    cache = FeatureCache(path)
    image = _read_rgb(overlay_image) if overlay_image is not None else None
    chosen = range(0, len(cache), stride)

    def frames() -> FrameStream:
        for position, index in enumerate(chosen):
            yield cache[index].descriptors, image if position == overlay_frame else None

    return cache.backbone, cache.grid, len(chosen), frames()


def _bag_frames(
    path: Path, stride: int, extractor_config: dict, image_topic: str | None
) -> tuple[str, PatchGrid, None, FrameStream]:
    """Every `stride`-th camera frame of a rosbag2 with all its patch descriptors, computed here;
    frames that cannot be decoded are dropped, counted and reported."""
    from sps_driving import bagio, topics
    from sps_driving.core.backbones import load_extractor
    from sps_driving.core.image import ImageError, to_rgb

    extractor = load_extractor(extractor_config)
    topic = image_topic or topics.IMAGE
    if topic not in bagio.topic_types(path):
        raise ValueError(f"no topic {topic} in the bag (use --image-topic)")
    all_patches = np.arange(extractor.grid.n, dtype=np.int64)

    def frames() -> FrameStream:
        dropped = 0
        for index, message in enumerate(bagio.read_messages(path, [topic])):
            if index % stride:
                continue
            msg = message.msg
            try:
                rgb = to_rgb(msg.data, msg.height, msg.width, msg.encoding, msg.step)
            except ImageError as error:
                dropped += 1
                print(f"warning: dropped frame at {message.log_time_ns} ns: {error} ({dropped} dropped)", file=sys.stderr)
                continue
            yield extractor.descriptors(extractor.encode(rgb), all_patches), rgb

    return extractor.name, extractor.grid, None, frames()


def _read_rgb(path: Path) -> np.ndarray:
    import cv2

    bgr = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if bgr is None:
        raise ValueError(f"cannot read the overlay image {path}")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
