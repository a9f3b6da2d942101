"""`sps-driving analyze INPUT... --out DIR`: redundancy analysis of patch descriptors.

Each INPUT is a feature cache directory (descriptors of every patch, written by `sps-driving
extract`) or a bag (a rosbag2 folder, or a bare .mcap or .db3 file: sps_driving.bagio), whose
camera frames are run through a backbone here; several inputs of one backbone are analysed as one
stream of frames. The output folder receives PNG figures (Figure 3a,
3b, similarity overlays as in Figure 6, the lemma sweep) and summary.json.

With --orbital, the patch state families of sps_driving.analysis.orbital instead (bag inputs:
their frames are shifted); with --orbital --appearance, the same layouts rendered by the
world under other scenarios (sps_driving.analysis.appearance), without inputs.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from sps_driving.analysis.redundancy import AnalysisSettings, RedundancyAnalysis
from sps_driving.core.grid import PatchGrid
from sps_driving.resources import config_path
from sps_driving.train.extract import extraction_settings_from_args

CONFIG_NAME = "analysis.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*", type=Path, metavar="INPUT",
                        help="feature cache directories and/or bags (rosbag2 folders, .mcap or .db3 files), analysed as one stream")
    parser.add_argument("--out", type=Path, required=True, help="output folder for the figures and summary.json")
    parser.add_argument("--config", type=Path, default=None, help=f"analysis settings (default: the shipped {CONFIG_NAME})")
    parser.add_argument("--extractor-config", help="for bag inputs: YAML extractor config passed to the backbone loader")
    parser.add_argument("--backbone", help="for bag inputs: backbone name (overrides the extractor config)")
    parser.add_argument("--model-path", help="for bag inputs: local weights for the backbone (overrides the extractor config)")
    parser.add_argument("--device", help="for bag inputs: cpu, cuda, ... (overrides the extractor config)")
    parser.add_argument("--precision", choices=("fp32", "int8"),
                        help="for bag inputs: int8 runs onnxruntime's int8 graph (overrides the extractor config)")
    parser.add_argument("--image-topic", default=None, help="camera topic of bag inputs (default: the standard one)")
    parser.add_argument("--max-frames", type=int, default=None, help="analyse at most this many frames in all")
    parser.add_argument("--stride", type=int, default=1, help="analyse every this-many-th frame of each input (default 1)")
    parser.add_argument("--rank", type=int, default=None,
                        help="principal rank r for the lemma sweep (default: per frame, components to the 90%% level)")
    parser.add_argument("--overlay-image", type=Path, default=None,
                        help="when the overlay frame comes from a feature cache: its camera image (bags carry their frames)")
    orbital = parser.add_argument_group("patch state families (PMTT; docs/analysis.md)")
    orbital.add_argument("--orbital", action="store_true",
                         help="orbital views of every patch of bag frames: Center, Observed and Manifold coverage of "
                              "hidden states, effective rank, random / donor / shared controls (settings: the config's orbital:)")
    orbital.add_argument("--appearance", nargs="*", metavar="SCENARIO", default=None,
                         help="with --orbital and no INPUT: render the same layouts and poses under these scenarios "
                              "(default: the config's orbital.appearance.targets) and measure whether each patch's "
                              "shifted token stays inside the base frame's Manifold")
    orbital.add_argument("--first-seed", type=int, default=None, help="--appearance: first layout (episode seed)")
    orbital.add_argument("--episodes", type=int, default=None, help="--appearance: number of layouts")
    orbital.add_argument("--sim-config", default=None, help="--appearance: simulator YAML (default config/sim.yaml)")


FrameStream = Iterator[tuple[np.ndarray, "np.ndarray | None"]]


@dataclass
class Source:
    """One input: its backbone and grid, how many frames it will give (at most), and its frames."""

    path: Path
    backbone: str
    grid: PatchGrid
    frames: int
    stream: FrameStream


def run(args: argparse.Namespace) -> int:
    if args.stride < 1 or (args.max_frames is not None and args.max_frames < 1):
        print("error: --stride and --max-frames must be at least 1", file=sys.stderr)
        return 2
    if args.appearance is not None and not args.orbital:
        print("error: --appearance is part of the orbital analysis: add --orbital", file=sys.stderr)
        return 2
    if bool(args.inputs) == (args.appearance is not None):
        print("error: give INPUT... (or, with --orbital --appearance, no INPUT: the world renders the frames)", file=sys.stderr)
        return 2
    if args.orbital:
        return _run_orbital(args)
    try:
        settings = AnalysisSettings.from_yaml(args.config or config_path(CONFIG_NAME))
        if args.rank is not None:
            settings = replace(settings, lemma_rank=args.rank)
        overlay_image = _read_rgb(args.overlay_image) if args.overlay_image is not None else None
        sources = open_sources(args.inputs, args.stride, args)
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    first = sources[0]
    mismatched = [s.path for s in sources if (s.backbone, s.grid) != (first.backbone, first.grid)]
    if mismatched:
        print(f"error: {', '.join(map(str, mismatched))} differ from {first.path} in backbone or patch grid "
              f"({first.backbone}, {first.grid.rows}x{first.grid.cols}): analyse them separately", file=sys.stderr)
        return 2

    analysis = RedundancyAnalysis(settings, first.grid)
    total = sum(s.frames for s in sources)
    if args.max_frames is not None:
        total = min(total, args.max_frames)
    with tqdm(total=total, desc="analyse", unit="frame") as progress:
        for descriptors, image in itertools.chain.from_iterable(s.stream for s in sources):
            if image is None and analysis.frames == settings.overlay_frame:
                image = overlay_image
            if not analysis.add_frame(descriptors, image):
                print(f"warning: dropped a frame with non-finite descriptors "
                      f"({analysis.frames_dropped_nonfinite} dropped)", file=sys.stderr)
            progress.update()
            if analysis.frames == args.max_frames:
                break
    if analysis.frames == 0:
        print(f"error: no frames in {', '.join(map(str, args.inputs))}", file=sys.stderr)
        return 1
    summary = analysis.write(args.out, {"inputs": [str(p) for p in args.inputs], "backbone": first.backbone})
    print(
        f"{first.backbone}: {summary['frames']} frames, grid {first.grid.rows}x{first.grid.cols}, D={summary['dim']}: "
        f"90% variance with {summary['components_90_all']} components (all patches), "
        f"{summary['components_90_top']} (top-{summary['top_patches']} by norm); "
        f"mean |off-diagonal correlation| {summary['correlation']['mean_abs_offdiagonal']:.3f}; "
        f"written to {args.out}"
    )
    return 0


def _run_orbital(args: argparse.Namespace) -> int:
    from sps_driving.analysis.orbital import OrbitalSettings, run_orbital

    try:
        settings = OrbitalSettings.from_yaml(args.config or config_path(CONFIG_NAME))
    except (OSError, ValueError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.appearance is not None:
        from sps_driving.analysis.appearance import run_appearance

        return run_appearance(args, settings)
    return run_orbital(args, settings)


def open_sources(inputs: list[Path], stride: int, args: argparse.Namespace) -> list[Source]:
    """A Source per input; bag inputs share one extractor, loaded once every input is known good."""
    from sps_driving.bagio import BagError, is_bag, not_a_bag
    from sps_driving.train.cache import META_FILE

    bags, sources = {}, {}
    for path in inputs:
        if is_bag(path):
            bags[path] = bag_images(path, stride, args.image_topic)
        elif (path / META_FILE).is_file():
            sources[path] = _cache_source(path, stride)
        else:
            raise BagError(not_a_bag(path, "a feature cache"))
    if bags:
        from sps_driving.extractors import open_extractor

        extractor = open_extractor(extraction_settings_from_args(args)).extractor
        sources.update({path: _bag_source(path, extractor, *images) for path, images in bags.items()})
    return [sources[path] for path in inputs]


def _cache_source(path: Path, stride: int) -> Source:
    """Every `stride`-th frame of a feature cache (which holds no images)."""
    from sps_driving.train.cache import FeatureCache

    cache = FeatureCache(path)
    chosen = range(0, len(cache), stride)
    return Source(path, cache.backbone, cache.grid, len(chosen), ((cache[i].descriptors, None) for i in chosen))


def bag_images(path: Path, stride: int, image_topic: str | None) -> tuple[int, Iterator[np.ndarray]]:
    """(how many frames it will give at most, its RGB frames): every `stride`-th camera frame of a
    bag; frames that cannot be decoded are dropped, counted and reported."""
    from sps_driving import bagio, topics
    from sps_driving.core.image import ImageError, to_rgb

    topic = image_topic or topics.IMAGE
    if topic not in bagio.topic_types(path):
        raise ValueError(f"no topic {topic} in the bag {path} (use --image-topic)")
    count = bagio.message_count(path, topic)

    def frames() -> Iterator[np.ndarray]:
        dropped = 0
        try:
            for index, message in enumerate(bagio.read_messages(path, [topic])):
                if index % stride:
                    continue
                msg = message.msg
                try:
                    rgb = to_rgb(msg.data, msg.height, msg.width, msg.encoding, msg.step)
                except ImageError as error:
                    dropped += 1
                    print(f"warning: {path}: dropped frame at {message.log_time_ns} ns: {error} ({dropped} dropped)",
                          file=sys.stderr)
                    continue
                yield rgb
        except bagio.BagError as error:  # damaged part-way: the frames before it are analysed
            print(f"warning: {error}; its frames from there on are left out", file=sys.stderr)

    return len(range(0, count, stride)), frames()


def _bag_source(path: Path, extractor, count: int, images: Iterator[np.ndarray]) -> Source:
    """The camera frames of a bag (`bag_images`) with all their patch descriptors, computed here."""
    all_patches = np.arange(extractor.grid.n, dtype=np.int64)
    stream = ((extractor.descriptors(extractor.encode(rgb), all_patches), rgb) for rgb in images)
    return Source(path, extractor.name, extractor.grid, count, stream)


def _read_rgb(path: Path) -> np.ndarray:
    import cv2

    bgr = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if bgr is None:
        raise ValueError(f"cannot read the overlay image {path}")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
