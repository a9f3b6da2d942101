"""failsafe: stops the car when the vehicle interface goes silent (killed or frozen) while the
car is drive-by-wire enabled. A small process of its own, without torch or the policy, started
next to the PACMod 3 driver. Logic and the reasons for it: sps_driving.core.failsafe.

In: the vehicle interface's heartbeat (topics.ACTUATION, every control period), the PACMod global
and steering reports. Out, only while it has taken over: PACMod steering, accelerator, brake and
turn commands. Always: its status as a stop request on topics.FAILSAFE_STATUS (the vehicle
interface stops when it is silent or says "stop") and on /diagnostics. Timers on the steady clock.

A vehicle interface silent for longer than the DDS lease while its node is still in the graph (a
stall: stopped, starved of CPU) can stay cut off from this process for good after it comes back
(docs/vehicle.md, "A stalled node and the DDS lease"): the failsafe then goes on braking, and says
so on /diagnostics (`cut_off`) and in its log, with the operator's remedy: restart the launch.
"""

from __future__ import annotations

import time

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.clock import Clock, ClockType
from rclpy.node import Node
from sensor_msgs.msg import JointState

from sps_driving.core import topics
from sps_driving.core.control import STEERING_RATIO, ControlLimits, PacmodCommand
from sps_driving.core.failsafe import Failsafe
from sps_driving.ros import msgs
from sps_driving.ros.nodes.common import SCHEDULING_PARAMETERS, Param, declare, now_ns, run, schedule

DEFAULT_LIMITS = ControlLimits()
VEHICLE_INTERFACE = ("vehicle_interface", "/")  # name, namespace
CUT_OFF_REMEDY = ("the car stays braked; the graph may not reconnect by itself: disengage, stop the launch and start it "
                  "again (docs/vehicle.md, A stalled node and the DDS lease)")
PARAMETERS = {
    "silence_timeout_s": Param(0.2, "no heartbeat from the vehicle interface for this long while the car is enabled: stop", "s", above=0.0),
    "stop_brake": Param(DEFAULT_LIMITS.stop_brake, "brake pedal held in the stop", "fraction", above=0.0, max=1.0),
    "steering_ratio": Param(STEERING_RATIO, "steering-wheel angle / road-wheel angle", "ratio", above=0.0),
    "control_rate_hz": Param(DEFAULT_LIMITS.control_rate_hz, "command output while it has taken over", "Hz", above=0.0),
    "status_rate_hz": Param(10.0, "status (the vehicle interface requires it) and /diagnostics", "Hz", above=0.0),
    "cut_off_after_s": Param(10.0, "vehicle interface silent this long while its node is still in the graph: a stall longer than "
                             "the DDS lease (config/fastdds.xml), said on /diagnostics with the remedy", "s", above=0.0),
    **SCHEDULING_PARAMETERS,
}


class FailsafeNode(Node):
    NODE_NAME = "failsafe"

    def __init__(self):
        super().__init__(self.NODE_NAME)
        p = declare(self, PARAMETERS)
        schedule(self, p)
        try:
            from pacmod3_msgs.msg import GlobalRpt, SteeringCmd, SystemCmdFloat, SystemCmdInt, SystemRptFloat
        except ImportError as exc:
            raise ValueError("failsafe needs pacmod3_msgs (apt install ros-$ROS_DISTRO-pacmod3-msgs)") from exc
        self.logic = Failsafe(float(p["silence_timeout_s"]), float(p["stop_brake"]))
        self.cut_off_after_s = float(p["cut_off_after_s"])
        self.heartbeat_s: float | None = None
        # It holds the measured angle; the rate only bounds how fast the wheel may settle there.
        self.rotation_rate = DEFAULT_LIMITS.max_steering_rate_rad_s * float(p["steering_ratio"])
        steady = Clock(clock_type=ClockType.STEADY_TIME)
        types = {"steering": SteeringCmd, "accel": SystemCmdFloat, "brake": SystemCmdFloat, "turn": SystemCmdInt}
        self.command_publishers = {
            system: self.create_publisher(types[system], topic, msgs.qos("control"))
            for system, topic in topics.PACMOD_COMMANDS.items()
        }
        self.status_pub = self.create_publisher(DiagnosticArray, topics.FAILSAFE_STATUS, msgs.qos("control"))
        self.diagnostics = self.create_publisher(DiagnosticArray, topics.DIAGNOSTICS, msgs.qos("status"))
        self.create_subscription(JointState, topics.ACTUATION, self._on_heartbeat, msgs.qos("control"))
        self.create_subscription(GlobalRpt, topics.PACMOD_GLOBAL_RPT, self._on_global, msgs.qos("sensor"))
        self.create_subscription(SystemRptFloat, topics.PACMOD_STEERING_RPT, self._on_steering, msgs.qos("sensor"))
        self.create_timer(1.0 / float(p["control_rate_hz"]), self._tick, clock=steady)
        self.create_timer(1.0 / float(p["status_rate_hz"]), self._publish_status, clock=steady)
        self.get_logger().info(f"watching {topics.ACTUATION}: silent {p['silence_timeout_s']} s while enabled -> stop")

    def _on_heartbeat(self, _msg) -> None:
        self.heartbeat_s = time.monotonic()
        self.logic.on_heartbeat(self.heartbeat_s)

    def _on_global(self, msg) -> None:
        self.logic.on_car(bool(msg.enabled), bool(msg.override_active))

    def _on_steering(self, msg) -> None:
        self.logic.on_steering(float(msg.output))

    def _tick(self) -> None:
        was = self.logic.state
        command = self.logic.tick(time.monotonic())
        if self.logic.state is not was:
            if self.logic.active:
                self.get_logger().error(f"vehicle interface silent: {was.value} -> {self.logic.state.value}")
            else:
                self.get_logger().warning(f"vehicle interface back: {was.value} -> {self.logic.state.value}")
            self._publish_status()
        if command is None:
            return
        pacmod = PacmodCommand(
            enable=command.enable, clear_override=False, steering_wheel_rad=command.steering_wheel_rad,
            rotation_rate_rad_s=self.rotation_rate, accel=command.accel, brake=command.brake, hazards=command.hazards,
        )
        for system, message in msgs.pacmod_commands(pacmod, now_ns(self)).items():
            self.command_publishers[system].publish(message)

    def _cut_off_for_s(self) -> float | None:
        """Seconds the vehicle interface has been silent while still in the graph, once that is longer
        than cut_off_after_s; None otherwise (it talks, it never talked, or it is gone)."""
        if self.heartbeat_s is None:
            return None
        silent_s = time.monotonic() - self.heartbeat_s
        if silent_s <= self.cut_off_after_s or VEHICLE_INTERFACE not in self.get_node_names_and_namespaces():
            return None
        return silent_s

    def _publish_status(self) -> None:
        stamp = now_ns(self)
        reason = f"vehicle interface silent: {self.logic.state.value}" if self.logic.active else ""
        self.status_pub.publish(msgs.stop_request_message(stamp, self.NODE_NAME, self.logic.active, reason))
        cut_off_s = self._cut_off_for_s()
        level = msgs.Level.ERROR if self.logic.active or cut_off_s is not None else msgs.Level.OK
        message = self.logic.state.value
        if cut_off_s is not None:
            message = (f"{message}; vehicle interface cut off: silent {cut_off_s:.0f} s while its node is in the graph, "
                       f"longer than the DDS lease; {CUT_OFF_REMEDY}")
            self.get_logger().error(message, throttle_duration_sec=10.0)
        values = {"trips": self.logic.trips, "cut_off": cut_off_s is not None}
        self.diagnostics.publish(msgs.diagnostics(stamp, self.NODE_NAME, level, message, values, hardware_id="pacmod3"))


def main(args=None) -> int:
    return run(FailsafeNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
