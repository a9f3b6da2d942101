"""One reading of a bag: a drive of typed time series, its engagement history, its stops and notes,
and its camera frames read lazily. `replay`, `extract`, `interventions` and `analyze` read bags
through it, so a new bag shape or topic is learned here.

`read_drive` makes one pass over the bag's small topics (everything but the camera, the selection
masks and the descriptors) and keeps, by log time:
- `series[topic]`: each report, state and command topic as numbers per message (`Series`: log
  times, header stamps, values): a PACMod 3 report's `output`, a speed (NaN where the report says
  invalid), a command's steering and throttle;
- `engagement`: who drove when (sps_driving.ros.engagement, core.monitor.AutonomyLog), when the
  bag records it;
- `stops`: each onset of a stop while the stack drove: the safety monitor's and the failsafe's stop
  requests, the vehicle interface's controlled stop with its reasons; `failures`: the safety
  monitor's failure onsets; `notes`: the safety driver's notes (topics.DRIVER_NOTE);
- `camera` (`CameraFrames`): the camera topic, raw sensor_msgs/Image or JPEG
  sensor_msgs/CompressedImage, whose frames are read only when asked for (all in order, or the
  ones at given times), and the kept patches of a frame where the selection or the descriptors
  were recorded.
A bag damaged part-way is read up to the damage: `complete` is false and `problems` says where.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sps_driving.core import topics
from sps_driving.core.image import ImageError
from sps_driving.core.jpeg import decode_compressed
from sps_driving.core.monitor import AutonomyLog
from sps_driving.ros import bagio, msgs
from sps_driving.ros.engagement import SYSTEM_RPT_FLOAT, SYSTEM_RPT_INT, EngagementReader

IMAGE = "sensor_msgs/msg/Image"
COMPRESSED_IMAGE = "sensor_msgs/msg/CompressedImage"
CAMERA_TYPES = {topics.IMAGE: IMAGE, topics.IMAGE_COMPRESSED: COMPRESSED_IMAGE}  # the first recorded is the camera
STRING = "std_msgs/msg/String"
DIAGNOSTICS = "diagnostic_msgs/msg/DiagnosticArray"
VEHICLE_INTERFACE = "vehicle_interface"  # its status's name on /diagnostics
# Topics read for their values, by message type: what a message gives (a tuple of floats, or None to skip it).
SPEED_TYPES = ("geometry_msgs/msg/TwistStamped", "pacmod3_msgs/msg/VehicleSpeedRpt")
COMMAND_TYPE = "sensor_msgs/msg/JointState"
# Kept patches per frame: the selection mask (small) first, else the descriptors.
KEPT_TOPICS = ((topics.SELECTION, IMAGE), (topics.DESCRIPTORS, "sensor_msgs/msg/PointCloud2"))
STOP_TOPICS = {topics.SAFETY_STOP: "safety_monitor", topics.FAILSAFE_STATUS: "failsafe"}


def _values(msgtype: str, msg) -> tuple[float, ...] | None:
    if msgtype in (SYSTEM_RPT_FLOAT, SYSTEM_RPT_INT):
        return (float(msg.output),)
    if msgtype in SPEED_TYPES:
        speed = msgs.speed_from_message(msg)
        return (math.nan if speed is None else speed,)
    if msgtype == COMMAND_TYPE:
        try:
            return msgs.command_from_message(msg)
        except msgs.MessageError:
            return None
    return None


def is_series_type(msgtype: str) -> bool:
    return msgtype in (SYSTEM_RPT_FLOAT, SYSTEM_RPT_INT, COMMAND_TYPE, *SPEED_TYPES)


@dataclass(frozen=True)
class Series:
    """A topic's numbers: per message its log time and header stamp (ns, int64) and values (float64
    [n, k]: a report's output, a speed, a command's steering and throttle), in log-time order."""

    log_ns: np.ndarray
    stamp_ns: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.log_ns)

    def by_stamp(self, column: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(sorted stamps, the column's values in that order)."""
        order = np.argsort(self.stamp_ns, kind="stable")
        return self.stamp_ns[order], self.values[order, column]


@dataclass(frozen=True)
class StopEvent:
    time_ns: int  # log time of the onset
    source: str  # "safety_monitor", "failsafe" or "vehicle_interface"
    reasons: tuple[str, ...]  # the stop request's reason, or the vehicle interface's stop reasons


@dataclass(frozen=True)
class Note:
    time_ns: int
    text: str


@dataclass(frozen=True)
class Frame:
    log_ns: int
    stamp_ns: int
    msgtype: str
    msg: object

    def rgb(self) -> np.ndarray:
        """uint8 [H, W, 3]; ImageError when the frame cannot be decoded."""
        return decode_frame(self.msgtype, self.msg)


def decode_frame(msgtype: str, msg) -> np.ndarray:
    """RGB pixels of a camera message, raw (sensor_msgs/Image) or compressed (CompressedImage)."""
    if msgtype == COMPRESSED_IMAGE:
        return decode_compressed(msg.data, msg.format)
    return msgs.image_to_rgb(msg)


def as_raw_image(item: bagio.BagMessage) -> bagio.BagMessage | None:
    """A camera message as the camera driver sends it (sensor_msgs/Image rgb8): a compressed frame
    decoded, a raw one as it is; None for a compressed frame that cannot be decoded."""
    if item.msgtype != COMPRESSED_IMAGE:
        return item
    try:
        rgb = decode_compressed(item.msg.data, item.msg.format)
    except ImageError:
        return None
    image = bagio.to_bag(msgs.image_fields(rgb, msgs.stamp_ns(item.msg.header), item.msg.header.frame_id))
    return bagio.BagMessage(item.topic, IMAGE, item.log_time_ns, image)


class CameraFrames:
    """A bag's camera topic, read when asked: every frame in order, or the frames at given times."""

    def __init__(self, path: Path, topic: str, msgtype: str, count: int, kept_topic: tuple[str, str] | None):
        self.path, self.topic, self.msgtype, self.count = path, topic, msgtype, count
        self.kept_topic = kept_topic  # (topic, type) where the kept patches were recorded, or None

    def __iter__(self) -> Iterator[Frame]:
        return self.frames()

    def frames(self, first: int = 0, stop: int | None = None) -> Iterator[Frame]:
        """Frames first..stop-1 in log-time order (the ones before are not deserialized)."""
        for item in bagio.read_messages(self.path, [self.topic], first, stop):
            yield Frame(item.log_time_ns, msgs.stamp_ns(item.msg.header), item.msgtype, item.msg)

    def at(self, times_ns: list[int], search_ns: int) -> list[Frame | None]:
        """For each time, the last frame logged at or before it and at most `search_ns` earlier
        (None where there is none); only those frames are read from the bag."""
        out = []
        for t in times_ns:
            window = list(bagio.read_messages(self.path, [self.topic], start_ns=t - search_ns, stop_ns=t + 1))
            item = window[-1] if window else None
            out.append(None if item is None else Frame(item.log_time_ns, msgs.stamp_ns(item.msg.header), item.msgtype, item.msg))
        return out

    def kept_patches(self, frame: Frame, search_ns: int) -> tuple[np.ndarray, tuple[int, int] | None] | None:
        """(kept patch indices, grid (rows, cols) or None where the descriptors do not say) of the
        frame, from the recorded selection or descriptors with its stamp logged within `search_ns`
        after it; None when they were not recorded for it."""
        if self.kept_topic is None:
            return None
        topic, _ = self.kept_topic
        for item in bagio.read_messages(self.path, [topic], start_ns=frame.log_ns - search_ns, stop_ns=frame.log_ns + search_ns):
            if msgs.stamp_ns(item.msg.header) != frame.stamp_ns:
                continue
            try:
                if topic == topics.SELECTION:
                    return msgs.selection_from_message(item.msg)
                return msgs.descriptors_from_message(item.msg)[1], None
            except msgs.MessageError:
                return None
        return None


@dataclass
class Drive:
    path: Path
    name: str
    topics: dict[str, str]  # {topic: message type} of the bag
    counts: dict[str, int] = field(default_factory=dict)  # {topic: messages the bag's index holds}
    series: dict[str, Series] = field(default_factory=dict)
    engagement: AutonomyLog | None = None
    engagement_sources: dict[str, str] = field(default_factory=dict)  # {topic: role} it was read from
    stops: list[StopEvent] = field(default_factory=list)
    failures: list[tuple[int, str]] = field(default_factory=list)  # (log time, failure kind) of the safety monitor
    notes: list[Note] = field(default_factory=list)
    handovers: list[int] = field(default_factory=list)  # log times of the safety monitor's handover requests
    camera: CameraFrames | None = None
    start_ns: int | None = None  # first and last log time read
    end_ns: int | None = None
    messages_read: int = 0
    complete: bool = True  # the whole bag was read
    problems: list[str] = field(default_factory=list)  # what could not be read, and why

    @property
    def speed(self) -> Series | None:
        """The speed (m/s): the twist when recorded (as the engagement history takes it), else the PACMod report."""
        return self.series.get(topics.VEHICLE_TWIST) or self.series.get(topics.PACMOD_SPEED_RPT)

    def duration_s(self) -> float:
        return 0.0 if self.start_ns is None else (self.end_ns - self.start_ns) * 1e-9


class _SeriesBuilder:
    """A topic's numbers as they are read, in typed arrays (8 bytes a number: an hour's drive is
    millions of them)."""

    def __init__(self, width: int):
        self.width = width
        self.log, self.stamp, self.values = array("q"), array("q"), array("d")

    def add(self, log_ns: int, stamp_ns: int, values: tuple[float, ...]) -> None:
        self.log.append(log_ns)
        self.stamp.append(stamp_ns)
        self.values.extend(values)

    def build(self) -> Series:
        return Series(np.frombuffer(self.log, np.int64), np.frombuffer(self.stamp, np.int64),
                      np.frombuffer(self.values, np.float64).reshape(-1, self.width))


class _StopTracker:
    """Onsets of stops: a source's stop going from off to on."""

    def __init__(self):
        self.active: dict[str, bool] = {}
        self.events: list[StopEvent] = []

    def update(self, time_ns: int, source: str, stopping: bool, reasons: tuple[str, ...]) -> None:
        if stopping and not self.active.get(source, False):
            self.events.append(StopEvent(time_ns, source, reasons))
        self.active[source] = stopping


def camera_topic_of(types: dict[str, str], camera_topic: str | None = None) -> str | None:
    """The camera topic of a bag: `camera_topic` when given (raw, or compressed on its /compressed,
    as `record` keeps a vendor camera too), else the raw camera, else the compressed one; None when
    it has none."""
    if camera_topic is not None:
        return next((t for t, msgtype in ((camera_topic, IMAGE), (camera_topic, COMPRESSED_IMAGE),
                                         (f"{camera_topic}/compressed", COMPRESSED_IMAGE)) if types.get(t) == msgtype), None)
    return next((t for t, msgtype in CAMERA_TYPES.items() if types.get(t) == msgtype), None)


def read_drive(path: str | Path, camera_topic: str | None = None) -> Drive:
    """The drive a bag records (module docstring). BagError when it is no bag or cannot be opened;
    a bag damaged part-way gives what was read before the damage."""
    path = Path(path)
    with bagio.open_bag(path) as reader:
        types = {conn.topic: conn.msgtype for conn in reader.connections}
        counts: dict[str, int] = {}
        for conn in reader.connections:
            counts[conn.topic] = counts.get(conn.topic, 0) + conn.msgcount
    drive = Drive(path, bagio.bag_name(path), types, counts)
    camera = camera_topic_of(types, camera_topic)
    if camera is not None:
        kept = next(((t, m) for t, m in KEPT_TOPICS if types.get(t) == m), None)
        drive.camera = CameraFrames(path, camera, types[camera], counts.get(camera, 0), kept)
    engagement = EngagementReader(types)
    wanted = {t for t, m in types.items() if is_series_type(m)} | set(engagement.roles)
    wanted |= {t for t in STOP_TOPICS if types.get(t) == DIAGNOSTICS}
    wanted |= {t for t in (topics.DIAGNOSTICS, topics.SAFETY_EVENTS, topics.HANDOVER_EVENTS) if types.get(t) == DIAGNOSTICS}
    wanted |= {topics.DRIVER_NOTE} if types.get(topics.DRIVER_NOTE) == STRING else set()
    builders: dict[str, _SeriesBuilder] = {}
    stops = _StopTracker()
    try:
        for item in bagio.read_messages(path, sorted(wanted)):
            _take(drive, item, engagement, builders, stops)
    except bagio.BagError as error:  # damaged part-way: what came before is the drive
        drive.complete = False
        drive.problems.append(str(error))
    drive.series = {topic: builder.build() for topic, builder in builders.items()}
    drive.stops = stops.events
    if engagement.has_reports:
        drive.engagement, drive.engagement_sources = engagement.finish(), engagement.roles
    return drive


def _take(drive: Drive, item: bagio.BagMessage, engagement: EngagementReader, builders: dict, stops: _StopTracker) -> None:
    """One message of the pass into the drive."""
    t, msg = item.log_time_ns, item.msg
    drive.messages_read += 1
    drive.start_ns = t if drive.start_ns is None else drive.start_ns
    drive.end_ns = t
    if item.topic in engagement.roles:
        engagement.feed(item.topic, t, msg)
    if is_series_type(item.msgtype):
        values = _values(item.msgtype, msg)
        if values is not None:
            builders.setdefault(item.topic, _SeriesBuilder(len(values))).add(t, msgs.stamp_ns(msg.header), values)
    elif item.topic in STOP_TOPICS:
        try:
            request = msgs.stop_request_from_message(msg)
        except msgs.MessageError:
            return
        stops.update(t, STOP_TOPICS[item.topic], request.stop, (request.reason,) if request.reason else ())
    elif item.topic == topics.SAFETY_EVENTS:
        drive.failures += [(t, values.get("failure", message)) for _, _, message, values in msgs.diagnostic_values(msg)]
    elif item.topic == topics.DIAGNOSTICS:
        status = msgs.status_named(msg, VEHICLE_INTERFACE)
        if status is not None and "stop_reasons" in status[2]:
            values = status[2]
            reasons = tuple(r for r in values["stop_reasons"].split(",") if r and r != "disengaged")
            stops.update(t, VEHICLE_INTERFACE, values.get("engagement") == "engaged" and bool(reasons), reasons)
    elif item.topic == topics.HANDOVER_EVENTS:
        drive.handovers += [t for _, _, message, _ in msgs.diagnostic_values(msg) if message == topics.HANDOVER_EVENT]
    elif item.topic == topics.DRIVER_NOTE:
        drive.notes.append(Note(t, str(msg.data)))


def camera_frames(path: Path, camera_topic: str | None = None) -> CameraFrames:
    """The camera frames of a bag, or a ValueError that names the topics a camera is looked for on."""
    drive_types = bagio.topic_types(path)
    topic = camera_topic_of(drive_types, camera_topic)
    if topic is None:
        wanted = camera_topic or " or ".join(CAMERA_TYPES)
        raise ValueError(f"no camera frames on {wanted} in the bag {path} (its topics: {', '.join(sorted(drive_types))})")
    return CameraFrames(path, topic, drive_types[topic], bagio.message_count(path, topic), None)


def decoded(frames: Iterator[Frame], where: Path, stride: int = 1) -> Iterator[tuple[Frame, np.ndarray]]:
    """(frame, RGB) of every `stride`-th frame; a frame that cannot be decoded is dropped with a
    warning that counts them, and a bag damaged part-way ends the frames there, with a warning."""
    dropped = 0
    try:
        for index, frame in enumerate(frames):
            if index % stride:
                continue
            try:
                yield frame, frame.rgb()
            except ImageError as error:
                dropped += 1
                print(f"warning: {where}: dropped frame at {frame.log_ns} ns: {error} ({dropped} dropped)", file=sys.stderr)
    except bagio.BagError as error:
        print(f"warning: {error}; its frames from there on are left out", file=sys.stderr)
