"""safety_monitor: flags lane, collision and heading failures (SPS section 4.2) and requests stops.

Inputs: lane state (geometry_msgs/PoseStamped in the lane frame) and the nearest-obstacle gap
(sensor_msgs/Range, REP 117: +inf nothing in range, -inf too close to measure), on remappable
topics. Outputs, at `rate_hz` on the steady clock: the stop request (msgs.stop_request_message,
stamped, source "safety_monitor"; stop while a failure or a stale required input holds) and the
status on /diagnostics; on each failure onset, one DiagnosticArray event on topics.SAFETY_EVENTS.

With `ood_rule` the monitor also acts on the policy's OOD score (topics.OOD_SCORE; the rule and its
settings: sps_driving.core.monitor.OodRule, config/ood.yaml): at `rate_hz` it publishes its
slow-down on topics.CRUISE_SCALE (the vehicle interface caps the speed at that fraction of the
cruise target) and, on topics.HANDOVER_REQUEST, whether it asks the safety driver to take over
(for the car's HMI to sound); each request is one event on topics.HANDOVER_EVENTS and puts
/diagnostics at ERROR while it holds; a request unanswered for handover_timeout_s requests a
controlled stop. Taking over (disengaging) is the answer: the stop request then brakes nothing, and
it ends once the score has stayed low for handover_clear_s.
Logic: sps_driving.core.monitor.
"""

from __future__ import annotations

import math
import time

from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import PoseStamped
from rclpy.clock import Clock, ClockType
from rclpy.node import Node
from sensor_msgs.msg import JointState, Range

from sps_driving.core import topics
from sps_driving.core.failures import FailureThresholds
from sps_driving.core.monitor import MonitorConfig, SafetyMonitor
from sps_driving.ros import msgs
from sps_driving.ros.nodes.common import Param, declare, now_ns, run

_DEFAULT_THRESHOLDS = FailureThresholds()
PARAMETERS = {
    "rate_hz": Param(10.0, "stop request, status and event rate", "Hz", above=0.0),
    "lane_boundary_offset_m": Param(_DEFAULT_THRESHOLDS.lane_boundary_offset_m,
                                    "lateral offset from the lane centre that is a lane failure (half a lane)", "m", above=0.0),
    "min_obstacle_gap_m": Param(_DEFAULT_THRESHOLDS.min_obstacle_gap_m,
                                "free gap at or below which an approach is a collision", "m", min=0.0),
    "max_heading_error_deg": Param(30.0, "heading off the lane direction that is a failure", "deg", above=0.0, below=180.0),
    "max_input_age_s": Param(MonitorConfig().max_input_age_s, "an input older than this is stale", "s", above=0.0),
    "required_inputs": Param(list(MonitorConfig().required_inputs),
                             'inputs whose absence requests a stop: "lane" and/or "obstacle" ([""] for none)'),
    "ood_rule": Param(False, f"act on the OOD score ({topics.OOD_SCORE}): lower the cruise target, request a handover, "
                      "stop when it goes unanswered (config/ood.yaml's rule)"),
    "ood_config": Param("", "settings file of the OOD rule ('' = config/ood.yaml)"),
}


class SafetyMonitorNode(Node):
    NODE_NAME = "safety_monitor"

    def __init__(self):
        super().__init__(self.NODE_NAME)
        p = declare(self, PARAMETERS)
        thresholds = FailureThresholds(
            lane_boundary_offset_m=float(p["lane_boundary_offset_m"]),
            min_obstacle_gap_m=float(p["min_obstacle_gap_m"]),
            max_heading_error_rad=math.radians(float(p["max_heading_error_deg"])),
        )
        required = tuple(name for name in p["required_inputs"] if name)
        self.monitor = SafetyMonitor(MonitorConfig(thresholds, float(p["max_input_age_s"]), required))
        self.dropped_messages = 0
        self.stop_pub = self.create_publisher(DiagnosticArray, topics.SAFETY_STOP, msgs.qos("control"))
        self.status_pub = self.create_publisher(DiagnosticArray, topics.DIAGNOSTICS, msgs.qos("status"))
        self.event_pub = self.create_publisher(DiagnosticArray, topics.SAFETY_EVENTS, msgs.qos("status"))
        self.create_subscription(PoseStamped, topics.LANE_POSE, self._on_lane, msgs.qos("sensor"))
        self.create_subscription(Range, topics.OBSTACLE_RANGE, self._on_obstacle, msgs.qos("sensor"))
        self.ood = OodRuleIO(self, p["ood_config"] or None) if p["ood_rule"] else None
        self._last_stop = None
        self.create_timer(1.0 / float(p["rate_hz"]), self._tick, clock=Clock(clock_type=ClockType.STEADY_TIME))

    def _on_lane(self, msg: PoseStamped) -> None:
        lateral, heading = msgs.lane_from_message(msg)
        if not self.monitor.on_lane(lateral, heading, time.monotonic()):
            self.get_logger().warning("dropped non-finite lane state", throttle_duration_sec=1.0)

    def _on_obstacle(self, msg: Range) -> None:
        if not self.monitor.on_obstacle(float(msg.range), time.monotonic()):
            self.get_logger().warning(f"dropped invalid obstacle range {msg.range}", throttle_duration_sec=1.0)

    def _tick(self) -> None:
        now_s = time.monotonic()
        status = self.monitor.step(now_s)
        stamp = now_ns(self)
        ood = None if self.ood is None else self.ood.step(now_s, stamp)
        failures = ",".join(f.value for f in status.failures)
        stale = ",".join(status.stale_inputs)
        unanswered = ood is not None and ood.stop_requested
        reason = "; ".join(part for part in (failures, f"stale: {stale}" if stale else "",
                                             "handover request unanswered" if unanswered else "") if part)
        stop = status.stop_requested or unanswered
        self.stop_pub.publish(msgs.stop_request_message(stamp, self.NODE_NAME, stop, reason))
        for failure in status.new_failures:
            self.get_logger().error(f"failure: {failure.value}")
            self.event_pub.publish(
                msgs.diagnostics(
                    stamp, self.NODE_NAME, msgs.Level.ERROR, failure.value,
                    {"failure": failure.value, "interventions": status.interventions},
                )
            )
        if stop != self._last_stop:
            self.get_logger().warning(f"stop request {stop} ({reason or 'nothing holds'})")
            self._last_stop = stop
        handover = ood is not None and ood.handover_requested
        no_score = ood is not None and ood.stale  # the rule is on but blind: the policy node's ood_score is off or silent
        level = (msgs.Level.ERROR if status.failures or handover else msgs.Level.STALE if status.stale_inputs
                 else msgs.Level.WARN if no_score else msgs.Level.OK)
        message = "; ".join(part for part in (f"failures: {failures}" if failures else "",
                                              "handover requested (OOD score)" if handover else "",
                                              f"stale: {stale}" if stale else "",
                                              "no fresh OOD score" if no_score else "") if part) or "ok"
        self.status_pub.publish(
            msgs.diagnostics(
                stamp,
                self.NODE_NAME,
                level,
                message,
                {
                    "failures": failures,
                    "stale_inputs": stale,
                    "stop_requested": status.stop_requested,
                    "interventions": status.interventions,
                    "invalid_inputs": self.monitor.invalid_inputs,
                    **{f"count_{f.value}": n for f, n in status.failure_counts.items()},
                    **({} if ood is None else self.ood.values(ood)),
                },
            )
        )


class OodRuleIO:
    """The OOD rule's topics (see the module docstring): the score in, the cruise scale, the
    handover request and its events out."""

    def __init__(self, node: SafetyMonitorNode, config_file: str | None):
        from std_msgs.msg import Bool, Float32

        from sps_driving.core.monitor import OodRule, OodRuleConfig
        from sps_driving.core.ood import load_ood_config

        self.node, self.Bool, self.Float32 = node, Bool, Float32
        self.rule = OodRule(OodRuleConfig.from_config(load_ood_config(config_file)["rule"]))
        self.scale_pub = node.create_publisher(Float32, topics.CRUISE_SCALE, msgs.qos("control"))
        self.request_pub = node.create_publisher(Bool, topics.HANDOVER_REQUEST, msgs.qos("control"))
        self.event_pub = node.create_publisher(DiagnosticArray, topics.HANDOVER_EVENTS, msgs.qos("status"))
        node.create_subscription(JointState, topics.OOD_SCORE, self._on_score, msgs.qos("stream"))
        self._requested = False
        node.get_logger().info(f"OOD rule on: {self.rule.config}")

    def _on_score(self, msg: JointState) -> None:
        score = float(msg.position[0]) if len(msg.position) == 1 else math.nan
        if not self.rule.on_score(score, time.monotonic()):
            self.node.get_logger().warning(f"dropped invalid OOD score {list(msg.position)}", throttle_duration_sec=1.0)

    def step(self, now_s: float, stamp: int):
        status = self.rule.step(now_s)
        self.scale_pub.publish(self.Float32(data=float(status.cruise_scale)))
        self.request_pub.publish(self.Bool(data=status.handover_requested))
        if status.new_handover:
            self.node.get_logger().error(f"{topics.HANDOVER_EVENT}: OOD score {status.score:.2f}")
            self.event_pub.publish(msgs.diagnostics(stamp, self.node.NODE_NAME, msgs.Level.ERROR, topics.HANDOVER_EVENT,
                                                    {"score": status.score, "handovers": status.handovers}))
        if status.handover_requested != self._requested:
            self.node.get_logger().warning(f"handover request {status.handover_requested}")
            self._requested = status.handover_requested
        return status

    def values(self, status) -> dict:
        return {"ood_score": status.score, "ood_stale": status.stale, "ood_slowed": status.slowed,
                "cruise_scale": status.cruise_scale, "handover_requested": status.handover_requested,
                "handovers_requested": status.handovers, "ood_invalid": self.rule.invalid_scores}


def main(args=None) -> int:
    return run(SafetyMonitorNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
