"""State inputs (sps_driving.core.state): the names, where they are read, and which value a frame gets."""

import math

import numpy as np
import pytest

from sps_driving.core import topics
from sps_driving.core.state import (
    STATE_NAMES,
    StateTracker,
    StateUnavailable,
    check_state_names,
    live_source,
    recorded_source,
    recorded_vehicle_backend,
    state_vector,
)
from sps_driving.ros import bagio, msgs

S = 1_000_000_000  # ns


def test_names_and_vectors():
    assert STATE_NAMES == ("speed_mps", "target_speed_mps")
    assert check_state_names(["target_speed_mps"]) == ("target_speed_mps",)
    for bad in (["gear"], ["speed_mps", "speed_mps"]):
        with pytest.raises(ValueError):
            check_state_names(bad)
    vector = state_vector(["target_speed_mps", "speed_mps"], {"speed_mps": 3, "target_speed_mps": 9.5, "other": 1})
    assert vector.dtype == np.float32 and vector.tolist() == [9.5, 3.0]
    assert state_vector([], None).shape == (0,)
    with pytest.raises(ValueError, match="none was given"):
        state_vector(["speed_mps"], {})
    with pytest.raises(ValueError, match="not a finite number"):
        state_vector(["speed_mps"], {"speed_mps": math.nan})


def test_where_each_input_is_read():
    twist, report = "geometry_msgs/msg/TwistStamped", "pacmod3_msgs/msg/VehicleSpeedRpt"
    assert live_source("speed_mps", "pacmod3") == (topics.PACMOD_SPEED_RPT, report)
    assert live_source("speed_mps", "topics") == (topics.VEHICLE_TWIST, twist)
    assert live_source("target_speed_mps", "pacmod3") == (topics.TARGET_SPEED, twist)
    car = {topics.PACMOD_SPEED_RPT: report, topics.VEHICLE_TWIST: twist}
    assert recorded_source("speed_mps", car) == (topics.PACMOD_SPEED_RPT, report)  # the drive-by-wire's own first
    assert recorded_source("speed_mps", {topics.VEHICLE_TWIST: "nav_msgs/msg/Odometry"}) is None  # another type
    assert recorded_source("target_speed_mps", car) is None
    assert recorded_vehicle_backend(car) == "pacmod3" and recorded_vehicle_backend({topics.VEHICLE_TWIST: twist}) == "topics"
    assert recorded_vehicle_backend({}) == "topics"


def test_speed_messages_decode_from_rclpy_and_bags():
    from pacmod3_msgs.msg import VehicleSpeedRpt

    assert msgs.speed_from_message(msgs.to_ros(msgs.twist_fields(4.5, 1))) == 4.5
    assert msgs.speed_from_message(bagio.to_bag(msgs.twist_fields(4.5, 1))) == 4.5
    assert msgs.speed_from_message(VehicleSpeedRpt(vehicle_speed=3.25, vehicle_speed_valid=True)) == 3.25
    assert msgs.speed_from_message(VehicleSpeedRpt(vehicle_speed=3.25, vehicle_speed_valid=False)) is None
    report = bagio.to_bag(msgs.Fields("pacmod3_msgs/msg/VehicleSpeedRpt", {"vehicle_speed": 2.0, "vehicle_speed_valid": True}))
    assert msgs.speed_from_message(report) == 2.0
    with pytest.raises(msgs.MessageError):
        msgs.speed_from_message(msgs.to_ros(msgs.lane_pose_fields(0.0, 0.0, 1)))


def test_a_frame_gets_the_value_nearest_its_stamp_within_the_age_limit():
    tracker = StateTracker({"speed_mps": 0.1, "target_speed_mps": 1.0}, fallback={"target_speed_mps": 4.0})
    with pytest.raises(StateUnavailable, match="no speed_mps received") as missing:
        tracker.at(10 * S)
    assert missing.value.kind == "missing"
    for stamp, speed in ((10 * S, 5.0), (10 * S + S // 5, 6.0), (10 * S + S // 10, 5.5)):  # out of order
        tracker.add("speed_mps", stamp, speed)
    assert tracker.at(10 * S + 30_000_000) == {"speed_mps": 5.0, "target_speed_mps": 4.0}  # the fallback target
    assert tracker.at(10 * S + 70_000_000)["speed_mps"] == 5.5
    assert tracker.at(10 * S + 290_000_000)["speed_mps"] == 6.0  # the nearest, 90 ms away
    with pytest.raises(StateUnavailable, match="speed_mps stale") as stale:
        tracker.at(10 * S + 350_000_000)
    assert stale.value.kind == "stale"
    tracker.add("speed_mps", 11 * S, None)  # the report said its speed is not valid
    with pytest.raises(StateUnavailable, match="not valid") as invalid:
        tracker.at(11 * S)
    assert invalid.value.kind == "invalid"
    # Once a target arrives it is read like the speed, and goes stale too.
    tracker.add("target_speed_mps", 10 * S, 9.0)
    assert tracker.at(10 * S)["target_speed_mps"] == 9.0
    tracker.add("speed_mps", 12 * S, 7.0)
    with pytest.raises(StateUnavailable, match="target_speed_mps stale"):
        tracker.at(12 * S)


def test_the_history_keeps_the_newest():
    tracker = StateTracker({"speed_mps": 0.05}, history=4)
    for k in range(10):
        tracker.add("speed_mps", k * S, float(k))
    assert tracker.at(9 * S)["speed_mps"] == 9.0
    with pytest.raises(StateUnavailable, match="stale"):
        tracker.at(2 * S)  # forgotten: the oldest kept is 6 s
