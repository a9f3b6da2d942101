"""policy: descriptors of the kept patches -> a stamped (steering, throttle) command.

Loads a checkpoint folder (policy.safetensors + config.json, sps_driving.core.policy). A message
with the wrong layout, non-finite descriptors or indices the policy cannot take is dropped and
counted; the command carries the camera frame's stamp of its descriptors.
"""

from __future__ import annotations

import time

from rclpy.node import Node
from sensor_msgs.msg import JointState, PointCloud2

from sps_driving import msgs, topics
from sps_driving.nodes.common import Param, StageTimer, declare, run
from sps_driving.resources import SHIPPED_POLICY

PARAMETERS = {
    "checkpoint": Param(SHIPPED_POLICY, "policy folder with policy.safetensors and config.json"),
    "device": Param("cpu", "torch device: cpu, cuda or auto (cuda when there is a GPU)"),
}


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
        self.create_subscription(PointCloud2, topics.DESCRIPTORS, self._on_descriptors, msgs.qos("stream"))
        sel = self.policy.selection
        self.get_logger().info(f"policy {p['checkpoint']}: {sel.variant} rate {sel.rate}, D={self.policy.descriptor_dim}")

    def _on_descriptors(self, msg: PointCloud2) -> None:
        started = time.perf_counter()
        stamp = msgs.stamp_ns(msg.header)
        try:
            values, indices = msgs.descriptors_from_message(msg)
            steering, throttle = self.policy.predict(values, indices)
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
