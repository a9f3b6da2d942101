"""Property-based tests of the vehicle interface's decisions (sps_driving.core.control): 10,000
generated sequences of commands (NaN, infinite, out of range, late), drive-by-wire reports
(overrides, faults, timeouts, missing), speed reports (either direction), gear reports, stop requests, camera frames, duplicate
publishers, clock steps, engage, disengage and re-arm requests, and control ticks at irregular
times. Invariants, checked at every tick against a model of the inputs kept by the test:
- every command is finite and within the configured limits;
- a command that drives (enabled, no stop reason) only ever goes out while every input is fresh,
  so a stale or missing input gives a stop at the first tick after its limit (ticks come every
  control period on the car);
- the car is engaged only after an accepted engage request (an edge) and only at a tick where
  steering, accelerator and brake all report enabled, fresh, with no override, fault or timeout;
- after an override, nothing engages again before a re-arm;
- and the sequences do reach engaged driving (else the invariants above would hold vacuously).
"""

import math
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sps_driving.core.control import SYSTEMS, ControlLimits, EngageState, GlobalStatus, SystemStatus, VehicleLogic

LIMITS = ControlLimits()
RATIO = 14.8
PERIOD = LIMITS.control_period_s

floats = st.one_of(st.floats(-2.0, 2.0), st.sampled_from([math.nan, math.inf, -math.inf, 1e9, -1e9, 0.0]))
flags = st.booleans()
INPUTS = ("command", "camera", "safety", "failsafe", "speed", "gear", "steering", "accel", "brake", "global")
report = st.tuples(st.just("report"), st.sampled_from(SYSTEMS + ("global",)), flags, flags, flags, flags, floats)
events = st.one_of(
    # Everything fresh and fine but (maybe) one input: engaged stretches happen, and one input goes stale.
    st.tuples(st.just("healthy"), st.sampled_from((None,) * 3 + INPUTS)),
    st.tuples(st.just("healthy"), st.sampled_from((None,) * 3 + INPUTS)),
    st.tuples(st.just("engage")),
    st.tuples(st.just("engage")),
    st.tuples(st.just("override"), st.sampled_from(SYSTEMS + ("global",))),
    st.tuples(st.just("command"), floats, floats, st.sampled_from([0.05, 0.05, 0.5, 2.0, -1.0])),
    st.tuples(st.just("camera")),
    st.tuples(st.just("safety"), flags),
    st.tuples(st.just("failsafe"), flags),
    report,
    st.tuples(st.just("speed"), st.one_of(st.floats(-15.0, 15.0), st.just(math.nan)), flags),
    st.tuples(st.just("gear"), flags),
    st.tuples(st.just("duplicates"), flags),
    st.tuples(st.just("clock"), st.sampled_from([0.0, 0.0, 0.0, 5.0, -5.0])),
    st.tuples(st.just("disengage")),
    st.tuples(st.just("rearm")),
)
# Time advance: mostly one control period (as on the car), sometimes a stall.
advance = st.one_of(st.just(PERIOD), st.just(PERIOD), st.floats(0.0, PERIOD), st.floats(0.0, 0.6))
step = st.tuples(advance, events, st.booleans())  # time advance, event, tick after it
sequences = st.tuples(st.booleans(), st.lists(step, min_size=1, max_size=120))


class InputModel:
    """The test's own record of when each input was last fresh and valid."""

    def __init__(self):
        self.command_s = self.camera_s = self.safety_s = self.failsafe_s = self.speed_s = self.gear_s = None
        self.safety_stop = self.failsafe_active = self.command_bad = False
        self.forward_gear = True
        self.reports = {}  # name -> (time, enabled, override, fault, timeout)
        self.duplicates = False
        self.jump_s = None

    def fresh(self, time_s, limit, now):
        return time_s is not None and now - time_s <= limit

    def inputs_fresh(self, now, logic):
        lim = LIMITS
        ok = (
            self.fresh(self.command_s, lim.max_command_age_s, now) and not self.command_bad
            and self.fresh(self.camera_s, lim.max_camera_age_s, now)
            and self.fresh(self.safety_s, lim.max_safety_age_s, now) and not self.safety_stop
            and self.fresh(self.failsafe_s, lim.max_failsafe_age_s, now) and not self.failsafe_active
            and self.fresh(self.speed_s, lim.max_report_age_s, now)
            and self.fresh(self.gear_s, lim.max_report_age_s, now) and self.forward_gear
            and all(self.fresh(self.reports.get(n, (None,))[0], lim.max_report_age_s, now) for n in SYSTEMS + ("global",))
            and not self.duplicates
            and not (self.jump_s is not None and now - self.jump_s <= lim.max_command_age_s)
        )
        return ok

    def systems_ready(self, now):
        for name in SYSTEMS:
            if name not in self.reports:
                return False
            t, enabled, override, fault, timeout = self.reports[name]
            if not (enabled and not override and not fault and not timeout and now - t <= LIMITS.max_report_age_s):
                return False
        t, _, override, fault, timeout = self.reports.get("global", (None, False, True, True, True))
        return t is not None and now - t <= LIMITS.max_report_age_s and not (override or fault or timeout)


REACHED = Counter()  # ticks of the generated sequences: "engaged", "driving"


def test_vehicle_logic_invariants():
    REACHED.clear()
    check_vehicle_logic_invariants()
    assert REACHED["driving"] > 100, REACHED  # about 500 ticks of engaged driving in 10,000 sequences


@settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequences)
def check_vehicle_logic_invariants(sequence):
    latch, steps = sequence
    logic = VehicleLogic(LIMITS, RATIO, latch_stops=latch)
    model = InputModel()
    now = 100.0
    ros_ns = 10**18
    engage_edge = False  # an accepted engage request since the last disengaged tick
    needs_rearm = False
    for advance, event, tick in steps:
        now += advance
        ros_ns += int(advance * 1e9)
        kind = event[0]
        if kind == "command":
            _, steering, throttle, latency = event
            accepted = logic.on_command(steering, throttle, 1, now, latency)
            if accepted:
                model.command_s, model.command_bad = now, False
            else:
                model.command_bad = True
        elif kind == "camera":
            logic.on_camera(now)
            model.camera_s = now
        elif kind == "safety":
            logic.on_safety(event[1], now)
            model.safety_s, model.safety_stop = now, event[1]
        elif kind == "failsafe":
            logic.on_failsafe(event[1], now)
            model.failsafe_s, model.failsafe_active = now, event[1]
        elif kind == "report":
            _, name, enabled, override, fault, timeout, output = event
            was_engaged = logic.state is EngageState.ENGAGED
            if name == "global":
                logic.on_global_report(GlobalStatus(enabled, override, fault, timeout), now)
            else:
                logic.on_system_report(name, SystemStatus(enabled, override, fault, timeout, output), now)
            model.reports[name] = (now, enabled, override, fault, timeout)
            if was_engaged and override and not fault and not timeout:
                needs_rearm = True
        elif kind == "speed":
            logic.on_speed(event[1], event[2], now)
            if event[2] and math.isfinite(event[1]):
                model.speed_s = now
        elif kind == "gear":
            logic.on_gear(event[1], now)
            model.gear_s, model.forward_gear = now, event[1]
        elif kind == "duplicates":
            logic.on_duplicates({"/sps/command": 2} if event[1] else {})
            model.duplicates = event[1]
        elif kind == "clock":
            ros_ns += int(event[1] * 1e9)
            if logic.on_clock(ros_ns, now):
                model.jump_s = now
        elif kind == "engage":
            before = logic.state
            ok, _ = logic.request_engage(now)
            if ok and before is EngageState.DISENGAGED:
                assert not needs_rearm, "engaged after an override without a re-arm"
                engage_edge = True
        elif kind == "disengage":
            logic.request_disengage()
        elif kind == "rearm":
            ok, message = logic.rearm()
            if ok:
                needs_rearm = False
        elif kind == "override":  # the safety driver takes over one system (or all, on the global report)
            was_engaged = logic.state is EngageState.ENGAGED
            name = event[1]
            if name == "global":
                logic.on_global_report(GlobalStatus(True, True), now)
            else:
                logic.on_system_report(name, SystemStatus(True, True), now)
            model.reports[name] = (now, True, True, False, False)
            needs_rearm = needs_rearm or was_engaged
        elif kind == "healthy":  # everything fresh and fine at once, except event[1]
            skip = event[1]
            for name in SYSTEMS + ("global",):
                if name != skip:
                    if name == "global":
                        logic.on_global_report(GlobalStatus(True), now)
                    else:
                        logic.on_system_report(name, SystemStatus(True), now)
                    model.reports[name] = (now, True, False, False, False)
            for name, feed in (
                ("speed", lambda: logic.on_speed(3.0, True, now)),
                ("gear", lambda: logic.on_gear(True, now)),
                ("camera", lambda: logic.on_camera(now)),
                ("safety", lambda: logic.on_safety(False, now)),
                ("failsafe", lambda: logic.on_failsafe(False, now)),
                ("command", lambda: logic.on_command(0.1, 0.2, 1, now, 0.05)),
            ):
                if name != skip:
                    feed()
                    setattr(model, name + "_s", now)
            model.safety_stop = model.safety_stop and skip == "safety"
            model.failsafe_active = model.failsafe_active and skip == "failsafe"
            model.command_bad = model.command_bad and skip == "command"
            model.forward_gear = model.forward_gear or skip != "gear"
        if not tick:
            continue
        was = logic.state
        cmd = logic.tick(now)
        # Every command finite and within limits.
        assert math.isfinite(cmd.steering_rad) and math.isfinite(cmd.throttle)
        assert abs(cmd.steering_rad) <= LIMITS.max_road_wheel_angle_rad + 1e-12
        assert -LIMITS.max_brake <= cmd.throttle <= LIMITS.max_throttle
        # Driving only with every input fresh: anything stale is a stop at this tick.
        if cmd.enable and not cmd.stopping and cmd.state is EngageState.ENGAGED:
            assert model.inputs_fresh(now, logic), "drove on a stale or invalid input"
            REACHED["driving"] += 1
        if cmd.stopping and cmd.state is EngageState.ENGAGED:
            assert cmd.throttle == -LIMITS.stop_brake and cmd.enable
        if cmd.state is not EngageState.ENGAGED:
            assert cmd.throttle <= 0.0
        # Engaged only after an edge, and only with every system ready.
        if cmd.state is EngageState.ENGAGED and was is not EngageState.ENGAGED:
            assert was is EngageState.ENGAGING and engage_edge
            assert model.systems_ready(now)
            engage_edge = False
        if cmd.state is EngageState.DISENGAGED:
            engage_edge = False
        if needs_rearm:
            assert cmd.state is EngageState.DISENGAGED
