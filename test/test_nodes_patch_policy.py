"""The policy node with a patch policy (a tiny random one of the real architecture: windows of 3
frames 0.1 s apart, test/samples.py), as a real process over DDS: this test plays the extractor
(descriptors) and the car's speed. Every command equals the core's streaming policy stepped
through the same frames; a frame that never arrives shortens the windows that would have used it,
stamps going backwards restart the history, and the node's counters say so."""

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import TwistStamped
from ros_helpers import Probe
from samples import tiny_policy
from sensor_msgs.msg import JointState, PointCloud2

from sps_driving.core import topics
from sps_driving.core.policies.checkpoint import load_policy
from sps_driving.core.policies.streaming import StreamingPolicy
from sps_driving.core.state import STATE_NAMES
from sps_driving.ros import msgs
from sps_driving.ros.graph import Graph, wait_for_nodes, wait_for_subscribers

pytestmark = pytest.mark.ros

DIM = 16
T0 = 1_700_000_000_000_000_000
STRIDE_NS = 100_000_000  # the world's 10 Hz, the checkpoint's stride
TARGET = 6.0


def test_the_policy_node_keeps_the_history_of_a_patch_policy(tmp_path_factory):
    ckpt = tiny_policy(tmp_path_factory.mktemp("ckpt") / "policy", dim=DIM, architecture="patch_policy",
                       state_inputs=STATE_NAMES)
    graph = Graph(["policy"], parameters={"policy": {"checkpoint": str(ckpt), "vehicle_backend": "topics",
                                                     "target_speed_mps": TARGET}},
                  log_dir=tmp_path_factory.mktemp("logs"))
    probe = Probe()
    probe.record(topics.POLICY_COMMAND, JointState, "stream")
    probe.record(topics.STAGE_TIMING, DiagnosticArray, "status")
    descriptors = probe.publisher(topics.DESCRIPTORS, PointCloud2, "stream")
    speed = probe.publisher(topics.VEHICLE_TWIST, TwistStamped, "sensor_out")
    policy = load_policy(ckpt)
    core = StreamingPolicy(policy)
    rng = np.random.default_rng(0)
    try:
        graph.start()
        wait_for_nodes(probe.node, ["policy"], 60, graph)
        wait_for_subscribers(descriptors, 1, 60)
        wait_for_subscribers(speed, 1, 60)
        # Frame 4 is dropped upstream; then the stream restarts at an earlier stamp (a replayed bag).
        stamps = [T0 + i * STRIDE_NS for i in (0, 1, 2, 3, 5, 6, 7)] + [T0 + i * STRIDE_NS for i in (1, 2)]
        counters = None
        for n, stamp in enumerate(stamps):
            value = 5.0 + 0.5 * (stamp - T0) / STRIDE_NS  # a function of the stamp: the restarted frames' speeds are known already
            for _ in range(3):  # best effort: give the speed time to arrive before its frame
                speed.publish(msgs.to_ros(msgs.twist_fields(value, stamp)))
            probe.spin(0.3)
            indices = policy.selector.select(stamp)
            values = rng.standard_normal((len(indices), DIM)).astype(np.float32)

            def outputs():
                """The frame's commands and timing reports so far (a restarted stream repeats stamps)."""
                commands = [m for m in probe.messages(topics.POLICY_COMMAND) if msgs.stamp_ns(m.header) == stamp]
                timing = [m for m in probe.messages(topics.STAGE_TIMING)
                          if msgs.stamp_ns(m.header) == stamp and msgs.stage_reports(m)[0].compute_ms is not None]
                return commands, timing

            before = [len(o) for o in outputs()]
            descriptors.publish(msgs.descriptors_message(values, indices, stamp, "camera"))
            expected = core.step(stamp, values, indices, {"speed_mps": value, "target_speed_mps": TARGET})
            assert probe.spin_until(lambda: all(len(o) > b for o, b in zip(outputs(), before)), 10), f"no command for frame {n}"
            commands, timing = outputs()
            command, counters = commands[-1], msgs.stage_reports(timing[-1])[0].values
            assert msgs.command_from_message(command) == pytest.approx(expected, abs=1e-5), f"frame {n}"
        history = {k[len("history_"):]: int(v) for k, v in counters.items() if k.startswith("history_")}
        assert history == {k: v for k, v in core.history.counts.items()}
        assert history["frames"] == len(stamps) and history["reset_backwards"] == 1
        assert history["missing_frame"] == 2, "frames 5 and 6 reach back to the dropped frame 4"
    finally:
        graph.stop()
        probe.close()
