"""vehicle_interface: the only node that drives the car (a lifecycle node).

Policy commands in (sensor_msgs/JointState); limited commands out every control period through
the `pacmod3` backend (PACMod 3 steering, accelerator, brake and turn commands; engagement from
the steering, accelerator, brake, global, speed and shift reports) or the `topics` backend (standard
messages for the simulator and replays). Every control period it also publishes the limited
command on topics.ACTUATION: the heartbeat the failsafe watches.

Engage and disengage are services (topics.ENGAGE_SERVICE, std_srvs/SetBool), and so is the
re-arm after an override (topics.REARM_SERVICE, std_srvs/Trigger). While the safety monitor's OOD
rule slows the car (topics.CRUISE_SCALE below 1), the speed cap is that scale times the cruise
target (topics.TARGET_SPEED): the policy reads its own target. Watchdogs run on the steady
clock. Any reason to stop gives a controlled stop within one control period; the state, reasons
and counts are on /diagnostics. All decisions live in sps_driving.core.control.

Exits: on SIGINT, SIGTERM, SIGHUP, an exception in a callback, or a lifecycle deactivate or
shutdown, the node brakes for exit_brake_s (when engaged) and then disables every system before it
stops publishing (sps_driving.ros.nodes.common.run calls `fail_safe_exit`). `kill -9` and a frozen
process are the failsafe node's job.
"""

from __future__ import annotations

import math
import time

from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import TwistStamped
from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn
from sensor_msgs.msg import CameraInfo, JointState
from std_msgs.msg import Bool, Float32
from std_srvs.srv import SetBool, Trigger

from sps_driving.core import topics
from sps_driving.core.control import (
    STEERING_RATIO,
    SYSTEMS,
    ControlLimits,
    EngageState,
    GlobalStatus,
    StopReason,
    SystemStatus,
    VehicleLogic,
    to_pacmod,
)
from sps_driving.ros import msgs
from sps_driving.ros.nodes.common import SCHEDULING_PARAMETERS, Param, declare, now_ns, run, schedule

BACKENDS = ("topics", "pacmod3")


def _limit_param(name: str) -> Param:
    meaning = ControlLimits.meaning(name)
    bounds = {"min": 0.0} if meaning["zero_turns_off"] else {"above": 0.0}
    return Param(getattr(ControlLimits(), name), meaning["doc"], meaning["unit"], max=meaning["at_most"], **bounds)


PARAMETERS = {
    "backend": Param("topics", "pacmod3 (Lexus RX 450h drive-by-wire) or topics (standard messages)", choices=BACKENDS),
    "autostart": Param(True, "configure and activate at start; false: wait for the lifecycle transitions"),
    "auto_engage": Param(False, "engage as soon as ready (replays, the simulator); on the car the safety driver engages"),
    "require_safety_monitor": Param(True, "stop when the safety monitor's stop request goes silent"),
    "require_failsafe": Param(True, "stop when the failsafe's status goes silent (pacmod3 graphs)"),
    "require_speed": Param(True, "stop when the speed report is stale or invalid, so the speed cap holds"),
    "require_forward_gear": Param(True, "stop, and refuse to engage, unless a fresh shift report shows a forward gear "
                                  "(the policy only drives forward; the topics backend reports one)"),
    "latch_stops": Param(True, "an engaged stop holds until the safety driver disengages"),
    "status_rate_hz": Param(5.0, "/diagnostics rate (also on every change of state or stop reasons)", "Hz", above=0.0),
    "steering_ratio": Param(STEERING_RATIO, "steering-wheel angle / road-wheel angle", "ratio", above=0.0),
    **{name: _limit_param(name) for name in ControlLimits.names()},
    **SCHEDULING_PARAMETERS,
}
PUBLISHER_CHECK_PERIODS = 6  # count the publishers of inputs and outputs every 6 periods (0.2 s)
SAFETY_SOURCE, FAILSAFE_SOURCE = "safety_monitor", "failsafe"


def _on_speed(logic: VehicleLogic, msg) -> None:
    """A speed report of either backend (msgs.speed_from_message); one marked invalid is no speed."""
    speed = msgs.speed_from_message(msg)
    logic.on_speed(math.nan if speed is None else speed, speed is not None, time.monotonic())


class TopicsBackend:
    """Standard messages: for the simulator and replays. The command is the ACTUATION message
    itself; the car's reports are made up from what was commanded and the override topic, and its
    speed is the TwistStamped on topics.VEHICLE_TWIST. The simulated car only drives forward."""

    hardware_id = "topics"

    def __init__(self, node: VehicleInterface):
        self.node = node
        self.override_active = False
        node.create_subscription(Bool, topics.VEHICLE_OVERRIDE, self._on_override, msgs.qos("control"))
        node.create_subscription(TwistStamped, topics.VEHICLE_TWIST, lambda msg: _on_speed(node.logic, msg), msgs.qos("sensor"))

    def _on_override(self, msg: Bool) -> None:
        self.override_active = bool(msg.data)

    def report(self, logic: VehicleLogic, now_s: float) -> None:
        enabled = logic.state is not EngageState.DISENGAGED and not self.override_active
        for system in SYSTEMS:
            logic.on_system_report(system, SystemStatus(enabled, self.override_active), now_s)
        logic.on_global_report(GlobalStatus(enabled, self.override_active), now_s)
        logic.on_gear(True, now_s)

    def send(self, command, stamp: int) -> None:
        pass  # the ACTUATION message is the command

    def output_topics(self) -> list[str]:
        return []

    def input_topics(self) -> list[str]:
        return []


class Pacmod3Backend:
    """PACMod 3 (astuff/pacmod3 driver, pacmod3_msgs ROS 2 layout)."""

    hardware_id = "pacmod3"

    def __init__(self, node: VehicleInterface, limits: ControlLimits, steering_ratio: float):
        from pacmod3_msgs.msg import GlobalRpt, SteeringCmd, SystemCmdFloat, SystemCmdInt, SystemRptFloat, SystemRptInt, VehicleSpeedRpt

        self.node, self.limits, self.steering_ratio = node, limits, steering_ratio
        self.logic = node.logic
        types = {"steering": SteeringCmd, "accel": SystemCmdFloat, "brake": SystemCmdFloat, "turn": SystemCmdInt}
        self.publishers = {
            system: node.create_publisher(types[system], topic, msgs.qos("control"))
            for system, topic in topics.PACMOD_COMMANDS.items()
        }
        sensor = msgs.qos("sensor")
        self.reports = [node.create_subscription(SystemRptFloat, topic, self._system_callback(system), sensor)
                        for system, topic in topics.PACMOD_SYSTEM_REPORTS.items()]
        self.reports += [node.create_subscription(GlobalRpt, topics.PACMOD_GLOBAL_RPT, self._on_global, sensor),
                         node.create_subscription(VehicleSpeedRpt, topics.PACMOD_SPEED_RPT, lambda msg: _on_speed(self.logic, msg),
                                                  sensor),
                         node.create_subscription(SystemRptInt, topics.PACMOD_SHIFT_RPT, self._on_shift, sensor)]

    def _system_callback(self, system: str):
        def on_report(msg) -> None:
            self.logic.on_system_report(system, msgs.system_status(msg), time.monotonic())

        return on_report

    def _on_global(self, msg) -> None:
        self.logic.on_global_report(msgs.global_status(msg), time.monotonic())

    def _on_shift(self, msg) -> None:
        self.logic.on_gear(msgs.forward_gear(msg), time.monotonic())

    def report(self, logic: VehicleLogic, now_s: float) -> None:
        pass  # reports arrive on their own subscriptions

    def send(self, command, stamp: int) -> None:
        for system, message in msgs.pacmod_commands(to_pacmod(command, self.limits, self.steering_ratio), stamp).items():
            self.publishers[system].publish(message)

    def output_topics(self) -> list[str]:
        return [publisher.topic_name for publisher in self.publishers.values()]

    def input_topics(self) -> list[str]:
        """The driver's reports: a second publisher there (a bag played on the car's domain) could
        hide a stale or invalid report."""
        return [subscription.topic_name for subscription in self.reports]


class VehicleInterface(LifecycleNode):
    NODE_NAME = "vehicle_interface"

    def __init__(self):
        super().__init__(self.NODE_NAME)
        p = declare(self, PARAMETERS)
        schedule(self, p)
        if p["backend"] == "pacmod3":
            try:
                import pacmod3_msgs.msg  # noqa: F401
            except ImportError as exc:
                raise ValueError(
                    "backend 'pacmod3' needs pacmod3_msgs from the ROS distro (apt install ros-$ROS_DISTRO-pacmod3-msgs); "
                    "use backend 'topics' on machines without PACMod"
                ) from exc
        self.params = p
        self.limits = ControlLimits.from_dict({k: p[k] for k in ControlLimits.names()})
        self.logic = VehicleLogic(
            self.limits, float(p["steering_ratio"]),
            require_safety_monitor=bool(p["require_safety_monitor"]), require_failsafe=bool(p["require_failsafe"]),
            require_speed=bool(p["require_speed"]), require_forward_gear=bool(p["require_forward_gear"]),
            latch_stops=bool(p["latch_stops"]),
        )
        self.steady = Clock(clock_type=ClockType.STEADY_TIME)
        self.backend = None
        self.active = False
        self.exited = False
        self.dropped_messages = 0
        self.rejected_stop_requests = 0
        self._ticks = 0
        self._last_status = None
        self._last_status_s = 0.0
        if p["autostart"]:
            self.trigger_configure()
            self.trigger_activate()

    # ------------------------------------------------------------ lifecycle

    def on_configure(self, state) -> TransitionCallbackReturn:
        p = self.params
        self.backend = TopicsBackend(self) if p["backend"] == "topics" else Pacmod3Backend(self, self.limits, float(p["steering_ratio"]))
        self.heartbeat = self.create_publisher(JointState, topics.ACTUATION, msgs.qos("control"))
        self.diagnostics = self.create_publisher(DiagnosticArray, topics.DIAGNOSTICS, msgs.qos("status"))
        self.command_sub = self.create_subscription(JointState, topics.POLICY_COMMAND, self._on_command, msgs.qos("stream"))
        self.camera_sub = self.create_subscription(CameraInfo, topics.CAMERA_INFO, self._on_camera, msgs.qos("sensor"))
        self.safety_sub = self.create_subscription(DiagnosticArray, topics.SAFETY_STOP, self._on_safety, msgs.qos("control"))
        self.failsafe_sub = self.create_subscription(DiagnosticArray, topics.FAILSAFE_STATUS, self._on_failsafe, msgs.qos("control"))
        self.create_subscription(Float32, topics.CRUISE_SCALE, self._on_cruise_scale, msgs.qos("control"))
        self.create_subscription(TwistStamped, topics.TARGET_SPEED, self._on_target_speed, msgs.qos("sensor"))
        self.create_service(SetBool, topics.ENGAGE_SERVICE, self._on_engage)
        self.create_service(Trigger, topics.REARM_SERVICE, self._on_rearm)
        self.create_timer(self.limits.control_period_s, self._tick, clock=self.steady)
        self.get_logger().info(f"backend {p['backend']}, limits {self.limits}")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state) -> TransitionCallbackReturn:
        self.active = True
        if self.params["auto_engage"]:
            self.get_logger().info("auto_engage: engaging as soon as the car and the inputs are ready")
        return super().on_activate(state)

    def on_deactivate(self, state) -> TransitionCallbackReturn:
        self.fail_safe_exit("lifecycle deactivate")
        return super().on_deactivate(state)

    def on_shutdown(self, state) -> TransitionCallbackReturn:
        self.fail_safe_exit("lifecycle shutdown")
        return TransitionCallbackReturn.SUCCESS

    def fail_safe_exit(self, why: str) -> None:
        """Brake (when engaged), then disable, one command per control period; then send nothing."""
        if not self.active or self.backend is None:
            return
        self.active = False
        was = self.logic.state
        commands = self.logic.exit_commands()
        self.get_logger().warning(f"{why}: {was.value} -> {len(commands)} exit commands (brake, then disable)")
        for command in commands:
            self._send(command)
            time.sleep(self.limits.control_period_s)

    # ------------------------------------------------------------ inputs

    def _on_command(self, msg: JointState) -> None:
        try:
            steering, throttle = msgs.command_from_message(msg)
        except msgs.MessageError as exc:
            self.dropped_messages += 1
            self.get_logger().warning(f"dropped command: {exc}", throttle_duration_sec=1.0)
            return
        stamp = msgs.stamp_ns(msg.header)
        latency_s = (now_ns(self) - stamp) / 1e9
        if not self.logic.on_command(steering, throttle, stamp, time.monotonic(), latency_s):
            self.get_logger().error(
                f"refused command ({steering}, {throttle}) from a frame {latency_s:.3f} s old: stopping", throttle_duration_sec=1.0
            )

    def _on_cruise_scale(self, msg: Float32) -> None:
        if not self.logic.on_cruise_scale(float(msg.data)):
            self.dropped_messages += 1
            self.get_logger().warning(f"dropped a cruise scale of {msg.data}: not in (0, 1]", throttle_duration_sec=1.0)

    def _on_target_speed(self, msg: TwistStamped) -> None:
        if not self.logic.on_target_speed(float(msg.twist.linear.x)):
            self.dropped_messages += 1
            self.get_logger().warning(f"dropped a cruise target of {msg.twist.linear.x} m/s", throttle_duration_sec=1.0)

    def _on_camera(self, msg: CameraInfo) -> None:
        self.logic.on_camera(time.monotonic())

    def _stop_request(self, msg, source: str):
        try:
            request = msgs.stop_request_from_message(msg)
        except msgs.MessageError as exc:
            request = None
            why = str(exc)
        else:
            why = f"from {request.source!r}, expected {source!r}"
        if request is None or request.source != source:
            self.rejected_stop_requests += 1
            self.get_logger().error(f"ignored a stop request {why}", throttle_duration_sec=1.0)
            return None
        return request

    def _on_safety(self, msg) -> None:
        request = self._stop_request(msg, SAFETY_SOURCE)
        if request is not None:
            self.logic.on_safety(request.stop, time.monotonic())

    def _on_failsafe(self, msg) -> None:
        request = self._stop_request(msg, FAILSAFE_SOURCE)
        if request is not None:
            self.logic.on_failsafe(request.stop, time.monotonic())

    def _on_engage(self, request, response):
        if request.data and not self.active:  # inactive, nothing is sent: an engagement would wait for activate
            response.success, response.message = False, "not engaging: the node is not active (lifecycle)"
        elif request.data:
            response.success, response.message = self.logic.request_engage(time.monotonic())
        else:
            response.success, response.message = self.logic.request_disengage()
        self.get_logger().warning(f"engage request {request.data}: {response.message}")
        return response

    def _on_rearm(self, request, response):
        response.success, response.message = self.logic.rearm()
        self.get_logger().warning(f"re-arm: {response.message}")
        return response

    # ------------------------------------------------------------ the control period

    def _expected_publishers(self) -> dict:
        """{resolved topic: publishers the graph has} for every topic whose publishers are checked."""
        expected = {self.command_sub.topic_name: 1, self.camera_sub.topic_name: 1, self.heartbeat.topic_name: 1}
        if self.logic.require_safety_monitor:
            expected[self.safety_sub.topic_name] = 1
        if self.logic.require_failsafe:
            expected[self.failsafe_sub.topic_name] = 1
        for topic in self.backend.output_topics():
            expected[topic] = 1 + int(self.logic.require_failsafe)  # this node and the failsafe
        for topic in self.backend.input_topics():
            expected[topic] = 1  # the driver
        return expected

    def _check_publishers(self) -> None:
        extra = {}
        for topic, expected in self._expected_publishers().items():
            count = self.count_publishers(topic)
            if count > expected:
                extra[topic] = count
        if extra:
            self.get_logger().error(f"more publishers than the graph has: {extra}", throttle_duration_sec=1.0)
        self.logic.on_duplicates(extra)

    def _tick(self) -> None:
        if not self.active:
            return
        if self._ticks % PUBLISHER_CHECK_PERIODS == 0:
            self._check_publishers()
        self._ticks += 1
        now_s = time.monotonic()  # read beside the ROS clock: time between the two would read as a step
        if self.logic.on_clock(now_ns(self), now_s):
            self.get_logger().error("the ROS clock stepped against the steady clock: stopping")
        self.backend.report(self.logic, now_s)
        before = self.logic.last_event
        if self.params["auto_engage"] and self.logic.state is EngageState.DISENGAGED and not self.logic.disengagements:
            if not self.logic.engage_blockers(now_s):
                self.logic.request_engage(now_s)
        command = self.logic.tick(now_s)
        if self.logic.last_event != before:
            self.get_logger().warning(f"engagement: {self.logic.last_event} -> {self.logic.state.value}")
        self._send(command)
        reasons = (command.state, command.reasons)
        if reasons != self._last_status or now_s - self._last_status_s >= 1.0 / self.params["status_rate_hz"]:
            if reasons != self._last_status and command.reasons and command.state is EngageState.ENGAGED:
                self.get_logger().warning(f"controlled stop: {', '.join(r.value for r in command.reasons)}")
            self._last_status, self._last_status_s = reasons, now_s
            self._publish_status(command)

    def _send(self, command) -> None:
        stamp = command.source_stamp_ns if command.source_stamp_ns is not None else now_ns(self)
        self.backend.send(command, stamp)
        self.heartbeat.publish(msgs.to_ros(msgs.command_fields(command.steering_rad, command.throttle, stamp)))

    def _publish_status(self, command) -> None:
        reasons = ",".join(r.value for r in command.reasons)
        if self.logic.last_event in ("fault", "can_timeout") or StopReason.DUPLICATE_PUBLISHER in command.reasons \
                or StopReason.FAILSAFE_ACTIVE in command.reasons:
            level = msgs.Level.ERROR
        elif command.state is EngageState.ENGAGED and command.stopping:
            level = msgs.Level.WARN
        else:
            level = msgs.Level.OK
        if command.state is EngageState.ENGAGED:
            message = f"controlled stop: {reasons}" if command.stopping else "driving"
        else:
            message = command.state.value + (" (locked out after an override: re-arm)" if self.logic.locked_out else "")
        self.diagnostics.publish(
            msgs.diagnostics(
                now_ns(self), self.NODE_NAME, level, message,
                {
                    "engagement": command.state.value,
                    "stop_reasons": reasons,
                    "last_event": self.logic.last_event,
                    "locked_out": self.logic.locked_out,
                    "interventions": self.logic.interventions,
                    "disengagements": ",".join(f"{k}={v}" for k, v in sorted(self.logic.disengagements.items())),
                    "invalid_commands": self.logic.invalid_commands,
                    "late_commands": self.logic.late_commands,
                    "dropped_messages": self.dropped_messages,
                    "rejected_stop_requests": self.rejected_stop_requests,
                    "steering_rad": f"{command.steering_rad:.5f}",
                    "throttle": f"{command.throttle:.4f}",
                    "speed_cap_mps": f"{self.logic.speed_cap_mps:.2f}",
                    "hazards": command.hazards,
                },
                hardware_id=self.backend.hardware_id,
            )
        )


def main(args=None) -> int:
    return run(VehicleInterface, args)


if __name__ == "__main__":
    raise SystemExit(main())
