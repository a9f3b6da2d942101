"""The frames the analyses read: every `stride`-th frame of a feature cache (descriptors only) or
of a bag (a rosbag2 folder, or a bare .mcap or .db3 file, read as a drive: sps_driving.ros.drive), whose camera frames
are run through a backbone; an image file."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sps_driving.core.grid import PatchGrid
from sps_driving.train.extract import extraction_settings_from_args

FrameStream = Iterator[tuple[np.ndarray, "np.ndarray | None"]]


@dataclass
class Source:
    """One input: its backbone and grid, how many frames it will give (at most), and its frames."""

    path: Path
    backbone: str
    grid: PatchGrid
    frames: int
    stream: FrameStream


def open_sources(inputs: list[Path], stride: int, args: argparse.Namespace) -> list[Source]:
    """A Source per input; bag inputs share one extractor, loaded once every input is known good."""
    from sps_driving.ros.bagio import BagError, is_bag, not_a_bag
    from sps_driving.train.cache import META_FILE

    bags, sources = {}, {}
    for path in inputs:
        if is_bag(path):
            bags[path] = bag_images(path, stride, args.image_topic)
        elif (path / META_FILE).is_file():
            sources[path] = cache_source(path, stride)
        else:
            raise BagError(not_a_bag(path, "a feature cache"))
    if bags:
        from sps_driving.export.extractors import open_extractor

        extractor = open_extractor(extraction_settings_from_args(args)).extractor
        sources.update({path: bag_source(path, extractor, *images) for path, images in bags.items()})
    return [sources[path] for path in inputs]


def cache_source(path: Path, stride: int) -> Source:
    """Every `stride`-th frame of a feature cache (which holds no images)."""
    from sps_driving.train.cache import FeatureCache

    cache = FeatureCache(path)
    chosen = range(0, len(cache), stride)
    return Source(path, cache.backbone, cache.grid, len(chosen), ((cache[i].descriptors, None) for i in chosen))


def bag_images(path: Path, stride: int, image_topic: str | None) -> tuple[int, Iterator[np.ndarray]]:
    """(how many frames it will give at most, its RGB frames): every `stride`-th camera frame of a
    bag (raw or compressed: sps_driving.ros.drive); frames that cannot be decoded are dropped,
    counted and reported."""
    from sps_driving.ros.drive import camera_frames, decoded

    try:
        camera = camera_frames(path, image_topic)
    except ValueError as error:
        raise ValueError(f"{error} (use --image-topic)") from None
    return len(range(0, camera.count, stride)), (rgb for _, rgb in decoded(camera.frames(), path, stride))


def bag_source(path: Path, extractor, count: int, images: Iterator[np.ndarray]) -> Source:
    """The camera frames of a bag (`bag_images`) with all their patch descriptors, computed here."""
    all_patches = np.arange(extractor.grid.n, dtype=np.int64)
    stream = ((extractor.descriptors(extractor.encode(rgb), all_patches), rgb) for rgb in images)
    return Source(path, extractor.name, extractor.grid, count, stream)


def read_rgb(path: Path) -> np.ndarray:
    import cv2

    bgr = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if bgr is None:
        raise ValueError(f"cannot read the overlay image {path}")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
