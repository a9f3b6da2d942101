import math

import pytest

from sps_driving.core.failures import Failure, FailureThresholds
from sps_driving.core.monitor import AutonomyLog, MonitorConfig, SafetyMonitor

CFG = MonitorConfig(thresholds=FailureThresholds(), max_input_age_s=0.5, required_inputs=("lane",))


def test_missing_and_stale_lane_requests_stop():
    m = SafetyMonitor(CFG)
    status = m.step(0.0)
    assert status.stale_inputs == ("lane",) and status.stop_requested and not status.failures
    m.on_lane(0.0, 0.0, 1.0)
    assert not m.step(1.2).stop_requested
    assert m.step(1.6).stale_inputs == ("lane",)


def test_failures_edges_and_one_intervention_per_episode():
    m = SafetyMonitor(CFG)
    m.on_lane(2.0, math.radians(40), 0.0)
    s = m.step(0.0)
    assert set(s.failures) == {Failure.LANE, Failure.HEADING} and set(s.new_failures) == set(s.failures)
    assert s.stop_requested and s.interventions == 1
    m.on_lane(2.0, 0.0, 0.1)
    s = m.step(0.1)
    assert s.failures == (Failure.LANE,) and s.new_failures == () and s.interventions == 1
    m.on_lane(0.0, 0.0, 0.2)
    s = m.step(0.2)
    assert not s.failures and not s.stop_requested
    m.on_lane(0.0, 0.0, 0.3)
    m.on_obstacle(0.5, 0.3)
    s = m.step(0.3)
    assert s.new_failures == (Failure.COLLISION,) and s.interventions == 2
    assert s.failure_counts == {Failure.LANE: 1, Failure.HEADING: 1, Failure.COLLISION: 1}


def test_invalid_inputs_are_counted_not_failures():
    m = SafetyMonitor(CFG)
    m.on_lane(0.0, 0.0, 0.0)
    assert m.on_lane(math.nan, 0.0, 0.1) is False
    assert m.on_obstacle(math.nan, 0.1) is False and m.on_obstacle(-1.0, 0.1) is False
    assert m.on_obstacle(math.inf, 0.1) is True
    s = m.step(0.2)
    assert m.invalid_inputs == 3 and not s.failures and not s.stop_requested
    # The bad lane sample did not refresh the input: it goes stale from the last good one.
    assert m.step(0.55).stale_inputs == ("lane",)


def test_stale_obstacle_gap_is_not_a_collision():
    m = SafetyMonitor(MonitorConfig(required_inputs=("lane", "obstacle")))
    m.on_lane(0.0, 0.0, 0.0)
    m.on_obstacle(0.2, 0.0)
    assert m.step(0.0).failures == (Failure.COLLISION,)
    m.on_lane(0.0, 0.0, 1.0)
    s = m.step(1.0)
    assert not s.failures and s.stale_inputs == ("obstacle",) and s.stop_requested


def test_config_validation():
    with pytest.raises(ValueError, match="required inputs"):
        MonitorConfig(required_inputs=("radar",))
    with pytest.raises(ValueError, match="max_input_age_s"):
        MonitorConfig(max_input_age_s=0)


def test_autonomy_log_counts_takeovers_per_hour_and_km():
    s = 1_000_000_000
    log = AutonomyLog()
    log.on_speed(0, 10.0)
    log.on_report(0, "enabled", True, None)  # enabled topic: no override flag
    log.on_report(0, "global", True, False)
    log.on_speed(100 * s, 10.0)  # 1 km in autonomy
    log.on_report(100 * s, "steering", None, True)  # driver grabs the wheel
    log.on_report(100 * s + 10, "global", False, True)  # PACMod disables: same takeover
    log.on_speed(200 * s, 10.0)  # 1 km manual
    log.on_report(200 * s, "steering", None, False)
    log.on_report(200 * s, "global", True, False)  # re-engaged
    log.on_speed(236 * s, 10.0)
    log.on_report(236 * s, "enabled", False, None)  # disengage button
    log.finish()
    summary = log.summary()
    assert [t["event"] for t in summary["transitions"]] == ["engaged", "override", "engaged", "disabled"]
    assert summary["interventions"] == 2 and summary["overrides"] == 1 and summary["disables"] == 1
    assert summary["autonomy_s"] == pytest.approx(136.0, abs=1e-6)
    assert summary["autonomy_km"] == pytest.approx(1.36)
    assert summary["total_km"] == pytest.approx(2.36)
    assert summary["interventions_per_hour"] == pytest.approx(2 / (136 / 3600))
    assert summary["interventions_per_km"] == pytest.approx(2 / 1.36)


def test_autonomy_log_open_episode_and_no_speed():
    log = AutonomyLog()
    log.on_report(0, "global", True, False)
    log.on_report(3_600_000_000_000, "global", True, False)
    log.finish()
    log.finish()
    summary = log.summary()
    assert summary["interventions"] == 0 and summary["autonomy_s"] == pytest.approx(3600)
    assert summary["interventions_per_hour"] == 0 and summary["interventions_per_km"] is None
    assert summary["autonomy_km"] is None
