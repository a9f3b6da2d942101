"""safety_monitor: flags lane, collision and heading failures (SPS section 4.2) and requests stops.

Inputs: lane state (geometry_msgs/PoseStamped in the lane frame) and the nearest-obstacle gap
(sensor_msgs/Range, REP 117: +inf nothing in range, -inf too close to measure), on remappable
topics. Outputs, at `rate_hz` on the steady clock: the stop request (msgs.stop_request_message,
stamped, source "safety_monitor"; stop while a failure or a stale required input holds) and the
status on /diagnostics; on each failure onset, one DiagnosticArray event on topics.SAFETY_EVENTS.
Logic: sps_driving.core.monitor.
"""

from __future__ import annotations

import math
import time

from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import PoseStamped
from rclpy.clock import Clock, ClockType
from rclpy.node import Node
from sensor_msgs.msg import Range

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
        status = self.monitor.step(time.monotonic())
        stamp = now_ns(self)
        failures = ",".join(f.value for f in status.failures)
        stale = ",".join(status.stale_inputs)
        reason = "; ".join(part for part in (failures, f"stale: {stale}" if stale else "") if part)
        self.stop_pub.publish(msgs.stop_request_message(stamp, self.NODE_NAME, status.stop_requested, reason))
        for failure in status.new_failures:
            self.get_logger().error(f"failure: {failure.value}")
            self.event_pub.publish(
                msgs.diagnostics(
                    stamp, self.NODE_NAME, msgs.Level.ERROR, failure.value,
                    {"failure": failure.value, "interventions": status.interventions},
                )
            )
        if status.stop_requested != self._last_stop:
            self.get_logger().warning(f"stop request {status.stop_requested} (failures [{failures}], stale [{stale}])")
            self._last_stop = status.stop_requested
        level = msgs.Level.ERROR if status.failures else (msgs.Level.STALE if status.stale_inputs else msgs.Level.OK)
        message = f"failures: {failures}" if failures else (f"stale: {stale}" if stale else "ok")
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
                },
            )
        )


def main(args=None) -> int:
    return run(SafetyMonitorNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
