"""Message conversion and QoS profiles for the live graph: the one place that knows message layouts.

Decoders (`*_from_message`, `stamp_ns`) read fields only, so they take rclpy messages and rosbags
messages alike: nodes, the replay report and tests share them, and this module imports no ROS
package at load time (encoders and QoS import rclpy's types when called).

Message choices (standard types only):
- commands: sensor_msgs/JointState, name = ("steering", "throttle"), position = values.
- selection: sensor_msgs/Image "mono8", H' x W' patch grid, 255 = patch computed, 0 = dropped.
- descriptors: sensor_msgs/PointCloud2, one point per computed patch, height 1, width k, fields
  `index` (UINT32, offset 0, the row-major patch index) and `descriptor` (FLOAT32, count D,
  offset 4), little-endian, point_step 4 + 4 D. Exact float32 round trip; `is_dense` is False
  when any value is non-finite.
- every message carries the header stamp of the camera frame it was computed from.

QoS, per topic kind:
- "image": camera images. Reliable, keep last 3: a 1.7 MB frame is many DDS fragments and best
  effort loses whole frames to one lost fragment under load (seen on loopback here); keep-last
  never blocks the writer, and 3 lets the extractor's callback see (and count) each frame it
  skips rather than DDS dropping them silently. image_transport publishers are reliable by default.
- "sensor": camera info, lane state and obstacle range in. Best effort, keep last 1: a late sample
  is useless, and a best-effort reader accepts reliable and best-effort writers.
- "selection": reliable, keep last 30 (1 s at 30 fps): the extractor matches decisions to frames
  by stamp and must not lose one that belongs to a frame it still holds.
- "stream": descriptors and commands. Reliable, keep last 1: a consumer only ever wants the newest.
- "control": vehicle output, stop requests, engage requests. Reliable, keep last 10.
- "status": diagnostics and timing. Reliable, keep last 100, so a recorder loses nothing.
"""

from __future__ import annotations

import importlib
import math
import re

import numpy as np

from sps_driving.core.image import ImageError, to_rgb
from sps_driving.topics import COMMAND_NAMES

_INDEX_FIELD = "index"
_DESCRIPTOR_FIELD = "descriptor"
_UINT32 = 6  # sensor_msgs/PointField.UINT32
_FLOAT32 = 7  # sensor_msgs/PointField.FLOAT32


class MessageError(ValueError):
    """A message that does not have the documented layout: callers drop and count it."""


# ---------------------------------------------------------------- stamps


def stamp_ns(header) -> int:
    return int(header.stamp.sec) * 1_000_000_000 + int(header.stamp.nanosec)


def ros_time(ns: int):
    from builtin_interfaces.msg import Time

    sec, nanosec = divmod(int(ns), 1_000_000_000)
    return Time(sec=sec, nanosec=nanosec)


def header(stamp: int, frame_id: str):
    from std_msgs.msg import Header

    return Header(stamp=ros_time(stamp), frame_id=frame_id)


# ---------------------------------------------------------------- QoS

QOS_DEPTHS = {"image": 3, "sensor": 1, "selection": 30, "stream": 1, "control": 10, "status": 100}


def qos(kind: str):
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy

    if kind not in QOS_DEPTHS:
        raise ValueError(f"unknown QoS kind {kind!r}; expected one of {sorted(QOS_DEPTHS)}")
    reliability = ReliabilityPolicy.BEST_EFFORT if kind == "sensor" else ReliabilityPolicy.RELIABLE
    return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=QOS_DEPTHS[kind], reliability=reliability)


# ---------------------------------------------------------------- bag messages

_MESSAGE_TYPE = re.compile(r"([A-Za-z0-9_]+)/(?:msg/)?([A-Za-z0-9_]+)")


def ros_type(msgtype: str):
    """The rclpy class of "pkg/msg/Name" (or "pkg/Name")."""
    match = _MESSAGE_TYPE.fullmatch(msgtype)
    if match is None:
        raise ValueError(f"not a message type name: {msgtype!r}")
    return getattr(importlib.import_module(f"{match.group(1)}.msg"), match.group(2))


def from_bag(msg, cls):
    """A rosbags message as an rclpy message of class `cls`, copied field by field, so a bag
    recorded on another ROS distro plays here: a field the recording lacks keeps its default
    (e.g. Range.variance, added after Humble), a field this distro lacks is left out."""
    out = cls()
    for name, type_name in cls.get_fields_and_field_types().items():
        if not hasattr(msg, name):
            continue
        value = getattr(msg, name)
        default = getattr(out, name)
        if hasattr(default, "get_fields_and_field_types"):
            value = from_bag(value, type(default))
        elif "/" in type_name:  # a sequence or array of messages
            element = ros_type(_MESSAGE_TYPE.search(type_name).group(0))
            value = [from_bag(v, element) for v in value]
        elif isinstance(value, np.ndarray):
            value = value.tobytes() if value.dtype == np.uint8 else value.tolist()
        elif type_name == "octet" and isinstance(value, int):  # rosbags reads `byte` as int, rclpy wants bytes
            value = bytes([value])
        setattr(out, name, value)
    return out


# ---------------------------------------------------------------- images


def image_to_rgb(msg) -> np.ndarray:
    """uint8 [H, W, 3] RGB from a sensor_msgs/Image; raises ImageError on a bad frame."""
    if getattr(msg, "is_bigendian", 0) and msg.encoding not in ("rgb8", "bgr8", "rgba8", "bgra8", "mono8"):
        raise ImageError(f"big-endian {msg.encoding} images are not supported")
    return to_rgb(msg.data, msg.height, msg.width, msg.encoding, msg.step)


def rgb_to_image(rgb: np.ndarray, stamp: int, frame_id: str, encoding: str = "rgb8"):
    from sensor_msgs.msg import Image

    from sps_driving.core.image import from_rgb

    data, step = from_rgb(rgb, encoding)
    return Image(
        header=header(stamp, frame_id),
        height=int(rgb.shape[0]),
        width=int(rgb.shape[1]),
        encoding=encoding,
        is_bigendian=0,
        step=int(step),
        data=data,
    )


def camera_info(height: int, width: int, stamp: int, frame_id: str, hfov_rad: float):
    """Pinhole CameraInfo from the horizontal field of view (no distortion known)."""
    from sensor_msgs.msg import CameraInfo

    f = (width / 2.0) / math.tan(hfov_rad / 2.0)
    cx, cy = width / 2.0, height / 2.0
    return CameraInfo(
        header=header(stamp, frame_id),
        height=int(height),
        width=int(width),
        distortion_model="plumb_bob",
        d=[0.0] * 5,
        k=[f, 0.0, cx, 0.0, f, cy, 0.0, 0.0, 1.0],
        r=[1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0],
        p=[f, 0.0, cx, 0.0, 0.0, f, cy, 0.0, 0.0, 0.0, 1.0, 0.0],
    )


# ---------------------------------------------------------------- selection


def selection_message(indices: np.ndarray, rows: int, cols: int, stamp: int, frame_id: str):
    from sensor_msgs.msg import Image

    mask = np.zeros(rows * cols, dtype=np.uint8)
    mask[np.asarray(indices, dtype=np.int64)] = 255
    return Image(
        header=header(stamp, frame_id), height=rows, width=cols, encoding="mono8", is_bigendian=0, step=cols,
        data=mask.tobytes(),
    )


def selection_from_message(msg) -> tuple[np.ndarray, tuple[int, int]]:
    """(sorted int64 patch indices, (rows, cols)) from a selection mask."""
    if msg.encoding != "mono8":
        raise MessageError(f"selection mask must be mono8, got {msg.encoding!r}")
    try:
        mask = to_rgb(msg.data, msg.height, msg.width, "mono8", msg.step)[..., 0]
    except ImageError as exc:
        raise MessageError(f"bad selection mask: {exc}") from exc
    return np.flatnonzero(mask.ravel() > 0).astype(np.int64), (int(msg.height), int(msg.width))


# ---------------------------------------------------------------- descriptors


def descriptors_message(values: np.ndarray, indices: np.ndarray, stamp: int, frame_id: str):
    from sensor_msgs.msg import PointCloud2, PointField

    values = np.asarray(values, dtype=np.float32)
    indices = np.asarray(indices)
    if values.ndim != 2 or indices.shape != (values.shape[0],):
        raise MessageError(f"expected [k, D] descriptors and [k] indices, got {values.shape} and {indices.shape}")
    k, dim = values.shape
    records = np.empty(k, dtype=np.dtype([("index", "<u4"), ("descriptor", "<f4", (dim,))]))
    records["index"] = indices
    records["descriptor"] = values
    return PointCloud2(
        header=header(stamp, frame_id),
        height=1,
        width=k,
        fields=[
            PointField(name=_INDEX_FIELD, offset=0, datatype=_UINT32, count=1),
            PointField(name=_DESCRIPTOR_FIELD, offset=4, datatype=_FLOAT32, count=dim),
        ],
        is_bigendian=False,
        point_step=4 + 4 * dim,
        row_step=(4 + 4 * dim) * k,
        data=records.tobytes(),
        is_dense=bool(np.isfinite(values).all()),
    )


def descriptors_from_message(msg) -> tuple[np.ndarray, np.ndarray]:
    """(float32 [k, D] descriptors, int64 [k] patch indices); values may be non-finite (callers check)."""
    fields = {f.name: f for f in msg.fields}
    index, desc = fields.get(_INDEX_FIELD), fields.get(_DESCRIPTOR_FIELD)
    if (
        index is None
        or desc is None
        or (index.offset, index.datatype, index.count) != (0, _UINT32, 1)
        or (desc.offset, desc.datatype) != (4, _FLOAT32)
        or desc.count < 1
        or msg.is_bigendian
    ):
        raise MessageError("descriptor cloud must have fields index (UINT32 @0) and descriptor (FLOAT32 xD @4), little-endian")
    dim = int(desc.count)
    k = int(msg.width) * int(msg.height)
    if msg.point_step != 4 + 4 * dim or len(msg.data) != k * msg.point_step:
        raise MessageError(
            f"descriptor cloud of {k} points x {dim} values has {len(msg.data)} bytes, point_step {msg.point_step}"
        )
    records = np.frombuffer(memoryview(msg.data).cast("B"), dtype=np.dtype([("index", "<u4"), ("descriptor", "<f4", (dim,))]))
    return records["descriptor"].astype(np.float32), records["index"].astype(np.int64)


# ---------------------------------------------------------------- commands


def command_message(steering: float, throttle: float, stamp: int, frame_id: str = "base_link"):
    from sensor_msgs.msg import JointState

    return JointState(header=header(stamp, frame_id), name=list(COMMAND_NAMES), position=[float(steering), float(throttle)])


def command_from_message(msg) -> tuple[float, float]:
    """(steering, throttle) by joint name; values may be non-finite (the vehicle interface checks)."""
    names = list(msg.name)
    position = list(msg.position)
    if len(names) != len(position) or not all(n in names for n in COMMAND_NAMES):
        raise MessageError(f"command must name {COMMAND_NAMES} with one position each, got {names} / {len(position)}")
    return float(position[names.index(COMMAND_NAMES[0])]), float(position[names.index(COMMAND_NAMES[1])])


# ---------------------------------------------------------------- lane and obstacle state


def lane_from_message(msg) -> tuple[float, float]:
    """(lateral offset m, heading error rad) from a PoseStamped in the lane frame."""
    q = msg.pose.orientation
    yaw = math.atan2(2.0 * (q.w * q.z + q.x * q.y), 1.0 - 2.0 * (q.y * q.y + q.z * q.z))
    return float(msg.pose.position.y), yaw


# ---------------------------------------------------------------- diagnostics


def diagnostics(stamp: int, name: str, level: int, message: str, values: dict, hardware_id: str = ""):
    """A DiagnosticArray with one status; level: 0 OK, 1 WARN, 2 ERROR, 3 STALE."""
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

    status = DiagnosticStatus(
        level=bytes([level]), name=name, message=message, hardware_id=hardware_id,
        values=[KeyValue(key=str(k), value=str(v)) for k, v in values.items()],
    )
    return DiagnosticArray(header=header(stamp, ""), status=[status])


def diagnostic_values(msg) -> list[tuple[str, int, str, dict]]:
    """[(name, level, message, {key: value})] of a DiagnosticArray."""
    out = []
    for status in msg.status:
        level = status.level
        level = level[0] if isinstance(level, (bytes, bytearray)) else int(level)
        out.append((status.name, level, status.message, {kv.key: kv.value for kv in status.values}))
    return out
