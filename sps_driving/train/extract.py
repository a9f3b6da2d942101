"""`sps-driving extract --out CACHE INPUT...`: recorded drives -> a feature cache for training.

Each INPUT is either
- a bag (a rosbag2 folder, or a bare .mcap or .db3 file, read as a drive: sps_driving.ros.drive):
  camera frames (sensor_msgs/Image, or JPEG CompressedImage on the camera topic's /compressed as
  `record` keeps them) on the camera topic, labelled from one of two sources (`label_source`;
  auto: the first the bag has):
  - "command": the reference command (sensor_msgs/JointState "steering", "throttle") whose header
    stamp is nearest to the frame's, if within the configured tolerance (the world's bags);
  - "pacmod3": what the safety driver did, from the car's PACMod 3 reports interpolated to the
    frame's stamp, human driving only, and the frames after each override marked as an
    intervention (sps_driving.ros.car_labels; the car's bags); or
- an image folder with labels.csv (columns filename, steering, throttle and optionally
  stamp_ns; frames without stamp_ns get stamps at the configured nominal frame rate).

Each frame also gets its state inputs (sps_driving.core.state: the car's speed, the cruise target
speed), paired by stamp like the label from the first of each input's topics the bag has (an
invalid PACMod speed report is an unknown speed), or from labels.csv columns of the same names;
NaN where unknown (no topic, nothing within the tolerance). Frames are kept either way: the
trainer decides which state its policy needs, and the counts say how many frames lack one.

Every frame's descriptors are computed for all patches (rate 1.0) by the configured backbone and
written to the feature cache (docs/feature_cache.md), with the input's name as the frame's
source. With token dropping (DINOv2 with tokens kept, `--keep-rate R`), a descriptor depends on
which patches were kept with it: each frame's patches are split into floor(N / k) disjoint
groups of k = ceil(R N) (`PatchSelector.groups` of selection seed `--selection-seed`: group 0 is
what that selection keeps at the frame's stamp), each group computed in one pass, and the cache
records the groups, of which training picks one per frame as its selection (meta
"token_dropping"; the N mod k patches left over are stored as zeros in no group).

A frame that cannot be used (undecodable image, no command in tolerance, non-finite
label or descriptors, and for car labels the reasons of car_labels.DROP_REASONS) is skipped and
counted by reason; the counts go to meta.json ("counts") with, per input, where its labels came
from and by which rules ("labels"), and to the summary printed at the end.

The frames go in units of shard_size camera frames of one input, each its own shard: a rerun of
an interrupted extraction keeps the finished units, and under torchrun the processes share them
(`extract`; docs/distributed.md).

With --orbital-every K, every K-th written frame of each unit (rows 0, K, 2K, ... of its shard)
also gets the visible orbital states of all its patches (sps_driving.core.orbital: 16 sub-patch
shifts of the backbone input, read by the torch DINOv2 extractor, in the family of the cache's
own descriptors), for Manifold augmentation in training (docs/feature_cache.md, docs/training.md).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import cv2
import numpy as np
import yaml
from tqdm import tqdm

from sps_driving.core import topics
from sps_driving.core.resources import config_path
from sps_driving.core.state import STATE_INPUTS, nearest, recorded_source
from sps_driving.ros.car_labels import (
    HANDOVERS,
    LABEL_SOURCES,
    CarLabelRules,
    has_reports,
    label_source,
    missing_reports,
    read_car_labels,
)
from sps_driving.train.cache import META_FILE, UnitCacheWriter, UnitShards
from sps_driving.train.distributed import Processes, shares, start_processes

LABELS_FILE = "labels.csv"
TRAIN_CONFIG = config_path("train.yaml")


@dataclass
class LabelledFrame:
    rgb: np.ndarray | None  # None when the image could not be decoded
    steering: float
    throttle: float
    stamp_ns: int
    drop_reason: str | None = None
    state: dict = field(default_factory=dict)  # {state input name: value}; unknown ones left out or NaN
    intervention: bool = False  # in the seconds after a safety driver's override



@dataclass(frozen=True)
class ExtractSettings:
    camera_topic: str = topics.IMAGE
    command_topic: str = topics.REFERENCE_COMMAND
    label_source: str = "auto"
    match_tolerance_s: float = 0.02
    max_report_gap_s: float = 0.1
    min_speed_mps: float = 0.5
    exclude_reverse: bool = True
    label_stack_driving: bool = False
    intervention_window_s: float = 3.0
    handover_guard_s: float = 0.1
    image_folder_frame_rate_hz: float = 30.0
    shard_size: int = 512

    @classmethod
    def from_yaml(cls, path=TRAIN_CONFIG) -> ExtractSettings:
        section = (yaml.safe_load(Path(path).read_text()) or {}).get("extract", {})
        unknown = set(section) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown extract settings {sorted(unknown)} in {path}")
        return cls(**section)

    def __post_init__(self) -> None:
        if not (self.match_tolerance_s >= 0 and self.image_folder_frame_rate_hz > 0 and self.shard_size >= 1):
            raise ValueError("need match_tolerance_s >= 0, image_folder_frame_rate_hz > 0 and shard_size >= 1")
        if self.label_source not in LABEL_SOURCES:
            raise ValueError(f"label_source must be one of {LABEL_SOURCES}, got {self.label_source!r}")
        self.car_label_rules()  # checks them

    def car_label_rules(self) -> CarLabelRules:
        return CarLabelRules(self.max_report_gap_s, self.min_speed_mps, self.exclude_reverse, self.label_stack_driving,
                             self.intervention_window_s, self.handover_guard_s)


def input_kind(path: Path) -> str:
    from sps_driving.ros.bagio import BagError, is_bag, not_a_bag

    if is_bag(path):
        return "rosbag2"
    if (path / LABELS_FILE).is_file():
        return "image_folder"
    raise BagError(not_a_bag(path, f"an image folder with {LABELS_FILE}"))


def _command_values(msg) -> tuple[float, float] | None:
    names = list(msg.name)
    try:
        steering = float(msg.position[names.index("steering")])
        throttle = float(msg.position[names.index("throttle")])
    except (ValueError, IndexError):
        return None
    return steering, throttle


def bag_label_source(present: dict, settings: ExtractSettings) -> str:
    """"command" or "pacmod3": where the labels of a bag with topics `present` ({topic: message
    type}) come from (car_labels.label_source; a bag with both says so in the cache's "labels")."""
    return label_source(present, settings.label_source, settings.command_topic)


def camera_choice(settings: ExtractSettings) -> str | None:
    """The camera topic asked for, None for the default: the raw camera, else the compressed one
    (`record` keeps it compressed; sps_driving.ros.drive.camera_topic_of)."""
    return None if settings.camera_topic == topics.IMAGE else settings.camera_topic


def camera_topic(present: dict, settings: ExtractSettings) -> str:
    """The bag's camera topic (`camera_choice`), or the configured one where it has none."""
    from sps_driving.ros.drive import camera_topic_of

    return camera_topic_of(present, camera_choice(settings)) or settings.camera_topic


def check_inputs(inputs: Sequence[Path], settings: ExtractSettings) -> list[str]:
    """Each input's kind; fails before any extraction on an unknown input or a bag without the
    camera topic or what its labels are read from (usually a wrong topic name)."""
    from sps_driving.ros.bagio import topic_types

    kinds = [input_kind(Path(path)) for path in inputs]
    for path, kind in zip(inputs, kinds):
        if kind != "rosbag2":
            continue
        present = topic_types(path)
        missing = [t for t in (camera_topic(present, settings),) if t not in present]
        if bag_label_source(present, settings) == "command":
            missing += [t for t in (settings.command_topic,) if t not in present]
        else:
            missing += missing_reports(present, settings.car_label_rules())
        if missing:
            raise ValueError(f"bag {path} has no topic {', '.join(missing)}; its topics: {', '.join(sorted(present))}")
    return kinds


def bag_states(drive) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{state input: (sorted stamps ns, float64 values, NaN where the report said invalid)} from the
    first of each input's topics (sps_driving.core.state) that the drive has; inputs it lacks are left out."""
    out = {}
    for name in STATE_INPUTS:
        source = recorded_source(name, drive.topics)
        if source is not None and source[0] in drive.series:
            out[name] = drive.series[source[0]].by_stamp()
    return out


def matched_state(states: dict, stamp: int, tolerance_ns: int) -> dict:
    """{name: value} of the state whose stamp is nearest to `stamp`, within the tolerance."""
    state = {}
    for name, (stamps, values) in states.items():
        index = nearest(stamps, stamp)
        if index is not None and abs(int(stamps[index]) - stamp) <= tolerance_ns:
            state[name] = float(values[index])
    return state


def command_labels(drive, settings: ExtractSettings, counts: Counter):
    """label(stamp, log time) -> LabelledFrame without its image: the reference command whose
    header stamp is nearest to the frame's, within the tolerance."""
    series = drive.series.get(settings.command_topic)
    recorded = drive.counts.get(settings.command_topic, 0)
    stamps, values = np.zeros(0, np.int64), np.zeros((0, 2))
    if series is not None:
        finite = np.isfinite(series.values).all(axis=1) & (series.values.shape[1] == 2)
        order = np.argsort(series.stamp_ns[finite], kind="stable")
        stamps, values = series.stamp_ns[finite][order], series.values[finite][order]
    if recorded - len(stamps):
        counts["invalid_command_messages"] += recorded - len(stamps)
    tolerance_ns = int(settings.match_tolerance_s * 1e9)

    def label(stamp: int, _log_time: int) -> LabelledFrame:
        command = nearest(stamps, stamp)
        if command is None or abs(int(stamps[command]) - stamp) > tolerance_ns:
            return LabelledFrame(None, math.nan, math.nan, stamp, "no_command_in_tolerance")
        steering, throttle = values[command]
        return LabelledFrame(None, float(steering), float(throttle), stamp)

    return label


def human_labels(car):
    """label(stamp, log time) -> LabelledFrame without its image, from a car_labels.CarLabels;
    its speed is the frame's speed state input."""
    def label(stamp: int, log_time: int) -> LabelledFrame:
        human = car.label(stamp, log_time)
        if human.drop_reason:
            return LabelledFrame(None, math.nan, math.nan, stamp, human.drop_reason)
        return LabelledFrame(None, human.steering, human.throttle, stamp, state={"speed_mps": human.speed_mps},
                             intervention=human.intervention)

    return label


def bag_frames(path: Path, settings: ExtractSettings, counts: Counter, labels: dict, steering_ratio: float,
               first: int = 0, stop: int | None = None) -> Iterator[LabelledFrame]:
    """Camera frames first..stop-1 of a bag, each labelled from the bag's label source
    (`bag_label_source`) and with its state inputs matched by stamp (the car's labels bring their
    own speed). `labels` gets where the labels came from and by which rules."""
    from sps_driving.core.image import ImageError
    from sps_driving.ros.drive import read_drive

    drive = read_drive(path, camera_choice(settings))
    present = drive.topics
    if bag_label_source(present, settings) == "command":
        label = command_labels(drive, settings, counts)
        labels.update({"from": settings.command_topic, "match_tolerance_s": settings.match_tolerance_s})
    else:
        car = read_car_labels(drive, settings.car_label_rules(), steering_ratio)
        label = human_labels(car)
        labels.update(car.describe())
    if has_reports(present) and settings.command_topic in present:
        labels["also_in_bag"] = "pacmod3 reports" if labels["from"] == settings.command_topic else settings.command_topic
    tolerance_ns = int(settings.match_tolerance_s * 1e9)
    states = bag_states(drive)

    for camera_frame in drive.camera.frames(first, stop):
        frame = label(camera_frame.stamp_ns, camera_frame.log_ns)
        if frame.drop_reason:
            yield frame
            continue
        try:
            frame.rgb = camera_frame.rgb()
        except ImageError:
            frame.drop_reason = "undecodable_image"
            yield frame
            continue
        frame.state = {**matched_state(states, frame.stamp_ns, tolerance_ns), **frame.state}
        yield frame


def folder_rows(path: Path) -> list[dict]:
    with open(path / LABELS_FILE, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"filename", "steering", "throttle"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path / LABELS_FILE} lacks the column(s) {sorted(missing)}")
        return list(reader)


def folder_frames(path: Path, settings: ExtractSettings, counts: Counter, first: int = 0,
                  stop: int | None = None) -> Iterator[LabelledFrame]:
    """Frames first..stop-1 of an image folder (rows of labels.csv)."""
    period_ns = int(round(1e9 / settings.image_folder_frame_rate_hz))
    rows = folder_rows(path)
    for row_number, row in enumerate(rows[first:stop], start=first):
        try:
            steering, throttle = float(row["steering"]), float(row["throttle"])
            stamp = int(row["stamp_ns"]) if row.get("stamp_ns") else row_number * period_ns
            state = {name: float(row[name]) for name in STATE_INPUTS if row.get(name)}
        except (TypeError, ValueError):
            yield LabelledFrame(None, math.nan, math.nan, row_number * period_ns, "bad_label_row")
            continue
        bgr = cv2.imread(str(path / row["filename"]), cv2.IMREAD_COLOR)
        if bgr is None:
            yield LabelledFrame(None, steering, throttle, stamp, "undecodable_image")
            continue
        yield LabelledFrame(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), steering, throttle, stamp, state=state)


def source_names(inputs: Sequence[Path]) -> list[str]:
    """The inputs' names (a bare bag file's without its suffix), made unique (episode names drive
    the validation split)."""
    from sps_driving.ros.bagio import bag_name

    names, seen = [], Counter()
    for path in inputs:
        base = bag_name(path)
        seen[base] += 1
        names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return names


def _cache_meta(extractor, extractor_config: dict | None, inputs: list[Path], groups, orbital_every: int) -> dict:
    """meta.json's description of the descriptors (backbone, extractor settings, grid, inputs) and,
    for an extractor that drops tokens, of its patch groups. ValueError for patch groups without
    such an extractor, such an extractor without them, or patch groups with orbital states."""
    meta = {
        "backbone": extractor.name,
        "extractor": extractor_config or {"name": extractor.name},
        "grid": {"rows": extractor.grid.rows, "cols": extractor.grid.cols},
        "descriptor_dim": int(extractor.dim),
        "inputs": [str(p) for p in inputs],
    }
    if getattr(extractor, "drops_tokens", False) != (groups is not None):
        raise ValueError("an extractor that drops tokens (tokens kept) needs the keep-rate of the patch groups it computes "
                         "(--keep-rate), and only such an extractor takes one")
    if groups is not None:
        if orbital_every:
            raise ValueError("orbital states are dense descriptors of shifted inputs; a token-dropping cache cannot hold them")
        meta["token_dropping"] = {**groups.config.to_dict(), "kept": groups.count, "groups": groups.grid.n // groups.count}
        del meta["token_dropping"]["keep_probability"]
    return meta


def _orbital_reader(extractor, extractor_config: dict | None, device, every: int):
    """(the reader of the frames' visible orbital states, its meta.json entry); `device`: the one
    this process runs on under torchrun (None: as the extractor config says)."""
    from sps_driving.core.orbital import visible_reader

    # A twin extractor (an exported backend's) runs on this process's device, as the extractor does.
    twin_config = extractor_config if device is None else {**(extractor_config or {}), "device": str(device)}
    orbital = visible_reader(extractor, twin_config)
    return orbital, {"offsets_px": orbital.offsets.tolist(), "family": orbital.families[0], "every": int(every)}


class _Units:
    """The extraction's units, (input, unit), in input order: `size` consecutive camera frames of
    one input each, the last of an input all that remain (at least one unit per input)."""

    def __init__(self, totals: list[int], size: int):
        self.totals, self.size = totals, size
        self.all = [(i, c) for i, total in enumerate(totals) for c in range(max(1, math.ceil(total / size)))]
        self.last = {i: c for i, c in self.all}  # input -> its last unit

    @staticmethod
    def name(unit: tuple[int, int]) -> str:
        return f"{unit[0]:05d}_{unit[1]:05d}"

    def frames(self, unit: tuple[int, int]) -> int:
        """The camera frames the unit plans for."""
        i, c = unit
        return self.totals[i] - c * self.size if c == self.last[i] else self.size

    def count(self, unit: tuple[int, int]) -> int | None:
        """The frames to read for the unit (None: all that remain of its input)."""
        i, c = unit
        return None if c == self.last[i] else self.size


def _units_to_do(writer: UnitCacheWriter, mine: list, units: _Units, procs: Processes, out) -> tuple[set, int]:
    """(this process's units not written yet, camera frames of the units all processes have
    written already); says what is resumed and, under torchrun, what this process takes."""
    todo = {unit for unit in mine if writer.done(units.name(unit)) is None}
    done_units, done_frames = procs.all_sum(len(mine) - len(todo), sum(units.frames(u) for u in mine if u not in todo))
    if procs.main and done_units:
        tqdm.write(f"resuming {out}: {int(done_units)} of {len(units.all)} units ({int(done_frames)} frames) already written")
    if procs.world_size > 1:
        procs.log(f"extract: {len(mine)} of {len(units.all)} units ({sum(map(units.frames, mine))} camera frames)"
                  + (f" from {units.name(mine[0])} on" if mine else "") + f", {len(mine) - len(todo)} already written")
    return todo, int(done_frames)


def _stretch_for(unit: tuple[int, int], stretch: _Stretch | None, todo: set, units: _Units, inputs: list[Path],
                 kinds: list[str], settings: ExtractSettings, steering_ratio: float) -> _Stretch:
    """The reading to take `unit` from: `stretch` when the unit is its next, else (closing
    `stretch`) a new one over the consecutive units to do from `unit` on."""
    i, c = unit
    if stretch is not None and (stretch.input, stretch.next_unit) == unit:
        return stretch
    end = c
    while (i, end + 1) in todo:
        end += 1
    if stretch is not None:
        stretch.close()
    return _Stretch(i, c, inputs[i], kinds[i], settings, steering_ratio, c * units.size,
                    None if end == units.last[i] else (end + 1) * units.size)


@dataclass(frozen=True)
class _FrameStore:
    """How `extract` stores each frame: descriptors of all `patches` (in `groups` for an extractor
    that drops tokens), with the orbital states of every `orbital_every`-th frame of a unit when
    there is an `orbital` reader."""

    extractor: object
    patches: np.ndarray
    orbital: object = None
    orbital_every: int = 0
    groups: object = None

    def write_unit(self, shards: UnitShards, stretch: _Stretch, count: int | None, source: str, first_of_input: bool,
                   bar) -> tuple[int, int]:
        """Store a unit's `count` frames (None: all that remain) read from `stretch` in its shards,
        ticking `bar` (None: no bar) for each; returns (camera frames read, frames written). The
        input's first unit also records what the reading found of the input as a whole."""
        counts, seen = Counter(), 0
        for frame in stretch.next(count):
            # The unit's own written frames pick those with orbital states: the same whichever process writes it.
            wants_orbital = self.orbital is not None and shards.frames % self.orbital_every == 0
            _count_frame(shards, self.extractor, frame, self.patches, source, counts, self.orbital if wants_orbital else None,
                         self.groups)
            seen += 1
            if bar is not None:
                bar.update(1)
        record = {"counts": dict(counts)}
        if first_of_input:  # what is the input's, not its frames': counted once
            record.update(counts=dict(counts + stretch.counts), labels=stretch.labels)
        return seen, shards.finish(record)["frames"]


def _close_cache(writer: UnitCacheWriter, units: _Units, mine: list, sources: list[str]) -> dict:
    """Close the cache with the counts and label sources of every input, summed over its units
    (whichever process wrote them); returns the counts."""
    records = writer.records([units.name(u) for u in mine])
    report, labels = {}, {}
    for (i, c), record in zip(units.all, records):
        report[sources[i]] = dict(Counter(report.get(sources[i], {})) + Counter(record["counts"]))
        if c == 0:
            labels[sources[i]] = record["labels"]
    writer.close(records, {"counts": report, "labels": labels})
    return report


def extract(inputs: Sequence, out, extractor, extractor_config: dict | None = None,
            settings: ExtractSettings = ExtractSettings(), overwrite: bool = False, params_file: Path | None = None,
            processes: Processes | None = None, orbital_every: int = 0, groups=None) -> dict:
    """Write a feature cache at `out` from `inputs`; returns per-input counts (written, dropped by
    reason; written_intervention: frames after an override). Car labels use the steering ratio of
    `params_file` (config/graph.yaml by default: the vehicle interface's). orbital_every K > 0:
    every K-th written frame of each unit (its shard's rows 0, K, 2K, ...) also stores its patches'
    visible orbital states. `groups` (a PatchSelector of an exact-count variant, for an extractor
    that drops tokens): each frame's patches in its groups, each group computed in one pass
    (module docstring).

    The work is split into units of settings.shard_size consecutive camera frames of one input,
    each written to a shard of its own (shard_IIIII_CCCCC: input I, unit C): with several
    `processes` (torchrun) each takes an equal contiguous block of units, and the cache is the same
    as one process writes. A cut-short run resumes with the units not finished (UnitCacheWriter).
    """
    from sps_driving.ros.bagio import message_count, topic_types
    from sps_driving.ros.graph import car_facts

    procs = processes or Processes()
    inputs = [Path(p) for p in inputs]
    kinds = check_inputs(inputs, settings)
    sources = source_names(inputs)
    totals = [message_count(path, camera_topic(topic_types(path), settings)) if kind == "rosbag2" else len(folder_rows(path))
              for path, kind in zip(inputs, kinds)]
    steering_ratio = float(car_facts(params_file)["steering_ratio"])
    meta = _cache_meta(extractor, extractor_config, inputs, groups, orbital_every)
    orbital = None
    if orbital_every:
        device = None if processes is None else procs.device
        orbital, meta["orbital"] = _orbital_reader(extractor, extractor_config, device, orbital_every)
    plan = extraction_plan(meta, settings, steering_ratio, sources, kinds, totals)
    procs.agree("the extraction settings and inputs (their names and frame counts)", plan)
    units = _Units(totals, settings.shard_size)
    writer = UnitCacheWriter(out, meta, plan, [units.name(u) for u in units.all], sources, extractor.position_table(),
                             units.size, overwrite, procs)
    mine = [units.all[k] for k in shares(len(units.all), procs)]
    todo, done_frames = _units_to_do(writer, mine, units, procs, out)
    bar = tqdm(total=sum(totals), initial=done_frames, desc="extract", unit="frame", disable=not procs.main)
    store = _FrameStore(extractor, np.arange(extractor.grid.n, dtype=np.int64), orbital, orbital_every, groups)
    stretch = None  # the reading of this process's consecutive unfinished units of one input
    started, written = time.perf_counter(), 0
    for position in range(math.ceil(len(units.all) / procs.world_size)):  # rounds: one unit per process
        unit = mine[position] if position < len(mine) else None
        seen = 0
        if unit in todo:
            i, c = unit
            stretch = _stretch_for(unit, stretch, todo, units, inputs, kinds, settings, steering_ratio)
            shards = writer.unit(units.name(unit), f"shard_{i:05d}", c)
            seen, frames = store.write_unit(shards, stretch, units.count(unit), sources[i], c == 0,
                                            bar if procs.world_size == 1 else None)
            written += frames
        if procs.world_size > 1:
            bar.update(int(procs.all_sum(seen)[0]))
    bar.close()
    if stretch is not None:
        stretch.close()
    if procs.world_size > 1:
        procs.log(f"extract: {written} frames written in {time.perf_counter() - started:.0f} s")
    return _close_cache(writer, units, mine, sources)


class _Stretch:
    """One pass over camera frames first..stop-1 of input `index` (consecutive units), unit by unit;
    `counts` and `labels` get what the reading finds of the input as a whole (messages that are no
    frame's, where the labels come from)."""

    def __init__(self, index: int, unit: int, path: Path, kind: str, settings: ExtractSettings, steering_ratio: float,
                 first: int, stop: int | None):
        self.input, self.next_unit = index, unit
        self.counts, self.labels = Counter(), {}
        if kind == "rosbag2":
            self.frames = bag_frames(path, settings, self.counts, self.labels, steering_ratio, first, stop)
        else:
            self.frames = folder_frames(path, settings, self.counts, first, stop)
            self.labels["from"] = LABELS_FILE

    def next(self, count: int | None) -> Iterator[LabelledFrame]:
        """The next unit's `count` frames (None: all that remain)."""
        self.next_unit += 1
        return itertools.islice(self.frames, count)

    def close(self) -> None:
        self.frames.close()


def extraction_plan(meta: dict, settings: ExtractSettings, steering_ratio: float, sources: list[str], kinds: list[str],
                    totals: list[int]) -> dict:
    """What every process of an extraction, and a resumed one, must share: the descriptors'
    settings, the extraction and label settings, the orbital states asked for, and the inputs by
    name, kind and frame count (paths may differ between machines; runtime settings such as the
    device may too)."""
    from sps_driving.core.backbones import DESCRIPTOR_KEYS

    descriptor_settings = {key: value for key, value in meta["extractor"].items() if key in (*DESCRIPTOR_KEYS, "precision", "dtype")}
    return {"backbone": meta["backbone"], "grid": meta["grid"], "descriptor_dim": meta["descriptor_dim"],
            "extractor": descriptor_settings, "settings": asdict(settings), "steering_ratio": steering_ratio,
            "orbital": meta.get("orbital"), "token_dropping": meta.get("token_dropping"),
            "inputs": [{"source": s, "kind": k, "frames": t} for s, k, t in zip(sources, kinds, totals)]}


def _count_frame(writer, extractor, frame: LabelledFrame, patches: np.ndarray, source: str, counts: Counter,
                 orbital=None, groups=None) -> None:
    """Store `frame` (with its orbital states when an OrbitalReader `orbital` is given; in its
    patch groups when a PatchSelector `groups` is) unless it was dropped already, counting it as
    written or by its drop reason."""
    if frame.drop_reason is None:
        frame.drop_reason = _add_frame(writer, extractor, frame, patches, source, orbital, groups)
    counts[frame.drop_reason or "written"] += 1
    if frame.drop_reason is None:
        for name in STATE_INPUTS:
            if not math.isfinite(frame.state.get(name, math.nan)):
                counts[f"written_without_{name}"] += 1
        if frame.intervention:
            counts["written_intervention"] += 1


def _add_frame(writer: UnitShards, extractor, frame: LabelledFrame, patches: np.ndarray, source: str,
               orbital=None, groups=None) -> str | None:
    """Extract and store one frame (with its orbital states when an OrbitalReader `orbital` is
    given; group by group when a PatchSelector `groups` is); returns the drop reason, or None when written."""
    try:
        encoded = extractor.encode(frame.rgb)
        if groups is None:
            descriptors, frame_groups = extractor.descriptors(encoded, patches), None
        else:
            frame_groups = groups.groups(frame.stamp_ns)
            descriptors = np.zeros((len(patches), extractor.dim), np.float32)  # the patches in no group stay zeros
            for group in range(groups.grid.n // groups.count):
                kept = np.flatnonzero(frame_groups == group)
                descriptors[kept] = extractor.descriptors(encoded, kept)
        states = orbital.read(frame.rgb)[orbital.families[0]] if orbital is not None else None
    except ValueError:  # the extractor's ImageError and input checks
        return "undecodable_image"
    try:
        writer.add(descriptors, frame.steering, frame.throttle, frame.stamp_ns, source, frame.state, frame.intervention,
                   orbital=states, groups=frame_groups)
    except ValueError:
        return "invalid_descriptors_or_label"
    return None


def extraction_settings_from_args(args):
    """--backbone, --model-path, --device, --precision over --extractor-config over config/extraction.yaml."""
    from sps_driving.export.extractors import extraction_settings

    options = {key: getattr(args, key) for key in ("backbone", "model_path", "device", "precision")}
    return extraction_settings(options, config_file=args.extractor_config, parameter_source="option")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="bags (rosbag2 folders, .mcap or .db3 files) and/or image folders with labels.csv")
    parser.add_argument("--out", required=True, help="feature cache directory to create")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing cache at --out")
    parser.add_argument("--config", default=str(TRAIN_CONFIG), help="YAML with an `extract:` section (topics, tolerance)")
    parser.add_argument("--extractor-config", help="YAML extractor config passed to the backbone loader")
    parser.add_argument("--backbone", help="backbone name (overrides the extractor config)")
    parser.add_argument("--model-path", help="local weights for the backbone (overrides the extractor config)")
    parser.add_argument("--device", help="cpu, cuda, ... (overrides the extractor config)")
    parser.add_argument("--precision", choices=("fp32", "int8"),
                        help="int8: onnxruntime's int8 graph (overrides the extractor config; the cache records it)")
    parser.add_argument("--camera-topic", help="camera topic in bags (default from --config)")
    parser.add_argument("--command-topic", help="reference command topic in bags (default from --config)")
    parser.add_argument("--labels", choices=LABEL_SOURCES, dest="label_source",
                        help="where bag labels come from: the reference command, the car's PACMod 3 reports, or auto "
                             "(the first the bag has; default from --config)")
    parser.add_argument("--params", type=Path, help="graph parameters file with the car's steering_ratio (default: config/graph.yaml)")
    parser.add_argument("--keep-rate", type=float, metavar="R",
                        help="token dropping (tokens kept) only: each frame's patches in groups of k = ceil(R N), each computed "
                             "in one pass, for policies trained at selection rate R (sps, spps)")
    parser.add_argument("--selection-seed", type=int, default=0,
                        help="--keep-rate: the selection seed whose draw at each frame's stamp splits the patches (default 0)")
    parser.add_argument("--orbital-every", type=int, default=0, metavar="K",
                        help="also store the visible orbital states of every K-th written frame of each unit (DINOv2; for "
                             "`train --orbital-fraction`; about 16x a frame's descriptors each); 0: none (default)")


def _settings_from_args(args) -> ExtractSettings:
    """The `extract:` settings of --config, with the topics and label source the options give over them."""
    from dataclasses import replace

    settings = ExtractSettings.from_yaml(args.config)
    if args.camera_topic:
        settings = replace(settings, camera_topic=args.camera_topic)
    if args.command_topic:
        settings = replace(settings, command_topic=args.command_topic)
    if args.label_source:
        settings = replace(settings, label_source=args.label_source)
    return settings


def _print_summary(out, report: dict, written: int, extractor, procs: Processes) -> None:
    """What the cache at `out` holds and, input by input, what was written and dropped and where
    its labels came from (handovers and interventions for the car's)."""
    print(f"feature cache {out}: {written} frames from {len(report)} input(s), backbone {extractor.name}, "
          f"grid {extractor.grid.rows}x{extractor.grid.cols}, D={extractor.dim}"
          + (f", by {procs.world_size} processes" if procs.world_size > 1 else ""))
    labels = json.loads((Path(out) / META_FILE).read_text())["labels"]
    for source, counts in report.items():
        dropped = {k: v for k, v in counts.items() if not k.startswith("written")}
        unknown = {k[len("written_without_"):]: v for k, v in counts.items() if k.startswith("written_without_")}
        print(f"  {source}: {counts.get('written', 0)} written" + (f", dropped {dropped}" if dropped else "")
              + (f", of them without state {unknown}" if unknown else ""))
        print(f"    labels from {labels[source]['from']}" + (f" (the bag also has {labels[source]['also_in_bag']})"
                                                             if "also_in_bag" in labels[source] else ""))
        if "handovers" in labels[source]:
            guard = labels[source]["rules"]["handover_guard_s"]
            print("    handovers: " + ", ".join(f"{kind} {n}" for kind, n in labels[source]["handovers"].items())
                  + "; dropped " + ", ".join(f"near_{kind} {counts.get(f'near_{kind}', 0)}" for kind in HANDOVERS)
                  + f" (within {guard:g} s), across_handover {counts.get('across_handover', 0)}")
        if "interventions" in labels[source]:
            print(f"    safety-driver interventions: {len(labels[source]['interventions'])}, "
                  f"{counts.get('written_intervention', 0)} frames written from the "
                  f"{labels[source]['rules']['intervention_window_s']:g} s after them")


def run(args) -> int:
    from dataclasses import replace

    from sps_driving.export.extractors import open_extractor

    procs = None
    try:
        settings = _settings_from_args(args)
        check_inputs([Path(p) for p in args.inputs], settings)  # before the slow backbone load
        if args.orbital_every < 0:
            raise ValueError(f"--orbital-every must be 0 (none) or a positive frame interval, got {args.orbital_every}")
        extraction = extraction_settings_from_args(args)
        # Under torchrun each process runs on a device of its own (cuda:LOCAL_RANK); the cache records the
        # setting. A config without one (pixels: the CPU; BLIP-2: its default, auto) reads as auto.
        procs = start_processes(extraction.config.get("device", "auto"))
        if procs.main:
            for warning in extraction.warnings:
                print(f"warning: {warning}", file=sys.stderr)
        opened = open_extractor(replace(extraction, config={**extraction.config, "device": str(procs.device)}))
        extractor = opened.extractor
        print(opened.describe()) if procs.main else procs.log(opened.describe())
        groups = None
        if args.keep_rate is not None:
            from sps_driving.core.selection import PatchSelector, SelectionConfig

            groups = PatchSelector(SelectionConfig("sps", args.keep_rate, args.selection_seed), extractor.grid)
        report = extract(args.inputs, args.out, extractor, extraction.config, settings, args.overwrite, args.params, procs,
                         args.orbital_every, groups)
    except (OSError, ValueError) as error:  # bad settings or inputs, missing weights, existing output, disagreeing processes
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if procs is not None:
            procs.close()
    written = sum(c.get("written", 0) for c in report.values())
    if not procs.main:
        return 0 if written else 1
    _print_summary(args.out, report, written, extractor, procs)
    return 0 if written else 1
