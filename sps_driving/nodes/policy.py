"""policy: descriptors of the kept patches (and the car's state) -> a stamped (steering, throttle) command.

Loads a checkpoint folder (policy.safetensors + config.json, sps_driving.core.policy). A message
with the wrong layout, non-finite descriptors or indices the policy cannot take is dropped and
counted; the command carries the camera frame's stamp of its descriptors.

A policy with state inputs (sps_driving.core.state) also reads the car's speed, from the report
the vehicle interface's backend reads (`vehicle_backend`), and the cruise target speed, from
topics.TARGET_SPEED or, until a message arrives there, the `target_speed_mps` parameter. A frame's
state is the value whose header stamp is nearest to the frame's stamp, as training paired them; a
frame without one within the age limit (none received, stale, or reported invalid) is dropped and
counted by reason, never driven from an old speed.
"""

from __future__ import annotations

import time

from rclpy.node import Node
from sensor_msgs.msg import JointState, PointCloud2

from sps_driving import msgs, topics
from sps_driving.core.state import SPEED_TOPICS, StateTracker, StateUnavailable, live_source
from sps_driving.nodes.common import Param, StageTimer, declare, run
from sps_driving.resources import SHIPPED_POLICY

PARAMETERS = {
    "checkpoint": Param(SHIPPED_POLICY, "policy folder with policy.safetensors and config.json"),
    "device": Param("cpu", "torch device: cpu, cuda or auto (cuda when there is a GPU)"),
    "vehicle_backend": Param("topics", "the vehicle interface's backend, whose speed report is read: pacmod3 "
                             f"{SPEED_TOPICS['pacmod3']}, topics {SPEED_TOPICS['topics']}", choices=tuple(SPEED_TOPICS)),
    "target_speed_mps": Param(4.0, f"cruise target speed until one arrives on {topics.TARGET_SPEED}; keep it below "
                              "the vehicle interface's max_speed_mps, where the accelerator is cut", "m/s", above=0.0),
    "max_speed_age_s": Param(0.1, "the speed nearest a frame's stamp may be this far from it, else the frame is dropped",
                             "s", above=0.0),
    "max_target_speed_age_s": Param(1.0, "the same for the cruise target speed, once one has arrived", "s", above=0.0),
}
# State input -> the parameter of its age limit.
MAX_AGE_PARAMETERS = {"speed_mps": "max_speed_age_s", "target_speed_mps": "max_target_speed_age_s"}


class PolicyNode(Node):
    NODE_NAME = "policy"

    def __init__(self):
        super().__init__(self.NODE_NAME)
        p = declare(self, PARAMETERS)
        from sps_driving.core.backbones import resolve_device
        from sps_driving.core.policy import load_policy

        self.policy = load_policy(p["checkpoint"], device=str(resolve_device(p["device"])))
        self.counters = {"frames": 0, "dropped_invalid": 0}
        self.publisher = self.create_publisher(JointState, topics.POLICY_COMMAND, msgs.qos("stream"))
        self.stage_timer = StageTimer(self, self.NODE_NAME)
        self.state_tracker = None
        if self.policy.state_inputs:
            self.state_tracker = self._read_state(p)
        self.create_subscription(PointCloud2, topics.DESCRIPTORS, self._on_descriptors, msgs.qos("stream"))
        sel = self.policy.selection
        self.get_logger().info(f"policy {p['checkpoint']}: {sel.variant} rate {sel.rate}, D={self.policy.descriptor_dim}, "
                               f"state inputs {list(self.policy.state_inputs) or 'none'}")

    def _read_state(self, p: dict) -> StateTracker:
        names = self.policy.state_inputs
        tracker = StateTracker({name: p[MAX_AGE_PARAMETERS[name]] for name in names},
                               fallback={"target_speed_mps": p["target_speed_mps"]})
        for name in names:
            topic, msgtype = live_source(name, p["vehicle_backend"])
            try:
                message_type = msgs.ros_type(msgtype)
            except ImportError as exc:
                raise ValueError(f"reading {name} from {topic} needs {msgtype} (for pacmod3: apt install "
                                 f"ros-$ROS_DISTRO-pacmod3-msgs); or set vehicle_backend to 'topics'") from exc

            def on_state(msg, name=name):
                tracker.add(name, msgs.stamp_ns(msg.header), msgs.speed_from_message(msg))

            self.create_subscription(message_type, topic, on_state, msgs.qos("sensor"))
            self.get_logger().info(f"state input {name} from {topic}, at most {p[MAX_AGE_PARAMETERS[name]]:g} s from the frame")
        self.counters.update(dropped_state_missing=0, dropped_state_stale=0, dropped_state_invalid=0)
        return tracker

    def _on_descriptors(self, msg: PointCloud2) -> None:
        started = time.perf_counter()
        stamp = msgs.stamp_ns(msg.header)
        try:
            values, indices = msgs.descriptors_from_message(msg)
            state = self.state_tracker.at(stamp) if self.state_tracker is not None else None
            steering, throttle = self.policy.predict(values, indices, state)
        except StateUnavailable as exc:
            self.counters[f"dropped_state_{exc.kind}"] += 1
            self.stage_timer.dropped(stamp, str(exc), self.counters)
            self.get_logger().warning(f"dropped a frame: {exc}", throttle_duration_sec=1.0)
            return
        except (ValueError, RuntimeError) as exc:  # MessageError, bad shapes, NaN/Inf in or out; torch errors
            self.counters["dropped_invalid"] += 1
            self.stage_timer.dropped(stamp, str(exc), self.counters)
            self.get_logger().error(f"dropped descriptors: {exc}", throttle_duration_sec=1.0)
            return
        self.publisher.publish(msgs.to_ros(msgs.command_fields(steering, throttle, stamp)))
        self.counters["frames"] += 1
        self.stage_timer.publish(stamp, started, self.counters)


def main(args=None) -> int:
    return run(PolicyNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
