import math

import pytest

from sps_driving.core.control import (
    ControlLimits,
    Engagement,
    EngageState,
    PacmodLimits,
    StopReason,
    VehicleController,
    to_pacmod,
)

LIMITS = ControlLimits(
    max_road_wheel_angle_rad=0.3,
    max_steering_rate_rad_s=0.6,
    max_throttle=0.3,
    max_brake=0.8,
    stop_brake=0.5,
    max_command_age_s=0.2,
    max_camera_age_s=0.2,
    max_safety_age_s=0.5,
    max_command_latency_s=1.0,
    control_rate_hz=30.0,
)
DT = 1 / 30


def driving_controller(now=0.0):
    c = VehicleController(LIMITS, require_safety_monitor=False)
    c.on_camera_frame(now)
    return c


def test_no_command_is_a_controlled_stop():
    c = VehicleController(LIMITS)
    act = c.step(0.0)
    assert act.stopping and StopReason.NO_COMMAND in act.reasons and StopReason.CAMERA_TIMEOUT in act.reasons
    assert act.throttle == -LIMITS.stop_brake and act.steering_rad == 0.0


def test_limits_clip_throttle_brake_and_angle():
    c = driving_controller()
    c.on_command(0.0, 5.0, 1, 0.0)
    assert c.step(0.0).throttle == LIMITS.max_throttle
    c.on_command(0.0, -5.0, 2, 0.0)
    assert c.step(DT).throttle == -LIMITS.max_brake
    t = DT
    for _ in range(60):
        t += DT
        c.on_camera_frame(t)
        c.on_command(10.0, 0.0, 3, t)
        act = c.step(t)
    assert act.steering_rad == pytest.approx(LIMITS.max_road_wheel_angle_rad)


def test_steering_rate_limit_per_period():
    c = driving_controller()
    c.on_command(0.3, 0.1, 1, 0.0)
    first = c.step(0.0)
    assert first.steering_rad == pytest.approx(LIMITS.max_steering_rate_rad_s * DT)
    c.on_camera_frame(DT)
    second = c.step(DT)
    assert second.steering_rad - first.steering_rad == pytest.approx(LIMITS.max_steering_rate_rad_s * DT)
    # A late timer tick (1 s) allows at most two periods of steering change.
    c.on_command(-0.3, 0.1, 2, 1.0)
    c.on_camera_frame(1.0)
    third = c.step(1.0)
    assert second.steering_rad - third.steering_rad == pytest.approx(2 * LIMITS.max_steering_rate_rad_s * DT)


def test_stale_command_stops_within_one_period_and_holds_steering():
    c = driving_controller()
    c.on_command(0.02, 0.2, 7, 0.0)
    act = c.step(0.0)
    assert not act.stopping and act.source_stamp_ns == 7 and act.throttle == 0.2
    t = 0.0
    while t <= LIMITS.max_command_age_s + LIMITS.control_period_s:
        t += DT
        c.on_camera_frame(t)
        act = c.step(t)
        if t - 0.0 > LIMITS.max_command_age_s:
            assert act.reasons == (StopReason.COMMAND_TIMEOUT,)
            assert act.throttle == -LIMITS.stop_brake and act.steering_rad == pytest.approx(0.02)
        else:
            assert not act.stopping


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_command_stops_until_a_valid_one(bad):
    c = driving_controller()
    c.on_command(0.0, 0.2, 1, 0.0)
    assert not c.step(0.0).stopping
    assert c.on_command(bad, 0.1, 2, 0.01) is False
    act = c.step(0.02)
    assert StopReason.INVALID_COMMAND in act.reasons and math.isfinite(act.steering_rad)
    assert act.throttle == -LIMITS.stop_brake and c.invalid_commands == 1
    c.on_command(0.0, 0.1, 3, 0.03)
    assert not c.step(0.04).stopping


def test_camera_timeout_and_safety_stop_and_disengaged():
    c = driving_controller()
    c.on_command(0.0, 0.2, 1, 0.25)
    assert c.step(0.25).reasons == (StopReason.CAMERA_TIMEOUT,)
    c.on_camera_frame(0.26)
    c.on_safety_status(True, 0.26)
    assert c.step(0.27).reasons == (StopReason.SAFETY_STOP,)
    c.on_safety_status(False, 0.27)
    assert c.step(0.28, engaged=False).reasons == (StopReason.DISENGAGED,)
    assert not c.step(0.29).stopping


def test_limits_validation():
    with pytest.raises(ValueError, match="stop_brake"):
        ControlLimits(stop_brake=0.9, max_brake=0.8)
    with pytest.raises(ValueError, match="max_throttle"):
        ControlLimits(max_throttle=1.5)
    with pytest.raises(ValueError, match="max_command_age_s"):
        ControlLimits(max_command_age_s=math.nan)
    with pytest.raises(ValueError, match="unknown control limits"):
        ControlLimits.from_dict({"max_speed": 3})
    assert ControlLimits.from_dict({"max_throttle": 0.2}).max_throttle == 0.2


def test_engagement_handshake_override_and_timeout():
    e = Engagement(report_timeout_s=0.5)
    assert not e.enable and e.on_report(True, False, False, 0.0) is None
    e.request(True, 0.0)
    assert e.state is EngageState.ENGAGING and e.enable and e.clear_override
    assert e.on_report(False, False, False, 0.1) is None  # not yet enabled by the car
    assert e.on_report(True, False, False, 0.2) == "engaged"
    assert e.engaged and not e.clear_override
    assert e.on_report(True, True, False, 0.3) == "override"
    assert e.state is EngageState.DISENGAGED and e.interventions == 1
    # No automatic re-engage after an override.
    assert e.on_report(True, False, False, 0.4) is None and not e.engaged
    e.request(True, 0.5)
    e.on_report(True, False, False, 0.5)
    assert e.on_report(False, False, False, 0.6) == "disabled_by_vehicle" and e.interventions == 2
    e.request(True, 0.7)
    e.on_report(True, False, False, 0.7)
    assert e.check(1.0) is None
    assert e.check(1.3) == "report_timeout" and e.interventions == 2
    e.request(True, 1.4)
    e.on_report(True, False, False, 1.4)
    assert e.on_report(True, False, True, 1.5) == "fault" and e.interventions == 2


def test_an_engage_the_car_never_completes_is_dropped():
    e = Engagement(report_timeout_s=0.5, engage_timeout_s=2.0)
    e.request(True, 10.0)  # no report ever arrives
    assert e.check(11.9) is None and e.enable
    assert e.check(12.1) == "engage_timeout" and not e.enable and e.interventions == 0
    e.request(True, 20.0)  # reports arrive, but the car keeps an override active
    for t in (20.1, 20.6, 21.1, 21.6):
        assert e.on_report(False, True, False, t) is None and e.check(t) is None
    assert e.on_report(False, True, False, 22.1) is None and e.check(22.1) == "engage_timeout"
    with pytest.raises(ValueError, match="engage_timeout_s"):
        Engagement(0.5, engage_timeout_s=0.0)


def test_pacmod_mapping():
    pac = PacmodLimits(steering_ratio=14.8, max_steering_wheel_angle_rad=4.0)
    c = driving_controller()
    c.on_command(0.01, 0.25, 1, 0.0)
    cmd = to_pacmod(c.step(0.0), LIMITS, pac)
    assert cmd.steering_wheel_rad == pytest.approx(0.01 * 14.8)
    assert cmd.rotation_rate_rad_s == pytest.approx(LIMITS.max_steering_rate_rad_s * 14.8)
    assert (cmd.accel, cmd.brake) == (0.25, 0.0)
    stop = to_pacmod(VehicleController(LIMITS).step(0.0), LIMITS, pac)
    assert (stop.accel, stop.brake) == (0.0, LIMITS.stop_brake)
    from sps_driving.core.control import Actuation

    wide = to_pacmod(Actuation(0.3, -1.0, (), 1), LIMITS, pac)
    assert wide.steering_wheel_rad == 4.0 and wide.brake == LIMITS.max_brake


def test_silent_safety_monitor_stops_when_required():
    c = VehicleController(LIMITS, require_safety_monitor=True)
    c.on_camera_frame(0.0)
    c.on_command(0.0, 0.1, 1, 0.0)
    assert c.step(0.0).reasons == (StopReason.SAFETY_MONITOR_TIMEOUT,)
    c.on_safety_status(False, 0.0)
    assert not c.step(0.01).stopping
    c.on_camera_frame(0.6)
    c.on_command(0.0, 0.1, 2, 0.6)
    assert c.step(0.6).reasons == (StopReason.SAFETY_MONITOR_TIMEOUT,)


def test_command_from_a_late_frame_stops_until_a_timely_one():
    c = driving_controller()
    assert c.on_command(0.0, 0.2, 1, 0.0, latency_s=0.1)
    assert not c.step(0.0).stopping
    assert c.on_command(0.0, 0.2, 2, 0.01, latency_s=1.5) is False
    act = c.step(0.02)
    assert act.reasons == (StopReason.LATE_COMMAND,) and c.late_commands == 1
    assert c.on_command(0.0, 0.2, 3, 0.03, latency_s=0.2)
    assert not c.step(0.04).stopping
    off = VehicleController(ControlLimits(max_command_latency_s=0.0), require_safety_monitor=False)
    off.on_camera_frame(0.0)
    assert off.on_command(0.0, 0.1, 1, 0.0, latency_s=1e9)  # replaying old stamps
    with pytest.raises(ValueError, match="non-negative"):
        ControlLimits(max_command_latency_s=-1.0)
