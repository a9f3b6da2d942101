"""Message conversion and QoS profiles: the one place that knows message layouts.

Decoders (`*_from_message`, `stamp_ns`) read fields only, so they take rclpy messages and rosbags
messages alike: nodes, the replay report and tests share them, and this module imports no ROS
package at load time (encoders and QoS import rclpy's types when called).

Encoders of messages that both the live graph and bag files carry (stamps, headers, camera
images and their pinhole CameraInfo, commands, lane pose, obstacle range, speed) write a layout:
`Fields`, the field values in plain Python, nested messages as Fields. `to_ros` makes the rclpy
message of a layout (nodes publish it); `sps_driving.ros.bagio.to_bag` the rosbags message of the
same layout (bag files hold it), so neither side imports the other's ROS library. Messages only
the live graph sends (selection, descriptors, diagnostics, PACMod 3 commands) are built as rclpy
messages directly.

Message choices (standard types only):
- commands: sensor_msgs/JointState, name = ("steering", "throttle"), position = values.
- speeds (the car's, the cruise target): geometry_msgs/TwistStamped, linear.x in m/s; the car's
  also as the PACMod 3 VehicleSpeedRpt (`speed_from_message` reads both).
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
- "sensor": readers of camera info, lane state, obstacle range, speeds and drive-by-wire reports.
  REP 2003's sensor-data profile: best effort, keep last 5; a best-effort reader accepts reliable
  and best-effort writers.
- "sensor_out": writers of those (drivers, the simulator). REP 2003: reliable, keep last 5.
- "selection": reliable, keep last 30 (1 s at 30 fps): the extractor matches decisions to frames
  by stamp and must not lose one that belongs to a frame it still holds.
- "stream": descriptors and policy commands. Reliable, keep last 1: a consumer only ever wants the
  newest.
- "control": vehicle commands, stop requests, the failsafe's status. Reliable, keep last 1: only
  the newest command may ever act.
- "driver": the PACMod 3 driver's own profile for its command and report topics (reliable, keep
  last 20), used by the stand-in driver.
- "status": diagnostics and timing. Reliable, keep last 100, so a recorder loses nothing.
"""

from __future__ import annotations

import importlib
import math
import re
import socket
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from sps_driving.core.image import ImageError, from_rgb, to_rgb
from sps_driving.core.topics import COMMAND_NAMES

_INDEX_FIELD = "index"
_DESCRIPTOR_FIELD = "descriptor"
_UINT32 = 6  # sensor_msgs/PointField.UINT32
_FLOAT32 = 7  # sensor_msgs/PointField.FLOAT32


class MessageError(ValueError):
    """A message that does not have the documented layout: callers drop and count it."""


# ---------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Fields:
    """A message as its type ("pkg/msg/Name") and field values: nested messages as Fields, byte
    arrays as bytes, number arrays as lists; fields left out keep the message type's defaults."""

    msgtype: str
    values: dict


def to_ros(fields: Fields):
    """The rclpy message of a layout."""
    def value(v):
        if isinstance(v, Fields):
            return to_ros(v)
        if isinstance(v, list) and v and isinstance(v[0], Fields):
            return [to_ros(item) for item in v]
        return v

    return ros_type(fields.msgtype)(**{name: value(v) for name, v in fields.values.items()})


# ---------------------------------------------------------------- stamps


def stamp_ns(header) -> int:
    return int(header.stamp.sec) * 1_000_000_000 + int(header.stamp.nanosec)


def time_fields(ns: int) -> Fields:
    sec, nanosec = divmod(int(ns), 1_000_000_000)
    return Fields("builtin_interfaces/msg/Time", {"sec": sec, "nanosec": nanosec})


def header_fields(stamp: int, frame_id: str = "") -> Fields:
    return Fields("std_msgs/msg/Header", {"stamp": time_fields(stamp), "frame_id": frame_id})


def _header(stamp: int, frame_id: str):
    return to_ros(header_fields(stamp, frame_id))


# ---------------------------------------------------------------- QoS

QOS_DEPTHS = {
    "image": 3, "sensor": 5, "sensor_out": 5, "selection": 30, "stream": 1, "control": 1, "driver": 20, "status": 100,
}


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


def image_fields(rgb: np.ndarray, stamp: int, frame_id: str, encoding: str = "rgb8") -> Fields:
    """A sensor_msgs/Image of uint8 RGB [H, W, 3] pixels in `encoding` (core.image.from_rgb)."""
    data, step = from_rgb(rgb, encoding)
    return Fields("sensor_msgs/msg/Image", {
        "header": header_fields(stamp, frame_id), "height": int(rgb.shape[0]), "width": int(rgb.shape[1]),
        "encoding": encoding, "is_bigendian": 0, "step": int(step), "data": data,
    })


def camera_info_fields(height: int, width: int, stamp: int, frame_id: str, hfov_rad: float | None) -> Fields:
    """Pinhole CameraInfo from the horizontal field of view (no distortion known); intrinsics all
    zeros when the field of view is unknown (None), as ROS allows."""
    if hfov_rad is None:
        k, p = [0.0] * 9, [0.0] * 12
    else:
        f = (width / 2.0) / math.tan(hfov_rad / 2.0)
        cx, cy = width / 2.0, height / 2.0
        k = [f, 0.0, cx, 0.0, f, cy, 0.0, 0.0, 1.0]
        p = [f, 0.0, cx, 0.0, 0.0, f, cy, 0.0, 0.0, 0.0, 1.0, 0.0]
    return Fields("sensor_msgs/msg/CameraInfo", {
        "header": header_fields(stamp, frame_id), "height": int(height), "width": int(width),
        "distortion_model": "plumb_bob", "d": [0.0] * 5, "k": k, "r": [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0],
        "p": p,
    })


# ---------------------------------------------------------------- selection


def selection_message(indices: np.ndarray, rows: int, cols: int, stamp: int, frame_id: str):
    from sensor_msgs.msg import Image

    mask = np.zeros(rows * cols, dtype=np.uint8)
    mask[np.asarray(indices, dtype=np.int64)] = 255
    return Image(
        header=_header(stamp, frame_id), height=rows, width=cols, encoding="mono8", is_bigendian=0, step=cols,
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
        header=_header(stamp, frame_id),
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


def command_fields(steering: float, throttle: float, stamp: int, frame_id: str = "base_link") -> Fields:
    return Fields("sensor_msgs/msg/JointState", {
        "header": header_fields(stamp, frame_id), "name": list(COMMAND_NAMES), "position": [float(steering), float(throttle)],
    })


def command_from_message(msg) -> tuple[float, float]:
    """(steering, throttle) by joint name; values may be non-finite (the vehicle interface checks)."""
    names = list(msg.name)
    position = list(msg.position)
    if len(names) != len(position) or not all(n in names for n in COMMAND_NAMES):
        raise MessageError(f"command must name {COMMAND_NAMES} with one position each, got {names} / {len(position)}")
    return float(position[names.index(COMMAND_NAMES[0])]), float(position[names.index(COMMAND_NAMES[1])])


# ---------------------------------------------------------------- lane and obstacle state


def lane_pose_fields(lateral_offset_m: float, heading_error_rad: float, stamp: int) -> Fields:
    """A PoseStamped in the lane frame: y the lateral offset (m, left positive), yaw the heading error (rad)."""
    pose = Fields("geometry_msgs/msg/Pose", {
        "position": Fields("geometry_msgs/msg/Point", {"x": 0.0, "y": float(lateral_offset_m), "z": 0.0}),
        "orientation": Fields("geometry_msgs/msg/Quaternion", {
            "x": 0.0, "y": 0.0, "z": math.sin(heading_error_rad / 2.0), "w": math.cos(heading_error_rad / 2.0)}),
    })
    return Fields("geometry_msgs/msg/PoseStamped", {"header": header_fields(stamp, "lane"), "pose": pose})


def range_fields(gap_m: float, stamp: int, max_range_m: float = 100.0) -> Fields:
    """Nearest-obstacle free gap in m; no obstacle in sight is reported as +inf, as REP 117 asks."""
    return Fields("sensor_msgs/msg/Range", {
        "header": header_fields(stamp, "base_link"),
        "radiation_type": 1,  # INFRARED: Range has no constant for fused or ground-truth sources
        "field_of_view": math.pi, "min_range": 0.0, "max_range": float(max_range_m), "range": float(gap_m),
    })


def twist_fields(speed_mps: float, stamp: int) -> Fields:
    """A forward speed in m/s as a TwistStamped in base_link: the car's speed (topics.VEHICLE_TWIST)
    or the cruise target speed (topics.TARGET_SPEED)."""
    def vector(x: float) -> Fields:
        return Fields("geometry_msgs/msg/Vector3", {"x": float(x), "y": 0.0, "z": 0.0})

    twist = Fields("geometry_msgs/msg/Twist", {"linear": vector(speed_mps), "angular": vector(0.0)})
    return Fields("geometry_msgs/msg/TwistStamped", {"header": header_fields(stamp, "base_link"), "twist": twist})


def speed_from_message(msg) -> float | None:
    """A forward speed in m/s from a TwistStamped (linear.x) or a PACMod 3 VehicleSpeedRpt
    (vehicle_speed); None when the report says it is not valid. May be non-finite (callers check)."""
    if hasattr(msg, "vehicle_speed"):
        return float(msg.vehicle_speed) if bool(msg.vehicle_speed_valid) else None
    if hasattr(msg, "twist"):
        return float(msg.twist.linear.x)
    raise MessageError(f"a speed is a TwistStamped or a VehicleSpeedRpt, not a {type(msg).__name__}")


def lane_from_message(msg) -> tuple[float, float]:
    """(lateral offset m, heading error rad) from a PoseStamped in the lane frame."""
    q = msg.pose.orientation
    yaw = math.atan2(2.0 * (q.w * q.z + q.x * q.y), 1.0 - 2.0 * (q.y * q.y + q.z * q.z))
    return float(msg.pose.position.y), yaw


# ---------------------------------------------------------------- diagnostics


class Level(IntEnum):
    """diagnostic_msgs/DiagnosticStatus levels."""

    OK = 0
    WARN = 1
    ERROR = 2
    STALE = 3


def diagnostics(stamp: int, name: str, level: int, message: str, values: dict, hardware_id: str | None = None):
    """A DiagnosticArray with one status (`level` a Level); `hardware_id` defaults to this machine's
    host name (the computer a software node runs on)."""
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

    status = DiagnosticStatus(
        level=bytes([int(level)]), name=name, message=message, hardware_id=hardware_id or socket.gethostname(),
        values=[KeyValue(key=str(k), value=str(v)) for k, v in values.items()],
    )
    return DiagnosticArray(header=_header(stamp, ""), status=[status])


def diagnostic_values(msg) -> list[tuple[str, int, str, dict]]:
    """[(name, level, message, {key: value})] of a DiagnosticArray."""
    out = []
    for status in msg.status:
        level = status.level
        level = level[0] if isinstance(level, (bytes, bytearray)) else int(level)
        out.append((status.name, level, status.message, {kv.key: kv.value for kv in status.values}))
    return out


def status_named(msg, name: str) -> tuple[int, str, dict] | None:
    """(level, message, values) of the status called `name` in a DiagnosticArray, or None."""
    for status_name, level, message, values in diagnostic_values(msg):
        if status_name == name:
            return level, message, values
    return None


# ---------------------------------------------------------------- stage reports
# Every stage of the perception graph (selection, extractor, policy) reports each frame on
# topics.STAGE_TIMING, stamped with the frame's stamp: one status named after the stage, level OK
# with its compute time ("compute_ms", ms) and counters when it passed the frame on, WARN with
# the message "dropped: <reason>" when it did not.

_DROPPED = "dropped: "


@dataclass(frozen=True)
class StageReport:
    stage: str
    dropped: bool
    reason: str  # why the frame was dropped ("" when it was not)
    compute_ms: float | None  # None for a drop
    values: dict  # the stage's counters


def stage_timing_message(stamp: int, stage: str, compute_ms: float, counters: dict):
    return diagnostics(stamp, stage, Level.OK, "", {"compute_ms": f"{compute_ms:.3f}", **counters})


def stage_drop_message(stamp: int, stage: str, reason: str, counters: dict):
    return diagnostics(stamp, stage, Level.WARN, _DROPPED + reason, dict(counters))


def stage_reports(msg) -> list[StageReport]:
    """The stage reports of a DiagnosticArray on topics.STAGE_TIMING (rclpy or rosbags)."""
    reports = []
    for stage, level, message, values in diagnostic_values(msg):
        dropped = level == Level.WARN and message.startswith(_DROPPED)
        compute = values.get("compute_ms") if level == Level.OK else None
        reports.append(StageReport(stage, dropped, message[len(_DROPPED):] if dropped else "",
                                   None if compute is None else float(compute), values))
    return reports


# ---------------------------------------------------------------- stop requests
# A stop request is a DiagnosticArray with one status: `name` says who asks (only the expected
# source is obeyed), the header stamps it, level ERROR means "stop", OK means "no stop needed";
# the message says why. The safety monitor and the failsafe send them.


@dataclass(frozen=True)
class StopRequest:
    source: str
    stop: bool
    reason: str
    stamp_ns: int


def stop_request_message(stamp: int, source: str, stop: bool, reason: str = ""):
    return diagnostics(stamp, source, Level.ERROR if stop else Level.OK, reason, {"stop": stop}, hardware_id=source)


def stop_request_from_message(msg) -> StopRequest:
    if len(msg.status) != 1:
        raise MessageError(f"a stop request has exactly one status, got {len(msg.status)}")
    name, level, message, _ = diagnostic_values(msg)[0]
    if level not in (Level.OK, Level.ERROR):
        raise MessageError(f"a stop request's level is OK or ERROR, got {level}")
    return StopRequest(name, level == Level.ERROR, message, stamp_ns(msg.header))


# ---------------------------------------------------------------- PACMod 3 (pacmod3_msgs, ROS 2 layout)


def system_status(report):
    """core.control.SystemStatus from a SystemRptFloat (steering, accel, brake reports)."""
    from sps_driving.core.control import SystemStatus

    fault = any(
        bool(getattr(report, flag))
        for flag in ("command_output_fault", "input_output_fault", "output_reported_fault", "pacmod_fault", "vehicle_fault")
    )
    return SystemStatus(bool(report.enabled), bool(report.override_active), fault, bool(report.command_timeout), float(report.output))


def forward_gear(report) -> bool:
    """Whether a shift report (SystemRptInt) shows a forward gear: SHIFT_FORWARD or SHIFT_LOW
    (the RX 450h's B, engine braking); park, reverse, neutral, between gears and none are not."""
    return int(report.output) in (int(report.SHIFT_FORWARD), int(report.SHIFT_LOW))


def global_status(report):
    """core.control.GlobalStatus from a GlobalRpt (`enabled` = any system enabled)."""
    from sps_driving.core.control import GlobalStatus

    timeout = any(
        bool(getattr(report, flag))
        for flag in ("user_can_timeout", "steering_can_timeout", "brake_can_timeout", "subsystem_can_timeout", "vehicle_can_timeout")
    )
    fault = bool(report.pacmod_sys_fault_active) or bool(report.config_fault_active)
    return GlobalStatus(bool(report.enabled), bool(report.override_active), fault, timeout)


def pacmod_commands(command, stamp: int) -> dict:
    """{system: message} for one core.control.PacmodCommand: steering_cmd, accel_cmd, brake_cmd, turn_cmd."""
    from pacmod3_msgs.msg import SteeringCmd, SystemCmdFloat, SystemCmdInt

    flags = dict(header=_header(stamp, "base_link"), enable=command.enable, ignore_overrides=False,
                 clear_override=command.clear_override)
    return {
        "steering": SteeringCmd(command=command.steering_wheel_rad, rotation_rate=command.rotation_rate_rad_s, **flags),
        "accel": SystemCmdFloat(command=command.accel, **flags),
        "brake": SystemCmdFloat(command=command.brake, **flags),
        "turn": SystemCmdInt(command=SystemCmdInt.TURN_HAZARDS if command.hazards else SystemCmdInt.TURN_NONE, **flags),
    }
