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


def test_autonomy_log_counts_overrides_per_hour_and_km():
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
    log.on_report(236 * s, "enabled", False, None, disabled_field="data=false")  # disengage button
    log.finish()
    summary = log.summary()
    assert [(t["event"], t.get("cause")) for t in summary["transitions"]] == [
        ("engaged", None), ("disengaged", "override"), ("engaged", None), ("disengaged", "disable")
    ]
    assert summary["transitions"][1]["fields"] == ["steering: override_active", "global: override_active"]
    assert summary["transitions"][3]["fields"] == ["enabled: data=false"]
    assert summary["interventions"] == 1
    assert summary["disengagements"] == {"fault": 0, "timeout": 0, "disable": 1}
    assert summary["autonomy_s"] == pytest.approx(136.0, abs=1e-6)
    assert summary["autonomy_km"] == pytest.approx(1.36)
    assert summary["total_km"] == pytest.approx(2.36)
    assert summary["interventions_per_hour"] == pytest.approx(1 / (136 / 3600))
    assert summary["interventions_per_km"] == pytest.approx(1 / 1.36)


MS = 1_000_000


def disengage_with(flags_at, engaged_ms=0, drop_ms=10_000, window_s=0.2):
    """One episode engaged at engaged_ms and ended by enable going off at drop_ms, with flag reports
    {time ms: (source, override, faults, timeouts)} around it; returns the disengagement."""
    log = AutonomyLog(window_s)
    events = {engaged_ms: ("global", False, (), ()), **flags_at}
    events.setdefault(drop_ms, ("global", False, (), ()))
    for ms in sorted(events):
        source, override, faults, timeouts = events[ms]
        enabled = engaged_ms <= ms < drop_ms if source == "global" else None
        log.on_report(ms * MS, source, enabled, override, faults, timeouts)
    log.on_report((drop_ms + 5_000) * MS, "global", False, False)  # long after: nothing set
    log.finish()
    return [t for t in log.summary()["transitions"] if t["event"] == "disengaged"]


def test_autonomy_log_cause_precedence_within_the_window():
    fault = {9_900: ("steering", False, ("pacmod_fault",), ()), 10_033: ("brake", False, (), ("command_timeout",))}
    assert disengage_with(fault) == [{
        "time_ns": 10_000 * MS, "event": "disengaged", "cause": "fault",
        "fields": ["steering: pacmod_fault"], "other_fields": ["brake: command_timeout"],
    }]
    # The driver's takeover wins over a fault seen with it, even when its flag arrives after enable went off.
    override = {**fault, 10_100: ("accel", True, (), ())}
    (t,) = disengage_with(override)
    assert t["cause"] == "override" and t["fields"] == ["accel: override_active"]
    assert t["other_fields"] == ["steering: pacmod_fault", "brake: command_timeout"]
    # A timeout flag seen only after enable went off, within the window, is the cause.
    (t,) = disengage_with({10_150: ("global", False, (), ("steering_can_timeout",))})
    assert (t["cause"], t["fields"]) == ("timeout", ["global: steering_can_timeout"])


def test_autonomy_log_disable_when_nothing_shows_in_the_window():
    # Outside the window on either side: not signs of this disengagement.
    (t,) = disengage_with({9_700: ("steering", False, ("vehicle_fault",), ()), 10_300: ("accel", True, (), ())})
    assert (t["cause"], t["fields"], t["other_fields"]) == ("disable", ["global: enabled=false"], [])
    # A flag set all along, since before the engagement, did not end autonomy.
    latched = {ms: ("turn", False, ("output_reported_fault",), ()) for ms in range(-550, 10_250, 100)}
    (t,) = disengage_with(latched)
    assert t["cause"] == "disable"
    # The same flag with a break during the episode counts from its new onset.
    latched[4_950] = ("turn", False, (), ())
    (t,) = disengage_with(latched)
    assert (t["cause"], t["fields"]) == ("fault", ["turn: output_reported_fault"])
    with pytest.raises(ValueError, match="cause_window_s"):
        AutonomyLog(math.nan)


def test_autonomy_log_open_episode_and_no_speed():
    log = AutonomyLog()
    log.on_report(0, "global", True, False)
    log.on_report(3_600_000_000_000, "global", True, False)
    log.finish()
    log.finish()
    summary = log.summary()
    assert summary["interventions"] == 0 and summary["autonomy_s"] == pytest.approx(3600)
    assert summary["disengagements"] == {"fault": 0, "timeout": 0, "disable": 0}
    assert summary["interventions_per_hour"] == 0 and summary["interventions_per_km"] is None
    assert summary["autonomy_km"] is None
