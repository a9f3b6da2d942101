"""vehicle_interface: the only node that talks to the car.

Policy commands in (sensor_msgs/JointState); limited actuation out at the control rate, through
the `pacmod3` backend (PACMod 3 steering/accel/brake commands, engagement from its reports) or the
`topics` backend (a JointState on topics.ACTUATION, overrides from a std_msgs/Bool). Every
reason to stop (stale or invalid command, stopped camera, safety stop, silent safety monitor,
not engaged) gives a controlled stop within one control period; the reasons are published on
topics.VEHICLE_STATUS. All logic lives in sps_driving.core.control.
"""

from __future__ import annotations

import time

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.node import Node
from sensor_msgs.msg import CameraInfo, JointState
from std_msgs.msg import Bool

from sps_driving import msgs, topics
from sps_driving.core.control import ControlLimits, Engagement, PacmodLimits, VehicleController, to_pacmod
from sps_driving.nodes.common import declare, now_ns, run

DEFAULT_LIMITS = ControlLimits()
PARAMETERS = {
    "backend": "topics",
    "auto_engage": False,
    "require_safety_monitor": True,
    "report_timeout_s": 0.5,
    "engage_timeout_s": 2.0,
    "status_rate_hz": 5.0,
    "steering_ratio": PacmodLimits().steering_ratio,
    "max_steering_wheel_angle_rad": PacmodLimits().max_steering_wheel_angle_rad,
    **{name: float(getattr(DEFAULT_LIMITS, name)) for name in DEFAULT_LIMITS.__dataclass_fields__},
}
BACKENDS = ("topics", "pacmod3")


class TopicsBackend:
    """Standard message types: for tests, the simulator and cars without PACMod."""

    def __init__(self, node: Node):
        self.node = node
        self.publisher = node.create_publisher(JointState, topics.ACTUATION, msgs.qos("control"))
        self.override_active = False
        node.create_subscription(Bool, topics.VEHICLE_OVERRIDE, self._on_override, msgs.qos("control"))

    def _on_override(self, msg: Bool) -> None:
        self.override_active = bool(msg.data)

    def report(self, engagement: Engagement, now_s: float) -> None:
        # No drive-by-wire reports here: the car is "enabled" whenever we enable it.
        engagement.on_report(engagement.enable, self.override_active, False, now_s)

    def send(self, actuation, engagement: Engagement, stamp: int) -> None:
        self.publisher.publish(msgs.command_message(actuation.steering_rad, actuation.throttle, stamp))


class Pacmod3Backend:
    """PACMod 3 (astuff/pacmod3): enable/engage handshake, clear_override only while engaging."""

    def __init__(self, node: Node, limits: ControlLimits, pacmod: PacmodLimits):
        try:
            from pacmod3_msgs.msg import GlobalRpt, SteeringCmd, SystemCmdFloat
        except ImportError as exc:
            raise ValueError(
                "backend 'pacmod3' needs pacmod3_msgs from the ROS distro (apt install ros-$ROS_DISTRO-pacmod3-msgs); "
                "use backend 'topics' on machines without PACMod"
            ) from exc
        self.node, self.limits, self.pacmod = node, limits, pacmod
        self.SteeringCmd, self.SystemCmdFloat = SteeringCmd, SystemCmdFloat
        qos = msgs.qos("control")
        self.steering = node.create_publisher(SteeringCmd, topics.PACMOD_STEERING_CMD, qos)
        self.accel = node.create_publisher(SystemCmdFloat, topics.PACMOD_ACCEL_CMD, qos)
        self.brake = node.create_publisher(SystemCmdFloat, topics.PACMOD_BRAKE_CMD, qos)
        self._report = None
        node.create_subscription(GlobalRpt, topics.PACMOD_GLOBAL_RPT, self._on_report, qos)

    def _on_report(self, msg) -> None:
        self._report = (bool(msg.enabled), bool(msg.override_active), bool(msg.fault_active), time.monotonic())

    def report(self, engagement: Engagement, now_s: float) -> None:
        if self._report is not None:
            enabled, override, fault, received_s = self._report
            self._report = None
            engagement.on_report(enabled, override, fault, received_s)

    def send(self, actuation, engagement: Engagement, stamp: int) -> None:
        cmd = to_pacmod(actuation, self.limits, self.pacmod)
        flags = dict(enable=engagement.enable, ignore_overrides=False, clear_override=engagement.clear_override)
        header = msgs.header(stamp, "base_link")
        self.steering.publish(
            self.SteeringCmd(header=header, command=cmd.steering_wheel_rad, rotation_rate=cmd.rotation_rate_rad_s, **flags)
        )
        self.accel.publish(self.SystemCmdFloat(header=header, command=cmd.accel, **flags))
        self.brake.publish(self.SystemCmdFloat(header=header, command=cmd.brake, **flags))


class VehicleInterface(Node):
    NODE_NAME = "vehicle_interface"

    def __init__(self):
        super().__init__(self.NODE_NAME)
        p = declare(self, PARAMETERS)
        if p["backend"] not in BACKENDS:
            raise ValueError(f"unknown vehicle backend {p['backend']!r}; expected one of {BACKENDS}")
        self.limits = ControlLimits.from_dict({k: p[k] for k in DEFAULT_LIMITS.__dataclass_fields__})
        pacmod = PacmodLimits(float(p["steering_ratio"]), float(p["max_steering_wheel_angle_rad"]))
        self.controller = VehicleController(self.limits, require_safety_monitor=bool(p["require_safety_monitor"]))
        self.engagement = Engagement(float(p["report_timeout_s"]), float(p["engage_timeout_s"]))
        self.backend = TopicsBackend(self) if p["backend"] == "topics" else Pacmod3Backend(self, self.limits, pacmod)
        self.dropped_messages = 0
        self._last_reasons = None
        self._last_status_s = 0.0
        self._status_period_s = 1.0 / float(p["status_rate_hz"])
        self.status = self.create_publisher(DiagnosticArray, topics.VEHICLE_STATUS, msgs.qos("status"))
        self.create_subscription(JointState, topics.POLICY_COMMAND, self._on_command, msgs.qos("stream"))
        self.create_subscription(CameraInfo, topics.CAMERA_INFO, self._on_camera, msgs.qos("sensor"))
        self.create_subscription(Bool, topics.SAFETY_STOP, self._on_safety, msgs.qos("control"))
        self.create_subscription(Bool, topics.ENGAGE_REQUEST, self._on_engage, msgs.qos("control"))
        if p["auto_engage"]:
            self.engagement.request(True, time.monotonic())
        self.create_timer(self.limits.control_period_s, self._tick)
        self.get_logger().info(f"backend {p['backend']}, limits {self.limits}")

    def _on_command(self, msg: JointState) -> None:
        try:
            steering, throttle = msgs.command_from_message(msg)
        except msgs.MessageError as exc:
            self.dropped_messages += 1
            self.get_logger().warning(f"dropped command: {exc}", throttle_duration_sec=1.0)
            return
        stamp = msgs.stamp_ns(msg.header)
        latency_s = (now_ns(self) - stamp) / 1e9
        if not self.controller.on_command(steering, throttle, stamp, time.monotonic(), latency_s):
            self.get_logger().error(
                f"refused command ({steering}, {throttle}) from a frame {latency_s:.3f} s old: stopping", throttle_duration_sec=1.0
            )

    def _on_camera(self, msg: CameraInfo) -> None:
        self.controller.on_camera_frame(time.monotonic())

    def _on_safety(self, msg: Bool) -> None:
        self.controller.on_safety_status(bool(msg.data), time.monotonic())

    def _on_engage(self, msg: Bool) -> None:
        self.engagement.request(bool(msg.data), time.monotonic())
        self.get_logger().info(f"engage request {bool(msg.data)} -> {self.engagement.state.value}")

    def _tick(self) -> None:
        now_s = time.monotonic()
        before = self.engagement.last_event, self.engagement.state
        self.backend.report(self.engagement, now_s)
        self.engagement.check(now_s)
        if (self.engagement.last_event, self.engagement.state) != before:
            self.get_logger().warning(f"engagement: {self.engagement.last_event} -> {self.engagement.state.value}")
        act = self.controller.step(now_s, self.engagement.engaged)
        stamp = act.source_stamp_ns if act.source_stamp_ns is not None else now_ns(self)
        self.backend.send(act, self.engagement, stamp)
        if act.reasons != self._last_reasons or now_s - self._last_status_s >= self._status_period_s:
            if act.reasons != self._last_reasons and act.reasons:
                self.get_logger().warning(f"controlled stop: {', '.join(r.value for r in act.reasons)}")
            self._last_reasons = act.reasons
            self._last_status_s = now_s
            self._publish_status(act)

    def _publish_status(self, act) -> None:
        reasons = ",".join(r.value for r in act.reasons)
        self.status.publish(
            msgs.diagnostics(
                now_ns(self),
                self.NODE_NAME,
                1 if act.stopping else 0,
                f"stopping: {reasons}" if act.stopping else "driving",
                {
                    "engagement": self.engagement.state.value,
                    "stop_reasons": reasons,
                    "interventions": self.engagement.interventions,
                    "last_event": self.engagement.last_event,
                    "invalid_commands": self.controller.invalid_commands,
                    "late_commands": self.controller.late_commands,
                    "dropped_messages": self.dropped_messages,
                    "steering_rad": f"{act.steering_rad:.5f}",
                    "throttle": f"{act.throttle:.4f}",
                },
            )
        )


def main(args=None) -> int:
    return run(VehicleInterface, args)


if __name__ == "__main__":
    raise SystemExit(main())
