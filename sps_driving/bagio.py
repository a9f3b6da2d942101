"""rosbag2 reading and writing without a ROS installation, through `rosbags`.

Bags recorded on the car (Humble or newer) and bags written by the simulator use the same
topics (sps_driving.topics) and are read by the same code. A bag's own stored message definitions
decide how its messages decode, so a bag recorded with another layout of a type decodes as
recorded; types a bag stores no definition for (rosbag2 sqlite3 on Humble stores none) decode with
ours: the ROS 2 distro's standard messages and the PACMod 3 messages of interfaces/pacmod3_msgs.
Writers always use ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from rosbags.interfaces import MessageDefinitionFormat
from rosbags.rosbag2 import Reader, StoragePlugin, Writer
from rosbags.typesys import Stores, get_types_from_msg, get_typestore

from sps_driving.core.image import from_rgb
from sps_driving.resources import package_path
from sps_driving.topics import COMMAND_NAMES

# PACMod 3 messages (astuff/pacmod3_msgs, ROS 2): the same .msg files the pacmod3_msgs interface
# package is built from where no ROS distro provides it.
PACMOD3_MSG_DIR = package_path("interfaces/pacmod3_msgs/msg")


def pacmod3_definitions() -> dict[str, str]:
    """{"pacmod3_msgs/msg/Name": .msg text} of every PACMod 3 message we know."""
    paths = sorted(PACMOD3_MSG_DIR.glob("*.msg"))
    if not paths:
        raise FileNotFoundError(f"no PACMod 3 message definitions in {PACMOD3_MSG_DIR}")
    return {f"pacmod3_msgs/msg/{path.stem}": path.read_text() for path in paths}


def _make_typestore():
    store = get_typestore(Stores.ROS2_HUMBLE)
    for name, text in pacmod3_definitions().items():
        store.register(get_types_from_msg(text, name))
    return store


TYPESTORE = _make_typestore()
STORAGES = {"sqlite3": StoragePlugin.SQLITE3, "mcap": StoragePlugin.MCAP}


@dataclass(frozen=True)
class BagMessage:
    topic: str
    msgtype: str
    log_time_ns: int
    msg: object


def bag_typestore(connections):
    """Our types, overridden by every definition (.msg format) the bag stores for `connections`."""
    stored = {}
    for conn in connections:
        if conn.msgdef.format == MessageDefinitionFormat.MSG and conn.msgdef.data:
            stored.update(get_types_from_msg(conn.msgdef.data, conn.msgtype))
    if not stored:
        return TYPESTORE
    store = get_typestore(Stores.EMPTY)
    store.register({**TYPESTORE.fielddefs, **stored})
    return store


def topic_types(path: str | Path) -> dict[str, str]:
    with Reader(Path(path)) as reader:
        return {conn.topic: conn.msgtype for conn in reader.connections}


def read_messages(path: str | Path, topics: Iterable[str] | None = None) -> Iterator[BagMessage]:
    """Deserialized messages in log-time order; `topics` limits which are read."""
    with Reader(Path(path)) as reader:
        wanted = set(topics) if topics is not None else None
        connections = [c for c in reader.connections if wanted is None or c.topic in wanted]
        store = bag_typestore(connections)
        for conn, log_time, raw in reader.messages(connections=connections):
            yield BagMessage(conn.topic, conn.msgtype, log_time, store.deserialize_cdr(raw, conn.msgtype))


class BagWriter:
    """Write rosbag2 (sqlite3 or mcap); a topic's connection is created on its first message."""

    def __init__(self, path: str | Path, storage: str = "sqlite3"):
        if storage not in STORAGES:
            raise ValueError(f"unknown bag storage {storage!r}; expected one of {sorted(STORAGES)}")
        self._writer = Writer(Path(path), version=9, storage_plugin=STORAGES[storage])
        self._connections: dict[str, object] = {}

    def __enter__(self) -> "BagWriter":
        self._writer.open()
        return self

    def __exit__(self, *exc) -> None:
        self._writer.close()

    def write(self, topic: str, msg, log_time_ns: int) -> None:
        conn = self._connections.get(topic)
        if conn is None:
            conn = self._writer.add_connection(topic, msg.__msgtype__, typestore=TYPESTORE)
            self._connections[topic] = conn
        self._writer.write(conn, int(log_time_ns), TYPESTORE.serialize_cdr(msg, msg.__msgtype__))


def stamp_ns(header) -> int:
    return int(header.stamp.sec) * 1_000_000_000 + int(header.stamp.nanosec)


def header(stamp: int, frame_id: str = ""):
    t = TYPESTORE.types
    sec, nanosec = divmod(int(stamp), 1_000_000_000)
    return t["std_msgs/msg/Header"](stamp=t["builtin_interfaces/msg/Time"](sec=sec, nanosec=nanosec), frame_id=frame_id)


def image_message(rgb: np.ndarray, stamp: int, frame_id: str = "camera", encoding: str = "rgb8"):
    data, step = from_rgb(rgb, encoding)
    return TYPESTORE.types["sensor_msgs/msg/Image"](
        header=header(stamp, frame_id),
        height=rgb.shape[0],
        width=rgb.shape[1],
        encoding=encoding,
        is_bigendian=0,
        step=step,
        data=np.frombuffer(data, dtype=np.uint8),
    )


def camera_info_message(height: int, width: int, stamp: int, frame_id: str = "camera", hfov_rad: float | None = None):
    """Pinhole intrinsics from the horizontal field of view (all zeros when unknown, as ROS allows)."""
    t = TYPESTORE.types
    if hfov_rad is None:
        k = np.zeros(9)
    else:
        f = (width / 2.0) / math.tan(hfov_rad / 2.0)
        k = np.array([f, 0.0, width / 2.0, 0.0, f, height / 2.0, 0.0, 0.0, 1.0])
    p = np.zeros(12)
    p[[0, 1, 2, 4, 5, 6, 10]] = k[[0, 1, 2, 3, 4, 5, 8]]
    return t["sensor_msgs/msg/CameraInfo"](
        header=header(stamp, frame_id),
        height=height,
        width=width,
        distortion_model="plumb_bob",
        d=np.zeros(5),
        k=k,
        r=np.eye(3).ravel(),
        p=p,
        binning_x=0,
        binning_y=0,
        roi=t["sensor_msgs/msg/RegionOfInterest"](x_offset=0, y_offset=0, height=0, width=0, do_rectify=False),
    )


def command_message(steering: float, throttle: float, stamp: int, frame_id: str = "base_link"):
    return TYPESTORE.types["sensor_msgs/msg/JointState"](
        header=header(stamp, frame_id),
        name=list(COMMAND_NAMES),
        position=np.array([steering, throttle], dtype=np.float64),
        velocity=np.zeros(0),
        effort=np.zeros(0),
    )


def lane_pose_message(lateral_offset_m: float, heading_error_rad: float, stamp: int):
    t = TYPESTORE.types
    pose = t["geometry_msgs/msg/Pose"](
        position=t["geometry_msgs/msg/Point"](x=0.0, y=float(lateral_offset_m), z=0.0),
        orientation=t["geometry_msgs/msg/Quaternion"](
            x=0.0, y=0.0, z=math.sin(heading_error_rad / 2.0), w=math.cos(heading_error_rad / 2.0)
        ),
    )
    return t["geometry_msgs/msg/PoseStamped"](header=header(stamp, "lane"), pose=pose)


def range_message(gap_m: float, stamp: int, max_range_m: float = 100.0):
    """Nearest-obstacle free gap; no obstacle in sight is reported as +inf, as REP 117 asks."""
    return TYPESTORE.types["sensor_msgs/msg/Range"](
        header=header(stamp, "base_link"),
        radiation_type=1,  # INFRARED: Range has no constant for fused or ground-truth sources
        field_of_view=math.pi,
        min_range=0.0,
        max_range=float(max_range_m),
        range=float(gap_m),
    )


def twist_message(speed_mps: float, stamp: int):
    t = TYPESTORE.types
    zero = t["geometry_msgs/msg/Vector3"](x=0.0, y=0.0, z=0.0)
    twist = t["geometry_msgs/msg/Twist"](linear=t["geometry_msgs/msg/Vector3"](x=float(speed_mps), y=0.0, z=0.0), angular=zero)
    return t["geometry_msgs/msg/TwistStamped"](header=header(stamp, "base_link"), twist=twist)
