"""The OOD score and rule as real node processes over DDS: the policy node scores each frame against
its checkpoint's calibration and publishes it, and reads the cruise target as set; the safety
monitor's rule (short time constants here) publishes a lower scale above the first threshold (the
vehicle interface's speed cap: test_nodes_vehicle.py), asks for a handover above the second with hysteresis (topic, event, ERROR
diagnostic) and requests a stop when nobody answers. A policy node asked for a score without a
calibration does not start, and says why."""

import numpy as np
import pytest
import yaml
from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import TwistStamped
from ood_samples import calibrated_checkpoint, fitted, training_frames
from ros_helpers import Probe, Rate
from samples import tiny_policy
from sensor_msgs.msg import JointState, PointCloud2
from std_msgs.msg import Bool, Float32

from sps_driving.core import topics
from sps_driving.core.ood import load_ood_config
from sps_driving.core.policies.checkpoint import load_policy
from sps_driving.core.resources import config_path
from sps_driving.core.state import STATE_NAMES
from sps_driving.ros import msgs
from sps_driving.ros.graph import Graph, wait_for_nodes, wait_for_subscribers
from sps_driving.ros.process import CANNOT_START

pytestmark = pytest.mark.ros

T0 = 1_700_000_000_000_000_000
TARGET = 10.0
RULE = {"slow_threshold": 2.0, "cruise_scale": 0.5, "slow_hold_s": 0.3, "handover_threshold": 4.0, "handover_after_s": 0.3,
        "handover_clear_threshold": 2.0, "handover_clear_s": 0.6, "handover_timeout_s": 1.0, "max_score_age_s": 1.0}


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    rng = np.random.default_rng(0)
    frames = training_frames(rng)
    scorer = fitted(rng, frames)
    ckpt, _ = calibrated_checkpoint(tmp_path_factory.mktemp("ckpt") / "policy", scorer, state_inputs=STATE_NAMES)
    config = load_ood_config()
    config["rule"] = RULE
    config_file = tmp_path_factory.mktemp("cfg") / "ood.yaml"
    config_file.write_text(yaml.safe_dump(config))
    graph = Graph(["policy", "safety_monitor"], parameters={
        "policy": {"checkpoint": str(ckpt), "ood_score": True, "ood_config": str(config_file), "target_speed_mps": TARGET},
        "safety_monitor": {"ood_rule": True, "ood_config": str(config_file), "required_inputs": [""], "rate_hz": 20.0},
    }, log_dir=tmp_path_factory.mktemp("logs"))
    probe = Probe()
    for topic, kind in ((topics.POLICY_COMMAND, JointState), (topics.OOD_SCORE, JointState)):
        probe.record(topic, kind, "stream")
    for topic, kind in ((topics.CRUISE_SCALE, Float32), (topics.HANDOVER_REQUEST, Bool), (topics.SAFETY_STOP, DiagnosticArray)):
        probe.record(topic, kind, "control")
    for topic in (topics.HANDOVER_EVENTS, topics.DIAGNOSTICS):
        probe.record(topic, DiagnosticArray, "status")
    publishers = {"descriptors": probe.publisher(topics.DESCRIPTORS, PointCloud2, "stream"),
                  "speed": probe.publisher(topics.VEHICLE_TWIST, TwistStamped, "sensor_out"),
                  "score": probe.publisher(topics.OOD_SCORE, JointState, "stream")}
    graph.start()
    try:
        wait_for_nodes(probe.node, ["policy", "safety_monitor"], 60, graph)
        for publisher in publishers.values():
            wait_for_subscribers(publisher, 1, 60)
        yield probe, publishers, load_policy(ckpt), scorer, frames, graph
    finally:
        graph.stop()
        probe.close()


def drive_frame(probe, publishers, stamp, values):
    """One frame (speed 8 m/s at its stamp): its command and published score."""
    indices = np.arange(0, 64, 2)
    for _ in range(3):
        publishers["speed"].publish(msgs.to_ros(msgs.twist_fields(8.0, stamp)))
    probe.spin(0.2)
    publishers["descriptors"].publish(msgs.descriptors_message(values, indices, stamp, "camera"))

    def outputs():
        command = [m for m in probe.messages(topics.POLICY_COMMAND) if msgs.stamp_ns(m.header) == stamp]
        score = [m for m in probe.messages(topics.OOD_SCORE) if msgs.stamp_ns(m.header) == stamp and m.name]
        return (msgs.command_from_message(command[0]), score[0]) if command and score else None

    assert probe.spin_until(lambda: outputs() is not None, 10), f"no command and score for frame {stamp}"
    return indices, *outputs()


def latest(probe, topic):
    return probe.messages(topic)[-1]


def test_the_policy_scores_each_frame_and_the_rule_slows_asks_and_stops(rig):
    probe, publishers, policy, scorer, frames, _ = rig

    def monitor_status():
        return msgs.status_named(latest(probe, topics.DIAGNOSTICS), "safety_monitor")

    # Before any score the rule is blind, and says so.
    assert probe.spin_until(lambda: probe.messages(topics.DIAGNOSTICS) and monitor_status()[:2] == (msgs.Level.WARN,
                                                                                                 "no fresh OOD score"), 10)
    familiar = frames[3]
    indices, command, score_msg = drive_frame(probe, publishers, T0, familiar)
    assert list(score_msg.name) == [load_ood_config()["score"]["method"]]
    assert score_msg.position[0] == pytest.approx(scorer.score(familiar, score_msg.name[0]), rel=1e-4)
    assert command == pytest.approx(policy.predict(familiar, indices, {"speed_mps": 8.0, "target_speed_mps": TARGET}), abs=1e-6)
    assert probe.spin_until(lambda: probe.messages(topics.CRUISE_SCALE) and latest(probe, topics.CRUISE_SCALE).data == 1.0, 5)
    assert not latest(probe, topics.HANDOVER_REQUEST).data

    def hold(score, seconds, until=lambda: False):
        """The test plays the policy's score at 20 Hz for `seconds`, or until `until()` holds
        (a stall of this process on a loaded machine then only makes the wait longer)."""
        message = msgs.to_ros(msgs.Fields("sensor_msgs/msg/JointState", {
            "header": msgs.header_fields(T0, "camera"), "name": ["patch_coreset"], "position": [score]}))
        return probe.spin_until(until, seconds, every=Rate(0.05, lambda: publishers["score"].publish(message)))

    def requested():
        return latest(probe, topics.HANDOVER_REQUEST).data

    def stop_requested():
        return msgs.stop_request_from_message(latest(probe, topics.SAFETY_STOP)).stop

    # Between the thresholds: slowed, no request.
    assert hold(3.0, 5.0, until=lambda: latest(probe, topics.CRUISE_SCALE).data == pytest.approx(0.5))
    assert not requested()
    # The policy still reads the cruise target as set: the vehicle interface's speed cap slows the car
    # (test_nodes_vehicle.py).
    indices, command, _ = drive_frame(probe, publishers, T0 + 10**9, familiar)
    assert command == pytest.approx(policy.predict(familiar, indices, {"speed_mps": 8.0, "target_speed_mps": TARGET}),
                                    abs=1e-6)

    hold(5.0, 0.15)  # above the second threshold, but not for handover_after_s yet
    assert not requested()
    assert hold(5.0, 5.0, until=lambda: requested() and probe.messages(topics.HANDOVER_EVENTS)
                and monitor_status()[0] == msgs.Level.ERROR)
    events = probe.messages(topics.HANDOVER_EVENTS)
    assert len(events) == 1 and msgs.status_named(events[0], "safety_monitor")[1] == topics.HANDOVER_EVENT
    level, message, values = monitor_status()
    assert level == msgs.Level.ERROR and "handover requested" in message and values["handovers_requested"] == "1"
    assert not stop_requested()

    hold(3.0, 0.5)  # inside the hysteresis band: the request holds; unanswered past 1 s: a controlled stop
    assert requested()
    assert hold(3.0, 5.0, until=stop_requested)
    assert requested()
    assert "handover request unanswered" in msgs.stop_request_from_message(latest(probe, topics.SAFETY_STOP)).reason

    # Below the clear threshold for handover_clear_s: the request ends, and with it the stop.
    assert hold(1.0, 5.0, until=lambda: not requested() and not stop_requested() and latest(probe, topics.CRUISE_SCALE).data == 1.0
                and monitor_status()[0] == msgs.Level.OK)
    assert len(probe.messages(topics.HANDOVER_EVENTS)) == 1
    assert monitor_status()[:2] == (msgs.Level.OK, "ok")


def test_a_policy_asked_for_a_score_without_a_calibration_does_not_start(tmp_path):
    ckpt = tiny_policy(tmp_path / "bare", dim=16)
    graph = Graph(["policy"], parameters={"policy": {"checkpoint": str(ckpt), "ood_score": True}}, log_dir=tmp_path / "logs")
    with graph:
        assert graph.returncode("policy", wait_s=60) == CANNOT_START
        log = graph.log("policy")
    assert "cannot start" in log and "no OOD calibration" in log and "ood calibrate" in log


def test_a_policy_asked_for_the_lane_probe_of_a_calibration_without_one_does_not_start(tmp_path):
    scorer = fitted(np.random.default_rng(0), training_frames(np.random.default_rng(0)))
    ckpt, _ = calibrated_checkpoint(tmp_path / "policy", scorer)
    config = tmp_path / "ood.yaml"
    config.write_text(config_path("ood.yaml").read_text().replace("method: patch_coreset", "method: lane_offset"))
    graph = Graph(["policy"], parameters={"policy": {"checkpoint": str(ckpt), "ood_score": True, "ood_config": str(config)}},
                  log_dir=tmp_path / "logs")
    with graph:
        assert graph.returncode("policy", wait_s=60) == CANNOT_START
        log = graph.log("policy")
    assert "cannot start" in log and "lane_offset is not in the calibration" in log and "lane pose" in log
