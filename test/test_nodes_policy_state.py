"""The policy node with a policy that reads state inputs, as a real process over DDS: this test plays
the extractor (descriptors), the car's speed report and the safety driver's cruise target. A frame
without a speed whose stamp is near its own (none yet, stale, reported invalid) is dropped and
counted by reason; with one, the command equals the core's for that state; the target comes from
the parameter until one is published, then from the topic, and must stay fresh."""

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import TwistStamped
from ros_helpers import Probe
from samples import tiny_policy
from sensor_msgs.msg import JointState, PointCloud2

from sps_driving.core import topics
from sps_driving.core.policies.checkpoint import load_policy
from sps_driving.core.state import STATE_NAMES
from sps_driving.ros import msgs
from sps_driving.ros.graph import Graph, wait_for_nodes, wait_for_subscribers

pytestmark = pytest.mark.ros

DIM = 16
T0 = 1_700_000_000_000_000_000
FALLBACK_TARGET = 6.0
MAX_SPEED_AGE = 0.1


def start(tmp_path_factory, vehicle_backend, speed_type):
    ckpt = tiny_policy(tmp_path_factory.mktemp("ckpt") / "policy", dim=DIM, state_inputs=STATE_NAMES)
    graph = Graph(["policy"], parameters={"policy": {
        "checkpoint": str(ckpt), "vehicle_backend": vehicle_backend, "target_speed_mps": FALLBACK_TARGET,
        "max_speed_age_s": MAX_SPEED_AGE, "max_target_speed_age_s": 1.0,
    }}, log_dir=tmp_path_factory.mktemp("logs"))
    probe = Probe()
    probe.record(topics.POLICY_COMMAND, JointState, "stream")
    probe.record(topics.STAGE_TIMING, DiagnosticArray, "status")
    speed_topic = topics.PACMOD_SPEED_RPT if vehicle_backend == "pacmod3" else topics.VEHICLE_TWIST
    publishers = {
        "descriptors": probe.publisher(topics.DESCRIPTORS, PointCloud2, "stream"),
        "speed": probe.publisher(speed_topic, speed_type, "sensor_out"),
        "target": probe.publisher(topics.TARGET_SPEED, TwistStamped, "sensor_out"),
        "twist": probe.publisher(topics.VEHICLE_TWIST, TwistStamped, "sensor_out"),
    }
    graph.start()
    wait_for_nodes(probe.node, ["policy"], 60, graph)
    for name in ("descriptors", "speed", "target"):
        wait_for_subscribers(publishers[name], 1, 60)
    return graph, probe, publishers, load_policy(ckpt)


@pytest.fixture
def rig(tmp_path_factory):
    graph, probe, publishers, policy = start(tmp_path_factory, "topics", TwistStamped)
    yield probe, publishers, policy
    graph.stop()
    probe.close()


def frame(probe, publishers, stamp, seed=0):
    """Publish one frame's descriptors; (its command or None, its drop report's reason and counters or None)."""
    indices = np.arange(0, 64, 2)
    values = np.random.default_rng(seed).standard_normal((len(indices), DIM)).astype(np.float32)
    publishers["descriptors"].publish(msgs.descriptors_message(values, indices, stamp, "camera"))

    def outcome():
        for m in probe.messages(topics.POLICY_COMMAND):
            if msgs.stamp_ns(m.header) == stamp:
                return msgs.command_from_message(m), None
        for m in probe.messages(topics.STAGE_TIMING):
            report = msgs.stage_reports(m)[0]
            if msgs.stamp_ns(m.header) == stamp and report.dropped:
                return None, (report.reason, report.values)
        return None

    assert probe.spin_until(lambda: outcome() is not None, 10), f"no outcome for frame {stamp}"
    return (values, indices), *outcome()


def send(probe, publisher, message):
    """A state message, given time to arrive before the frame that needs it (another writer)."""
    for _ in range(3):  # the node reads sensor data best effort
        publisher.publish(message)
    probe.spin(0.3)


def twist(speed, stamp):
    return msgs.to_ros(msgs.twist_fields(speed, stamp))


def test_frames_are_dropped_without_a_fresh_speed_and_driven_with_one(rig):
    probe, publishers, policy = rig
    _, command, (reason, counters) = frame(probe, publishers, T0)
    assert command is None and "no speed_mps received" in reason and int(counters["dropped_state_missing"]) == 1

    stamp = T0 + 1_000_000_000
    send(probe, publishers["speed"], twist(5.0, stamp + 20_000_000))  # a report 20 ms after the frame
    (values, indices), command, _ = frame(probe, publishers, stamp)
    slow = policy.predict(values, indices, {"speed_mps": 5.0, "target_speed_mps": FALLBACK_TARGET})
    assert command == pytest.approx(slow, abs=1e-6)

    # 0.5 s later with no newer speed report: stale, dropped.
    _, command, (reason, counters) = frame(probe, publishers, stamp + 500_000_000)
    assert command is None and "speed_mps stale" in reason and int(counters["dropped_state_stale"]) == 1

    stamp += 1_000_000_000
    send(probe, publishers["speed"], twist(11.0, stamp))
    (values, indices), command, _ = frame(probe, publishers, stamp)
    fast = policy.predict(values, indices, {"speed_mps": 11.0, "target_speed_mps": FALLBACK_TARGET})
    assert command == pytest.approx(fast, abs=1e-6)
    assert abs(fast[1] - slow[1]) > 1e-3, "the same frame at another speed gets another throttle"

    # The safety driver sets a target: from then on the topic's, and it must stay fresh.
    stamp += 100_000_000
    send(probe, publishers["target"], twist(9.0, stamp - 50_000_000))
    send(probe, publishers["speed"], twist(11.0, stamp))
    (values, indices), command, _ = frame(probe, publishers, stamp)
    assert command == pytest.approx(policy.predict(values, indices, {"speed_mps": 11.0, "target_speed_mps": 9.0}), abs=1e-6)
    stamp += 2_000_000_000
    send(probe, publishers["speed"], twist(11.0, stamp))
    _, command, (reason, counters) = frame(probe, publishers, stamp)
    assert command is None and "target_speed_mps stale" in reason and int(counters["dropped_state_stale"]) == 2
    assert int(counters["frames"]) == 3 and int(counters["dropped_invalid"]) == 0


def test_with_pacmod3_the_speed_report_is_read_and_its_valid_flag_respected(tmp_path_factory):
    from pacmod3_msgs.msg import VehicleSpeedRpt

    graph, probe, publishers, policy = start(tmp_path_factory, "pacmod3", VehicleSpeedRpt)
    try:
        def report(speed, valid, stamp):
            return msgs.to_ros(msgs.Fields("pacmod3_msgs/msg/VehicleSpeedRpt", {
                "header": msgs.header_fields(stamp), "vehicle_speed": speed, "vehicle_speed_valid": valid}))

        send(probe, publishers["twist"], twist(7.0, T0))  # not this backend's speed
        _, command, (reason, _) = frame(probe, publishers, T0)
        assert command is None and "no speed_mps received" in reason
        stamp = T0 + 1_000_000_000
        send(probe, publishers["speed"], report(7.0, True, stamp))
        (values, indices), command, _ = frame(probe, publishers, stamp)
        assert command == pytest.approx(policy.predict(values, indices, {"speed_mps": 7.0, "target_speed_mps": FALLBACK_TARGET}),
                                        abs=1e-6)
        stamp += 1_000_000_000
        send(probe, publishers["speed"], report(7.0, False, stamp))
        _, command, (reason, counters) = frame(probe, publishers, stamp)
        assert command is None and "speed_mps not valid" in reason and int(counters["dropped_state_invalid"]) == 1
    finally:
        graph.stop()
        probe.close()
