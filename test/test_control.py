"""The vehicle interface's decisions (sps_driving.core.control) with plain floats and steady times."""

import math

import pytest

from sps_driving.core.control import (
    SPEED_CAP_MAX_BRAKE,
    SYSTEMS,
    ControlLimits,
    EngageState,
    Event,
    GlobalStatus,
    StopReason,
    SystemStatus,
    VehicleCommand,
    VehicleLogic,
    capped_throttle,
    to_pacmod,
)
from sps_driving.core.failsafe import Failsafe, FailsafeState
from sps_driving.sim.pacmod import SHIFT_REVERSE, PacmodStandIn

LIMITS = ControlLimits(
    max_road_wheel_angle_rad=0.3,
    max_steering_rate_rad_s=0.6,
    max_throttle=0.3,
    max_brake=0.8,
    stop_brake=0.5,
    max_speed_mps=8.0,
    overspeed_margin_mps=2.0,
    max_command_age_s=0.2,
    max_camera_age_s=0.2,
    max_safety_age_s=0.5,
    max_failsafe_age_s=0.5,
    max_report_age_s=0.2,
    max_command_latency_s=1.0,
    max_clock_jump_s=0.2,
    engage_timeout_s=2.0,
    exit_brake_s=0.5,
    control_rate_hz=30.0,
)
DT = 1 / 30
RATIO = 14.8


class Car:
    """Feeds a VehicleLogic everything it needs, as a healthy car and graph would."""

    def __init__(self, logic, steering_wheel_rad=0.0, speed=5.0):
        self.logic = logic
        self.enabled = False
        self.override = self.fault = self.timeout = False
        self.steering_wheel_rad = steering_wheel_rad
        self.speed = speed
        self.forward_gear = True  # None: no shift report
        self.command = (0.05, 0.2)

    def feed(self, t, command=True, camera=True, reports=True, safety=True):
        if reports:
            status = SystemStatus(self.enabled, self.override, self.fault, self.timeout)
            for s in SYSTEMS:
                out = self.steering_wheel_rad if s == "steering" else 0.0
                self.logic.on_system_report(s, SystemStatus(status.enabled, status.override, status.fault, status.timeout, out), t)
            self.logic.on_global_report(GlobalStatus(self.enabled, self.override, self.fault, self.timeout), t)
            self.logic.on_speed(self.speed, True, t)
            if self.forward_gear is not None:
                self.logic.on_gear(self.forward_gear, t)
        if safety:
            self.logic.on_safety(False, t)
            self.logic.on_failsafe(False, t)
        if camera:
            self.logic.on_camera(t)
        if command:
            self.logic.on_command(*self.command, int(t * 1e9), t, latency_s=0.05)

    def run(self, t0, t1, **feed):
        """Tick every period from t0 to t1 (exclusive); the car follows `enable`."""
        out = []
        t = t0
        while t < t1 - 1e-9:
            self.feed(t, **feed)
            cmd = self.logic.tick(t)
            self.enabled = cmd.enable and not self.override and not self.fault
            out.append(cmd)
            t += DT
        return out


def engaged(now=0.0, **kw):
    logic = VehicleLogic(LIMITS, RATIO, **kw)
    car = Car(logic)
    car.feed(now)
    ok, why = logic.request_engage(now)
    assert ok, why
    car.run(now, now + 3 * DT)
    assert logic.state is EngageState.ENGAGED
    return logic, car


def test_limits_validation():
    with pytest.raises(ValueError, match="stop_brake"):
        ControlLimits(stop_brake=0.9, max_brake=0.8)
    with pytest.raises(ValueError, match="max_throttle"):
        ControlLimits(max_throttle=1.5)
    with pytest.raises(ValueError, match="max_command_age_s"):
        ControlLimits(max_command_age_s=math.nan)
    with pytest.raises(ValueError, match="non-negative"):
        ControlLimits(max_command_latency_s=-1.0)
    with pytest.raises(ValueError, match="unknown control limits"):
        ControlLimits.from_dict({"max_sped": 3})
    assert ControlLimits.from_dict({"max_throttle": 0.2}).max_throttle == 0.2
    with pytest.raises(ValueError, match="steering_ratio"):
        VehicleLogic(LIMITS, 0.0)


def test_engage_needs_ready_inputs_and_reports():
    logic = VehicleLogic(LIMITS, RATIO)
    ok, why = logic.request_engage(0.0)
    assert not ok and "no fresh report" in why and "no_command" in why
    car = Car(logic)
    car.feed(0.0)
    car.fault = True
    car.feed(0.01)
    ok, why = logic.request_engage(0.01)
    assert not ok and "fault reported" in why
    car.fault = False
    car.feed(0.02)
    assert logic.request_engage(0.02) == (True, "engaging")
    assert logic.request_engage(0.03)[1] == "already engaging"


def test_engaging_holds_measured_steering_without_brake_then_drives_from_there():
    logic = VehicleLogic(LIMITS, RATIO)
    car = Car(logic, steering_wheel_rad=0.2 * RATIO)  # the wheel is at 0.2 rad road-wheel angle
    car.command = (0.0, 0.2)
    car.feed(0.0)
    logic.request_engage(0.0)
    first = logic.tick(0.0)
    assert first.enable and first.clear_override and first.state is EngageState.ENGAGING
    assert first.steering_rad == pytest.approx(0.2) and first.throttle == 0.0  # no jump to 0, no brake jab
    car.enabled = True
    car.feed(DT)
    second = logic.tick(DT)
    assert second.state is EngageState.ENGAGED and not second.clear_override
    assert second.steering_rad == pytest.approx(0.2 - LIMITS.max_steering_rate_rad_s * DT)  # rate-limited from 0.2
    assert second.throttle == pytest.approx(0.2)


def test_engaged_only_when_steering_accel_and_brake_all_enabled():
    logic = VehicleLogic(LIMITS, RATIO)
    car = Car(logic)
    car.feed(0.0)
    logic.request_engage(0.0)
    for system in SYSTEMS:
        logic.on_system_report(system, SystemStatus(system != "brake"), 0.01)
    logic.on_global_report(GlobalStatus(True), 0.01)  # "enabled" = any system
    assert logic.tick(0.01).state is EngageState.ENGAGING
    logic.on_system_report("brake", SystemStatus(True), 0.02)
    assert logic.tick(0.02).state is EngageState.ENGAGED


def test_engagement_the_car_never_completes_is_dropped():
    logic = VehicleLogic(LIMITS, RATIO)
    car = Car(logic)
    car.feed(0.0)
    logic.request_engage(0.0)
    t = 0.0
    while t < LIMITS.engage_timeout_s + 2 * DT:
        car.feed(t)  # reports keep saying "not enabled"
        cmd = logic.tick(t)
        t += DT
    assert cmd.state is EngageState.DISENGAGED and not cmd.enable and logic.last_event == Event.ENGAGE_TIMEOUT.value


def test_limits_and_speed_cap():
    logic, car = engaged()
    car.command = (0.9, 0.9)  # over the configured limits, inside the physical range: clipped
    cmds = car.run(0.1, 1.5)
    assert max(c.throttle for c in cmds) == pytest.approx(LIMITS.max_throttle)
    assert cmds[-1].steering_rad == pytest.approx(LIMITS.max_road_wheel_angle_rad)
    assert all(abs(b.steering_rad - a.steering_rad) <= LIMITS.max_steering_rate_rad_s * DT + 1e-12 for a, b in zip(cmds, cmds[1:]))
    car.speed = LIMITS.max_speed_mps
    assert car.run(1.5, 1.6)[-1].throttle == 0.0  # at the cap: no accelerator
    car.command = (0.0, -0.6)
    assert car.run(1.6, 1.7)[-1].throttle == pytest.approx(-0.6)  # brake still passes
    car.speed = LIMITS.max_speed_mps + LIMITS.overspeed_margin_mps + 0.5
    last = car.run(1.7, 1.8)[-1]
    assert StopReason.OVERSPEED in last.reasons and last.throttle == -LIMITS.stop_brake


def test_the_safety_monitors_slow_down_caps_the_speed_at_its_scale_of_the_cruise_target():
    logic, car = engaged()
    car.speed, car.command = 5.0, (0.0, 0.3)
    assert car.run(0.1, 0.2)[-1].throttle == pytest.approx(0.3)  # not slowed: the policy's throttle
    assert logic.on_cruise_scale(0.5)
    assert logic.speed_cap_mps == pytest.approx(0.5 * LIMITS.max_speed_mps)  # no target yet: half the top speed
    assert logic.on_target_speed(6.0) and logic.speed_cap_mps == pytest.approx(3.0)
    assert car.run(0.2, 0.3)[-1].throttle == -SPEED_CAP_MAX_BRAKE  # 2 m/s over the cap: the gentle brake
    car.speed = 3.0
    assert car.run(0.3, 0.4)[-1].throttle == 0.0  # at the cap: no accelerator
    for bad in (0.0, 1.5, math.nan):
        assert not logic.on_cruise_scale(bad)
    assert not logic.on_target_speed(-1.0) and not logic.on_target_speed(math.inf)
    assert logic.speed_cap_mps == pytest.approx(3.0)  # the bad ones change nothing
    assert logic.on_cruise_scale(1.0) and logic.speed_cap_mps == LIMITS.max_speed_mps
    assert car.run(0.4, 0.5)[-1].throttle == pytest.approx(0.3)


def test_the_speed_cap_holds_in_reverse_too():
    logic, car = engaged()
    car.speed = -LIMITS.max_speed_mps  # PACMod's vehicle_speed is signed
    assert car.run(0.1, 0.2)[-1].throttle == 0.0
    car.speed = -(LIMITS.max_speed_mps + LIMITS.overspeed_margin_mps + 0.5)
    last = car.run(0.2, 0.3)[-1]
    assert StopReason.OVERSPEED in last.reasons and last.throttle == -LIMITS.stop_brake


def test_no_engagement_and_a_controlled_stop_without_a_fresh_forward_gear():
    logic = VehicleLogic(LIMITS, RATIO)
    car = Car(logic)
    car.forward_gear = False  # in reverse (or park, neutral)
    car.feed(0.0)
    ok, why = logic.request_engage(0.0)
    assert not ok and "gear_not_forward" in why
    car.forward_gear = True
    car.feed(0.01)
    assert logic.request_engage(0.01) == (True, "engaging")
    logic, car = engaged()
    car.forward_gear = None  # the shift report stops
    cmds = car.run(0.1, 0.1 + LIMITS.max_report_age_s + 2 * DT)
    assert StopReason.GEAR_NOT_FORWARD in cmds[-1].reasons and cmds[-1].throttle == -LIMITS.stop_brake
    assert all(StopReason.GEAR_NOT_FORWARD not in c.reasons for c in cmds[:5])
    logic, car = engaged()
    car.forward_gear = False
    last = car.run(0.1, 0.1 + DT)[-1]
    assert StopReason.GEAR_NOT_FORWARD in last.reasons and last.throttle == -LIMITS.stop_brake
    assert StopReason.GEAR_NOT_FORWARD not in engaged(require_forward_gear=False)[1].run(1.0, 1.1)[-1].reasons


@pytest.mark.parametrize(
    "silenced, reason, limit",
    [
        ("command", StopReason.COMMAND_TIMEOUT, LIMITS.max_command_age_s),
        ("camera", StopReason.CAMERA_TIMEOUT, LIMITS.max_camera_age_s),
        ("reports", StopReason.REPORT_TIMEOUT, LIMITS.max_report_age_s),
        ("safety", StopReason.SAFETY_MONITOR_TIMEOUT, LIMITS.max_safety_age_s),
    ],
)
def test_a_silent_input_latches_a_controlled_stop_within_one_period(silenced, reason, limit):
    logic, car = engaged()
    car.command = (0.1, 0.2)
    driving = car.run(0.1, 0.5)[-1]
    assert not driving.stopping and driving.throttle == pytest.approx(0.2)
    silent_from = 0.5
    cmds = car.run(silent_from, silent_from + limit + 2 * DT, **{silenced: False})
    t = silent_from
    for cmd in cmds:
        if t - (silent_from - DT) > limit + DT:
            assert reason in cmd.reasons and cmd.throttle == -LIMITS.stop_brake and cmd.hazards and cmd.enable
            assert cmd.steering_rad == pytest.approx(driving.steering_rad, abs=0.05)
        t += DT
    assert reason in cmds[-1].reasons
    # The input comes back: the stop holds until the safety driver disengages.
    back = car.run(cmds and silent_from + limit + 2 * DT, 2.0)
    assert all(c.throttle == -LIMITS.stop_brake and reason in c.reasons for c in back)
    assert logic.request_disengage() == (True, "disengaged")
    assert not car.run(2.0, 2.1)[-1].enable


def test_a_latched_stop_ends_with_its_engagement_even_without_a_tick_between():
    logic, car = engaged()
    assert car.run(0.1, 0.6, command=False)[-1].stopping  # command_timeout latched
    car.run(0.6, 1.0)  # the command is back; the stop holds
    assert logic.tick(1.0).stopping
    # Disengage and engage again within one control period, as two quick service calls can.
    assert logic.request_disengage() == (True, "disengaged")
    assert logic.request_engage(1.0) == (True, "engaging")
    cmds = car.run(1.0, 1.0 + 3 * DT)
    assert logic.state is EngageState.ENGAGED and not cmds[-1].stopping and cmds[-1].reasons == ()


def test_without_latching_a_replay_sees_the_stack_resume():
    logic, car = engaged(latch_stops=False)
    car.run(0.1, 0.3, command=False)
    assert car.run(0.3, 0.4, command=False)[-1].stopping
    assert not car.run(0.4, 0.5)[-1].stopping


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1.5, -5.0])
def test_non_finite_or_impossible_command_stops(bad):
    logic, car = engaged()
    assert logic.on_command(bad, 0.1, 2, 0.2) is False
    assert logic.on_command(0.0, bad * 2, 2, 0.2) is False
    cmd = logic.tick(0.2)
    assert StopReason.INVALID_COMMAND in cmd.reasons and math.isfinite(cmd.steering_rad) and logic.invalid_commands == 2


def test_late_and_future_commands_stop():
    logic, car = engaged()
    assert logic.on_command(0.0, 0.2, 2, 0.2, latency_s=1.5) is False
    assert StopReason.LATE_COMMAND in logic.tick(0.2).reasons and logic.late_commands == 1
    logic2, _ = engaged()
    assert logic2.on_command(0.0, 0.2, 2, 0.2, latency_s=-1.0) is False  # stamped in the future: a clock step
    off = VehicleLogic(ControlLimits(max_command_latency_s=0.0), RATIO)
    assert off.on_command(0.0, 0.1, 1, 0.0, latency_s=1e9)  # replaying old stamps


def test_clock_jump_either_way_stops_and_the_steady_watchdog_keeps_ticking():
    for jump_s in (-3600.0, 3600.0):
        logic, car = engaged()
        ros_ns = 10**18
        t = 0.2
        for _ in range(5):
            assert not logic.on_clock(ros_ns, t)
            car.feed(t)
            assert not logic.tick(t).stopping
            ros_ns += int(DT * 1e9)
            t += DT
        assert logic.on_clock(ros_ns + int(jump_s * 1e9), t)
        car.feed(t)
        cmd = logic.tick(t)
        assert StopReason.CLOCK_JUMP in cmd.reasons and cmd.throttle == -LIMITS.stop_brake


def test_safety_and_failsafe_stop_requests():
    logic, car = engaged()
    logic.on_safety(True, 0.2)
    assert StopReason.SAFETY_STOP in logic.tick(0.2).reasons
    logic, car = engaged()
    logic.on_failsafe(True, 0.2)
    assert StopReason.FAILSAFE_ACTIVE in logic.tick(0.2).reasons
    logic, car = engaged()
    car.run(0.1, 1.0, safety=False)
    assert StopReason.FAILSAFE_TIMEOUT in logic.tick(1.0).reasons


def test_duplicate_publishers_stop_and_block_engagement():
    logic, car = engaged()
    logic.on_duplicates({"/safety/stop_request": 2})
    assert StopReason.DUPLICATE_PUBLISHER in logic.tick(0.2).reasons
    logic.request_disengage()
    car.run(0.2, 0.3)
    ok, why = logic.request_engage(0.3)
    assert not ok and "duplicate_publisher" in why


def test_override_disengages_counts_and_locks_out_until_rearmed():
    logic, car = engaged()
    car.override = True
    car.feed(0.2)
    assert logic.state is EngageState.DISENGAGED and logic.interventions == 1 and logic.locked_out
    assert logic.last_event == Event.OVERRIDE.value
    car.override = False
    car.run(0.2, 0.5)
    ok, why = logic.request_engage(0.5)
    assert not ok and "re-arm" in why
    assert logic.rearm() == (True, "re-armed")
    assert logic.request_engage(0.5) == (True, "engaging")


def test_an_override_while_engaging_aborts_once_the_old_flag_was_cleared():
    logic = VehicleLogic(LIMITS, RATIO)
    car = Car(logic)
    car.override = True  # left set from the last takeover: engaging clears it
    car.feed(0.0)
    assert logic.request_engage(0.0) == (True, "engaging")
    cmds = car.run(0.0, 0.2)
    assert logic.state is EngageState.ENGAGING and all(c.clear_override for c in cmds) and logic.interventions == 0
    car.override = False
    car.feed(0.2)
    car.override = True  # the safety driver brakes to abort the engagement
    car.feed(0.23)
    assert logic.state is EngageState.DISENGAGED and logic.last_event == Event.ENGAGE_ABORTED.value
    assert logic.interventions == 0 and logic.locked_out  # the car never drove: no intervention
    assert not logic.tick(0.26).enable
    car.override = False
    car.feed(0.3)
    assert not logic.request_engage(0.3)[0] and logic.rearm() == (True, "re-armed")


@pytest.mark.parametrize("flag, event", [("fault", Event.FAULT), ("timeout", Event.CAN_TIMEOUT)])
def test_fault_and_timeout_disengage_without_counting_an_intervention(flag, event):
    logic, car = engaged()
    setattr(car, flag, True)
    car.feed(0.2)
    assert logic.state is EngageState.DISENGAGED and logic.last_event == event.value
    assert logic.interventions == 0 and not logic.locked_out and logic.disengagements == {event.value: 1}


def test_disengaged_follows_the_measured_steering_and_sends_no_enable():
    logic = VehicleLogic(LIMITS, RATIO)
    car = Car(logic, steering_wheel_rad=-0.1 * RATIO)
    car.feed(0.0)
    cmd = logic.tick(0.0)
    assert not cmd.enable and cmd.steering_rad == pytest.approx(-0.1) and StopReason.DISENGAGED in cmd.reasons


def test_exit_brakes_then_disables():
    logic, car = engaged()
    car.run(0.1, 0.3)
    cmds = logic.exit_commands()
    braking = [c for c in cmds if c.enable]
    assert len(braking) == math.ceil(LIMITS.exit_brake_s * LIMITS.control_rate_hz)
    assert all(c.throttle == -LIMITS.stop_brake and c.hazards for c in braking)
    assert cmds[: len(braking)] == braking and not any(c.enable for c in cmds[len(braking):])
    assert logic.state is EngageState.DISENGAGED and logic.last_event == Event.SHUTDOWN.value
    idle = VehicleLogic(LIMITS, RATIO)
    assert not any(c.enable for c in idle.exit_commands())


def test_pacmod_mapping_derives_the_steering_wheel_limit():
    cmd = VehicleCommand(True, False, 0.01, 0.25, False, (), 1, EngageState.ENGAGED)
    pac = to_pacmod(cmd, LIMITS, RATIO)
    assert pac.steering_wheel_rad == pytest.approx(0.01 * RATIO)
    assert pac.rotation_rate_rad_s == pytest.approx(LIMITS.max_steering_rate_rad_s * RATIO)
    assert (pac.accel, pac.brake, pac.enable, pac.hazards) == (0.25, 0.0, True, False)
    wide = to_pacmod(VehicleCommand(True, False, 9.0, -1.0, True, (), None, EngageState.ENGAGED), LIMITS, RATIO)
    assert wide.steering_wheel_rad == pytest.approx(LIMITS.max_road_wheel_angle_rad * RATIO)
    assert (wide.accel, wide.brake, wide.hazards) == (0.0, LIMITS.max_brake, True)


def test_failsafe_takes_over_a_silent_interface_and_lets_go_on_takeover():
    fs = Failsafe(silence_timeout_s=0.2, stop_brake=0.5)
    fs.on_car(True, False)
    assert fs.tick(1.0) is None  # never heard the vehicle interface: not its business
    fs.on_heartbeat(1.0)
    fs.on_steering(1.5)
    assert fs.tick(1.15) is None
    cmd = fs.tick(1.25)
    assert fs.state is FailsafeState.STOPPING and cmd.enable and cmd.brake == 0.5 and cmd.accel == 0.0 and cmd.hazards
    assert cmd.steering_wheel_rad == 1.5 and fs.trips == 1
    fs.on_car(False, True)  # the safety driver took over
    releases = [fs.tick(1.3 + i * DT) for i in range(Failsafe.RELEASE_PERIODS + 3)]
    assert all(r is not None and not r.enable for r in releases[: Failsafe.RELEASE_PERIODS])
    assert releases[-1] is None
    fs.on_heartbeat(2.0)
    assert fs.tick(2.01) is None and fs.state is FailsafeState.IDLE
    quiet = Failsafe(0.2, 0.5)
    quiet.on_heartbeat(0.0)
    quiet.on_car(False, False)
    assert quiet.tick(1.0) is None  # the car is not enabled: nothing to stop


def test_failsafe_does_not_take_its_own_stall_for_the_interfaces_silence():
    fs = Failsafe(silence_timeout_s=0.2, stop_brake=0.5)
    fs.on_car(True, False)
    fs.on_heartbeat(1.0)
    assert fs.tick(1.01) is None
    # This process was stopped for 2 s: the heartbeats sent meanwhile are not taken in yet.
    assert fs.tick(3.0) is None and fs.trips == 0
    fs.on_heartbeat(3.0)
    assert fs.tick(3.03) is None and fs.state is FailsafeState.IDLE
    # A vehicle interface that did go silent is still caught, one period later.
    assert fs.tick(5.0) is None
    command = fs.tick(5.03)
    assert command is not None and command.brake == 0.5 and fs.state is FailsafeState.STOPPING and fs.trips == 1


def test_standin_latches_resends_and_clears_enable_on_override():
    car = PacmodStandIn()
    for system in ("steering", "accel", "brake"):
        car.on_command(system, True, False, True, 0.3 if system == "accel" else 0.0, 4.0)
    t = 0.0
    sends = []
    for _ in range(30):  # nobody sends again: the last command keeps going out
        sends.append(car.step(t, DT))
        t += DT
    assert all(s.enable["accel"] and s.command["accel"] == 0.3 for s in sends)
    assert car.reports().enabled and car.speed_mps > 0.5
    car.override("steering")
    sent = car.step(t, DT)
    assert not any(sent.enable.values()) and car.reports().override_active and not car.reports().enabled
    car.override("steering", active=False)
    car.on_command("steering", True, False, False, 0.0, 4.0)
    car.step(t + DT, DT)
    assert not car.enabled("steering")  # the override flag holds until clear_override
    car.on_command("steering", True, False, True, 0.0, 4.0)
    car.step(t + 2 * DT, DT)
    assert car.enabled("steering")


def test_standin_speed_is_signed_and_brakes_to_a_standstill():
    car = PacmodStandIn()
    car.gear = SHIFT_REVERSE
    for system, command in (("accel", 0.3), ("brake", 0.0)):
        car.on_command(system, True, False, True, command)
    for k in range(30):
        car.step(k * DT, DT)
    assert car.reports().vehicle_speed < -0.5  # PACMod's speed is negative in reverse
    car.on_command("accel", True, False, True, 0.0)
    car.on_command("brake", True, False, True, 0.8)
    for k in range(30, 90):
        car.step(k * DT, DT)
    assert car.speed_mps == 0.0  # stopped, not driven forwards by the brake


def test_a_disabled_system_followed_by_the_report_saying_why_gets_that_cause():
    logic, car = engaged()
    logic.on_system_report("steering", SystemStatus(False), 0.2)  # the system report comes first
    assert logic.state is EngageState.DISENGAGED and logic.last_event == Event.DISABLED_BY_VEHICLE.value
    logic.on_global_report(GlobalStatus(False, timeout=True), 0.21)  # then the global report: a CAN timeout
    assert logic.last_event == Event.CAN_TIMEOUT.value and logic.disengagements == {"can_timeout": 1}
    logic.on_global_report(GlobalStatus(False, fault=True), 0.5)  # much later: a new fact, not this cause
    assert logic.last_event == Event.CAN_TIMEOUT.value


def test_a_speed_cap_fades_the_accelerator_and_brakes_gently_above_it():
    assert capped_throttle(0.2, speed_mps=2.0, cap_mps=8.0) == 0.2  # well below: the command as it is
    assert 0.0 < capped_throttle(1.0, speed_mps=7.5, cap_mps=8.0) < 0.2  # near it: less accelerator
    assert capped_throttle(1.0, speed_mps=8.0, cap_mps=8.0) == 0.0  # at it: none
    assert -SPEED_CAP_MAX_BRAKE < capped_throttle(0.5, speed_mps=8.5, cap_mps=8.0) < 0.0  # above: a brake growing with the excess
    assert capped_throttle(0.5, speed_mps=20.0, cap_mps=8.0) == -SPEED_CAP_MAX_BRAKE  # and no harder than the gentle pedal
    assert capped_throttle(-0.9, speed_mps=20.0, cap_mps=8.0) == -0.9  # a harder brake the policy asks for is kept
