"""What the vehicle interface decides, as pure logic (no ROS): command limits, the staleness
watchdogs, engagement with the drive-by-wire system, the controlled stop and the exit sequence.

Units follow sps_driving.core.topics: steering is the front road-wheel angle in rad (left positive);
throttle is in [-1, 1], negative = brake. Every time here is steady-clock seconds
(`time.monotonic()` on the node): a step of the system or ROS clock never stalls a watchdog.

The node feeds inputs and drive-by-wire reports as they arrive and calls `VehicleLogic.tick` at
the control rate; whatever goes wrong (an input stale or invalid, a safety stop, reports stale,
speed unknown or over the cap in either direction, no forward gear, a second publisher on an
input, a clock jump) shows in the very next tick's command, so a stop takes effect within one
control period of its limit.

Engagement (PACMod 3 semantics, see sps_driving.sim.pacmod for the driver's behaviour):
- engaging is an edge: `request_engage` (the node's engage service), accepted only when the car
  and every input are ready, not while locked out after an override; while engaging the
  commands go out with enable and clear_override, the steering at its measured angle and no
  pedal, until the steering, accelerator and brake reports are all enabled without override,
  fault or timeout (then engaged) or engage_timeout_s passes (then dropped);
- engaged, any stop reason latches a controlled stop (accelerator 0, stop_brake, steering held,
  hazard lights) that holds until the safety driver disengages, however the input recovers;
- an override disengages, counts one safety-driver intervention and locks engagement out until
  `rearm`; while engaging, one on a report that had already shown its override cleared (the safety
  driver aborting the engagement) drops the engagement and locks out the same way, without counting
  an intervention (the car never drove); a reported fault or timeout, or a system the car disabled,
  disengages with its cause;
- disengaged, enable is false and the steering command follows the measured angle, so the next
  engagement starts from where the wheel is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum

SYSTEMS = ("steering", "accel", "brake")  # the drive-by-wire systems that must all be enabled to drive
# A command beyond these is from a broken producer, not a saturated one: no road wheel turns
# 1 rad (57 deg), and throttle is defined on [-1, 1] (sps_driving.core.topics). It stops the car;
# a command inside them but over the configured limits is clipped.
PHYSICAL_ROAD_WHEEL_RAD = 1.0
PHYSICAL_THROTTLE = 1.0
# A command stamped this far after the node's own now is from a clock that disagrees with ours
# (a step): refused like a late one. Clocks of one machine agree exactly; 0.1 s leaves room for
# delivery jitter of a simulated /clock.
MAX_FUTURE_STAMP_S = 0.1
STEERING_RATIO = 14.8  # steering-wheel angle / road-wheel angle of the Lexus RX 450h (config/graph.yaml holds the value in use)


def _limit(default: float, unit: str, doc: str, zero_turns_off: bool = False, at_most: float | None = None):
    """A field of ControlLimits with what it means: the node's parameter descriptions come from here."""
    return field(default=default, metadata={"unit": unit, "doc": doc, "zero_turns_off": zero_turns_off, "at_most": at_most})


@dataclass(frozen=True)
class ControlLimits:
    """Conservative defaults; config/graph.yaml (vehicle_interface) holds the values in use."""

    max_road_wheel_angle_rad: float = _limit(0.35, "rad", "|steering| limit at the road wheels")
    max_steering_rate_rad_s: float = _limit(0.3, "rad/s", "road-wheel angle change per second")
    max_throttle: float = _limit(0.3, "fraction", "accelerator pedal limit", at_most=1.0)
    max_brake: float = _limit(0.8, "fraction", "brake pedal limit", at_most=1.0)
    stop_brake: float = _limit(0.5, "fraction", "brake pedal held during a controlled stop", at_most=1.0)
    max_speed_mps: float = _limit(8.0, "m/s", "no accelerator at or above this speed")
    overspeed_margin_mps: float = _limit(2.0, "m/s", "above max_speed_mps by more than this (downhill): controlled stop")
    max_command_age_s: float = _limit(0.25, "s", "no fresh policy command within this: controlled stop")
    max_camera_age_s: float = _limit(0.25, "s", "no camera frame within this: controlled stop")
    max_safety_age_s: float = _limit(0.5, "s", "no safety-monitor stop request within this: controlled stop (when required)")
    max_failsafe_age_s: float = _limit(0.5, "s", "no failsafe status within this: controlled stop (when required)")
    max_report_age_s: float = _limit(0.25, "s", "a drive-by-wire or speed report older than this: controlled stop")
    max_command_latency_s: float = _limit(
        1.0, "s", "camera stamp to command arrival beyond which a command is refused (the pipeline lags): controlled stop; "
        "0 turns the check off (replaying old stamps)", zero_turns_off=True)
    max_clock_jump_s: float = _limit(
        0.2, "s", "the ROS clock moving more or less than the steady clock by this between two periods is a clock step "
        "(NTP, PTP, GPS): controlled stop; 0 turns the check off", zero_turns_off=True)
    engage_timeout_s: float = _limit(2.0, "s", "an engagement the car does not complete within this is dropped")
    exit_brake_s: float = _limit(0.5, "s", "on exit while engaged: brake this long, then disable; 0: disable at once", zero_turns_off=True)
    control_rate_hz: float = _limit(30.0, "Hz", "watchdog and command output rate (the PACMod driver re-sends every 33 ms)")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            may_be_zero = f.metadata["zero_turns_off"]
            if not (isinstance(value, (int, float)) and math.isfinite(value) and (value > 0 or (may_be_zero and value == 0))):
                kind = "non-negative" if may_be_zero else "positive"
                raise ValueError(f"control limit {f.name} must be a {kind} finite number, got {value!r}")
            if f.metadata["at_most"] is not None and value > f.metadata["at_most"]:
                raise ValueError(f"{f.name} is a pedal fraction in (0, 1], got {value}")
        if self.stop_brake > self.max_brake:
            raise ValueError(f"stop_brake {self.stop_brake} exceeds max_brake {self.max_brake}")

    @classmethod
    def meaning(cls, name: str) -> dict:
        """{"unit", "doc", "zero_turns_off", "at_most"} of one limit."""
        return dict(next(f for f in fields(cls) if f.name == name).metadata)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, values: dict) -> ControlLimits:
        unknown = set(values) - set(cls.names())
        if unknown:
            raise ValueError(f"unknown control limits {sorted(unknown)}; expected some of {sorted(cls.names())}")
        return cls(**{k: float(v) for k, v in values.items()})

    @property
    def control_period_s(self) -> float:
        return 1.0 / self.control_rate_hz


class StopReason(str, Enum):
    DISENGAGED = "disengaged"  # drive-by-wire not engaged (manual driving)
    NO_COMMAND = "no_command"  # nothing received yet
    COMMAND_TIMEOUT = "command_timeout"  # policy or an upstream stage stopped
    INVALID_COMMAND = "invalid_command"  # latest command was NaN, infinite or physically impossible
    LATE_COMMAND = "late_command"  # latest command came from a frame too old, or stamped in the future
    CAMERA_TIMEOUT = "camera_timeout"  # camera stopped
    SAFETY_STOP = "safety_stop"  # the safety monitor requests a stop
    SAFETY_MONITOR_TIMEOUT = "safety_monitor_timeout"  # the safety monitor went silent
    FAILSAFE_ACTIVE = "failsafe_active"  # the failsafe took over (it found this node silent)
    FAILSAFE_TIMEOUT = "failsafe_timeout"  # the failsafe went silent
    REPORT_TIMEOUT = "report_timeout"  # drive-by-wire reports stale or missing: the car's state is unknown
    SPEED_UNKNOWN = "speed_unknown"  # speed report stale, missing or invalid: the speed cap cannot hold
    OVERSPEED = "overspeed"  # |speed| above max_speed_mps + overspeed_margin_mps (either direction)
    GEAR_NOT_FORWARD = "gear_not_forward"  # gear report missing, stale, or not a forward gear: the policy only drives forward
    DUPLICATE_PUBLISHER = "duplicate_publisher"  # an input topic has more publishers than the graph has
    CLOCK_JUMP = "clock_jump"  # the ROS clock stepped against the steady clock


class EngageState(str, Enum):
    DISENGAGED = "disengaged"
    ENGAGING = "engaging"
    ENGAGED = "engaged"


class Event(str, Enum):
    """Why the engagement changed; `last_event` in the node's status."""

    ENGAGE_REQUESTED = "engage_requested"
    ENGAGED = "engaged"
    OVERRIDE = "override"  # the safety driver took over: an intervention
    FAULT = "fault"  # PACMod or vehicle fault reported
    CAN_TIMEOUT = "can_timeout"  # a CAN timeout or command timeout reported by the PACMod
    DISABLED_BY_VEHICLE = "disabled_by_vehicle"  # a system reported disabled without override or fault
    DISENGAGE_REQUESTED = "disengage_requested"  # the operator disengaged
    ENGAGE_TIMEOUT = "engage_timeout"  # the car did not complete the engagement in time
    ENGAGE_ABORTED = "engage_aborted"  # the safety driver overrode while engaging (locks out; not an intervention)
    STOP_LATCHED = "stop_latched"  # engaged, braking to a controlled stop
    REARMED = "rearmed"
    SHUTDOWN = "shutdown"  # the node exited (brake, then disable)


@dataclass(frozen=True)
class SystemStatus:
    """One drive-by-wire system as reported (PACMod 3 SystemRptFloat)."""

    enabled: bool
    override: bool = False
    fault: bool = False  # any of the report's fault flags
    timeout: bool = False  # the system saw our commands time out
    output: float = math.nan  # measured output: steering-wheel angle rad, pedal fraction


@dataclass(frozen=True)
class GlobalStatus:
    """The drive-by-wire system as a whole (PACMod 3 GlobalRpt): `enabled` = any system enabled."""

    enabled: bool
    override: bool = False
    fault: bool = False  # pacmod_sys_fault_active or config_fault_active
    timeout: bool = False  # any *_can_timeout


@dataclass(frozen=True)
class VehicleCommand:
    """What goes to the car this control period."""

    enable: bool  # drive-by-wire enable on every system
    clear_override: bool  # only while engaging
    steering_rad: float  # road-wheel angle, within limits
    throttle: float  # in [-max_brake, max_throttle]; negative = brake
    hazards: bool  # hazard lights (during a controlled stop)
    reasons: tuple[StopReason, ...]  # empty while driving from the policy
    source_stamp_ns: int | None  # camera stamp of the policy command in use, None otherwise
    state: EngageState

    @property
    def stopping(self) -> bool:
        return bool(self.reasons)


def clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


# A lowered speed cap (the safety monitor slowing the car) must slow it within seconds: the
# accelerator cut alone would coast, and a car coasts down for a minute. The brake grows with the
# excess over the cap up to a gentle pedal (about 1.8 m/s^2 in config/sim.yaml's car).
SPEED_CAP_GAIN_PER_MPS = 0.2  # throttle fraction per m/s below (accelerator) or above (brake) the cap
SPEED_CAP_MAX_BRAKE = 0.3  # brake pedal fraction the cap applies at most


def capped_throttle(throttle: float, speed_mps: float, cap_mps: float) -> float:
    """`throttle` ([-1, 1], negative brakes) under a speed cap: the accelerator fades out as the
    speed nears the cap, and above it a brake grows with the excess, up to SPEED_CAP_MAX_BRAKE;
    a harder brake the command asks for is kept."""
    return min(throttle, max(-SPEED_CAP_MAX_BRAKE, SPEED_CAP_GAIN_PER_MPS * (cap_mps - speed_mps)))


class VehicleLogic:
    """The whole decision of the vehicle interface. Drive-by-wire reports are always needed (a car
    without them gets reports made up by its backend from what was commanded).
    `steering_ratio`: steering-wheel angle / road-wheel angle, to read the measured steering;
    `require_speed`: a fresh speed report is needed to drive (the speed cap must hold);
    `require_forward_gear`: a fresh gear report showing a forward gear is needed to engage and drive;
    `latch_stops`: an engaged stop holds until disengaged (off only for offline replays, whose
    report wants to see the stack resume)."""

    def __init__(
        self,
        limits: ControlLimits,
        steering_ratio: float,
        require_safety_monitor: bool = True,
        require_failsafe: bool = True,
        require_speed: bool = True,
        require_forward_gear: bool = True,
        latch_stops: bool = True,
    ):
        if not (math.isfinite(steering_ratio) and steering_ratio > 0):
            raise ValueError(f"steering_ratio must be a positive number, got {steering_ratio!r}")
        self.limits = limits
        self.steering_ratio = float(steering_ratio)
        self.require_safety_monitor = require_safety_monitor
        self.require_failsafe = require_failsafe
        self.require_speed = require_speed
        self.require_forward_gear = require_forward_gear
        self.latch_stops = latch_stops
        self.state = EngageState.DISENGAGED
        self.locked_out = False  # after an override, until rearm()
        self.last_event = ""
        self.interventions = 0  # overrides while engaged
        self.disengagements: dict[str, int] = {}  # Event value -> count, for every cause
        self.invalid_commands = 0
        self.late_commands = 0
        self._engage_requested_s = 0.0
        self._command: tuple[float, float, int] | None = None  # steering, throttle, camera stamp
        self._command_s: float | None = None
        self._command_invalid = False
        self._command_late = False
        self._camera_s: float | None = None
        self._safety: tuple[bool, float] | None = None  # stop requested, when
        self._failsafe: tuple[bool, float] | None = None  # active, when
        self._systems: dict[str, tuple[SystemStatus, float]] = {}
        self._global: tuple[GlobalStatus, float] | None = None
        self._speed: tuple[float, float] | None = None  # valid speed m/s (negative in reverse), when
        self._cruise_scale = 1.0  # the safety monitor's slow-down; the latest holds (it sends 1.0 when not slowing)
        self._target_speed: float | None = None  # m/s, the cruise target the safety driver set; the latest holds
        self._forward_gear: tuple[bool, float] | None = None  # a forward gear reported, when
        self._override_cleared: set[str] = set()  # reports (systems, "global") seen without override while engaging
        self._duplicates: dict[str, int] = {}
        self._clock: tuple[int, float] | None = None  # ROS ns, steady s of the last check
        self._clock_jump_s: float | None = None
        self._latched: tuple[StopReason, ...] = ()
        self._disengaged_s = -math.inf
        self._measured_steering: float | None = None  # road-wheel rad, from the steering report
        self._steering = 0.0
        self._last_tick_s: float | None = None

    # ------------------------------------------------------------ inputs

    def on_command(self, steering: float, throttle: float, stamp_ns: int, now_s: float, latency_s: float | None = None) -> bool:
        """A policy command; `latency_s` = ROS now minus its camera stamp. A non-finite or
        physically impossible command, or one from a frame older than max_command_latency_s or
        stamped in the future, is counted and stops the car until an acceptable one arrives.
        Returns acceptance."""
        if not (abs(steering) <= PHYSICAL_ROAD_WHEEL_RAD and abs(throttle) <= PHYSICAL_THROTTLE):  # False for NaN
            self.invalid_commands += 1
            self._command_invalid = True
            return False
        self._command_invalid = False
        limit = self.limits.max_command_latency_s
        if limit > 0 and latency_s is not None and not (-MAX_FUTURE_STAMP_S <= latency_s <= limit):
            self.late_commands += 1
            self._command_late = True
            return False
        self._command_late = False
        self._command = (float(steering), float(throttle), int(stamp_ns))
        self._command_s = now_s
        return True

    def on_camera(self, now_s: float) -> None:
        self._camera_s = now_s

    def on_safety(self, stop_requested: bool, now_s: float) -> None:
        self._safety = (bool(stop_requested), now_s)

    def on_failsafe(self, active: bool, now_s: float) -> None:
        self._failsafe = (bool(active), now_s)

    def on_speed(self, speed_mps: float, valid: bool, now_s: float) -> None:
        if valid and math.isfinite(speed_mps):
            self._speed = (float(speed_mps), now_s)

    def on_cruise_scale(self, scale: float) -> bool:
        """The safety monitor's slow-down (topics.CRUISE_SCALE), in (0, 1]; False (ignored) otherwise."""
        if not 0.0 < scale <= 1.0:  # False for NaN
            return False
        self._cruise_scale = float(scale)
        return True

    def on_target_speed(self, target_mps: float) -> bool:
        """The cruise target (topics.TARGET_SPEED), m/s; False (ignored) when not a finite speed >= 0."""
        if not (math.isfinite(target_mps) and target_mps >= 0.0):
            return False
        self._target_speed = float(target_mps)
        return True

    @property
    def speed_cap_mps(self) -> float:
        """No accelerator at or above this speed: max_speed_mps, or while the safety monitor slows the
        car, its scale times the cruise target (times max_speed_mps until a target arrives)."""
        top = self.limits.max_speed_mps
        if self._cruise_scale == 1.0:
            return top
        return self._cruise_scale * (top if self._target_speed is None else min(self._target_speed, top))

    def on_gear(self, forward: bool, now_s: float) -> None:
        """The gear report: True for a forward gear (PACMod SHIFT_FORWARD or SHIFT_LOW)."""
        self._forward_gear = (bool(forward), now_s)

    def on_duplicates(self, topics: dict[str, int]) -> None:
        """{topic: publishers} of the inputs with more publishers than expected ({} when none)."""
        self._duplicates = dict(topics)

    def on_clock(self, ros_ns: int, now_s: float) -> bool:
        """Compare the ROS clock with the steady clock; True when it jumped since the last call.
        Commands in flight across the jump carry stamps of the other side: the stop reason lasts
        max_command_age_s, until every command in use was computed after it."""
        jumped = False
        if self._clock is not None and self.limits.max_clock_jump_s > 0:
            last_ns, last_s = self._clock
            drift = (ros_ns - last_ns) * 1e-9 - (now_s - last_s)
            jumped = abs(drift) > self.limits.max_clock_jump_s
            if jumped:
                self._clock_jump_s = now_s
        self._clock = (int(ros_ns), now_s)
        return jumped

    def on_system_report(self, system: str, status: SystemStatus, now_s: float) -> None:
        if system not in SYSTEMS:
            raise ValueError(f"unknown drive-by-wire system {system!r}; expected one of {SYSTEMS}")
        self._systems[system] = (status, now_s)
        if system == "steering" and math.isfinite(status.output):
            limit = self.limits.max_road_wheel_angle_rad
            self._measured_steering = clip(status.output / self.steering_ratio, -limit, limit)
        self._react(system, status.override, status.fault, status.timeout, status.enabled, now_s)

    def on_global_report(self, status: GlobalStatus, now_s: float) -> None:
        self._global = (status, now_s)
        self._react("global", status.override, status.fault, status.timeout, status.enabled, now_s)

    def _react(self, source: str, override: bool, fault: bool, timeout: bool, enabled: bool, now_s: float) -> None:
        if self.state is EngageState.DISENGAGED:
            # Reports of one period arrive one by one: a system reported disabled may be followed
            # by the report that says why. The cause is corrected; the disengagement was at once.
            recent = now_s - self._disengaged_s <= self.limits.control_period_s
            if recent and self.last_event == Event.DISABLED_BY_VEHICLE.value and (fault or timeout):
                self._count(Event.DISABLED_BY_VEHICLE, -1)
                cause = Event.FAULT if fault else Event.CAN_TIMEOUT
                self._count(cause, +1)
                self.last_event = cause.value
            return
        if fault:
            self._disengage(Event.FAULT, now_s)
        elif timeout:
            self._disengage(Event.CAN_TIMEOUT, now_s)
        elif self.state is EngageState.ENGAGING:
            # An old override flag is being cleared and systems are coming up; an override on a
            # report that had already shown it cleared is the safety driver aborting the engagement.
            # It locks out as an override does; the car never drove, so it is no intervention.
            if not override:
                self._override_cleared.add(source)
            elif source in self._override_cleared:
                self.locked_out = True
                self._disengage(Event.ENGAGE_ABORTED, now_s)
        elif override:
            self.interventions += 1
            self.locked_out = True
            self._disengage(Event.OVERRIDE, now_s)
        elif not enabled:
            self._disengage(Event.DISABLED_BY_VEHICLE, now_s)

    # ------------------------------------------------------------ operator requests

    def request_engage(self, now_s: float) -> tuple[bool, str]:
        """The operator's engage request (an edge). Returns (accepted, why)."""
        if self.state is not EngageState.DISENGAGED:
            return True, f"already {self.state.value}"
        blockers = self.engage_blockers(now_s)
        if blockers:
            return False, "not engaging: " + "; ".join(blockers)
        self._engage_requested_s = now_s
        self._override_cleared = set()
        self._set(EngageState.ENGAGING, Event.ENGAGE_REQUESTED)
        return True, "engaging"

    def request_disengage(self) -> tuple[bool, str]:
        if self.state is EngageState.DISENGAGED:
            return True, "already disengaged"
        self._disengage(Event.DISENGAGE_REQUESTED)
        return True, "disengaged"

    def rearm(self) -> tuple[bool, str]:
        """Clear the lockout after an override (disengaged only)."""
        if self.state is not EngageState.DISENGAGED:
            return False, f"re-arm only while disengaged (now {self.state.value})"
        if not self.locked_out:
            return True, "not locked out"
        self.locked_out = False
        self.last_event = Event.REARMED.value
        return True, "re-armed"

    def engage_blockers(self, now_s: float) -> list[str]:
        blockers = []
        if self.locked_out:
            blockers.append("locked out after an override: re-arm first")
        blockers += self._car_problems(now_s)
        inputs = [r.value for r in self._stop_reasons(now_s) if r is not StopReason.DISENGAGED]
        if inputs:
            blockers.append("inputs not ready: " + ", ".join(inputs))
        return blockers

    def _car_problems(self, now_s: float) -> list[str]:
        problems = []
        reports = [(name, self._systems.get(name)) for name in SYSTEMS] + [("global", self._global)]
        stale = [name for name, rpt in reports if rpt is None or now_s - rpt[1] > self.limits.max_report_age_s]
        if stale:
            problems.append("no fresh report from " + ", ".join(stale))
        statuses = [rpt[0] for _, rpt in reports if rpt is not None]
        if any(s.fault for s in statuses):
            problems.append("fault reported")
        if any(s.timeout for s in statuses):
            problems.append("timeout reported")
        return problems

    def _systems_enabled(self, now_s: float) -> bool:
        """Steering, accelerator and brake all enabled, no override, fault or timeout, all fresh."""
        if self._car_problems(now_s):
            return False
        systems = [self._systems[s][0] for s in SYSTEMS]
        return all(s.enabled and not s.override for s in systems) and not self._global[0].override

    # ------------------------------------------------------------ the control period

    def _stop_reasons(self, now_s: float) -> tuple[StopReason, ...]:
        lim = self.limits
        reasons = []

        def stale(time_s: float | None, limit_s: float) -> bool:
            return time_s is None or now_s - time_s > limit_s

        if self.state is not EngageState.ENGAGED:
            reasons.append(StopReason.DISENGAGED)
        if self._safety is not None and self._safety[0]:
            reasons.append(StopReason.SAFETY_STOP)
        if self.require_safety_monitor and stale(self._safety and self._safety[1], lim.max_safety_age_s):
            reasons.append(StopReason.SAFETY_MONITOR_TIMEOUT)
        if self._failsafe is not None and self._failsafe[0]:
            reasons.append(StopReason.FAILSAFE_ACTIVE)
        if self.require_failsafe and stale(self._failsafe and self._failsafe[1], lim.max_failsafe_age_s):
            reasons.append(StopReason.FAILSAFE_TIMEOUT)
        if self._command_invalid:
            reasons.append(StopReason.INVALID_COMMAND)
        if self._command_late:
            reasons.append(StopReason.LATE_COMMAND)
        if self._command_s is None:
            reasons.append(StopReason.NO_COMMAND)
        elif stale(self._command_s, lim.max_command_age_s):
            reasons.append(StopReason.COMMAND_TIMEOUT)
        if stale(self._camera_s, lim.max_camera_age_s):
            reasons.append(StopReason.CAMERA_TIMEOUT)
        if any(
            rpt is None or stale(rpt[1], lim.max_report_age_s) for rpt in [self._systems.get(s) for s in SYSTEMS] + [self._global]
        ):
            reasons.append(StopReason.REPORT_TIMEOUT)
        speed = self._speed[0] if self._speed is not None and not stale(self._speed[1], lim.max_report_age_s) else None
        if self.require_speed and speed is None:
            reasons.append(StopReason.SPEED_UNKNOWN)
        if speed is not None and abs(speed) > lim.max_speed_mps + lim.overspeed_margin_mps:
            reasons.append(StopReason.OVERSPEED)
        if self.require_forward_gear and (stale(self._forward_gear and self._forward_gear[1], lim.max_report_age_s)
                                          or not self._forward_gear[0]):
            reasons.append(StopReason.GEAR_NOT_FORWARD)
        if self._duplicates:
            reasons.append(StopReason.DUPLICATE_PUBLISHER)
        if self._clock_jump_s is not None and now_s - self._clock_jump_s <= lim.max_command_age_s:
            reasons.append(StopReason.CLOCK_JUMP)
        return tuple(reasons)

    def tick(self, now_s: float) -> VehicleCommand:
        """One control period: the command to send now."""
        lim = self.limits
        if self.state is EngageState.ENGAGING:
            if self._systems_enabled(now_s):
                self._set(EngageState.ENGAGED, Event.ENGAGED)
            elif now_s - self._engage_requested_s > lim.engage_timeout_s:
                self._disengage(Event.ENGAGE_TIMEOUT)
        dt = lim.control_period_s if self._last_tick_s is None else now_s - self._last_tick_s
        # A late tick must not allow a large steering jump; a clock step back allows none.
        dt = clip(dt, 0.0, 2.0 * lim.control_period_s)
        self._last_tick_s = now_s
        reasons = self._stop_reasons(now_s)
        if self.state is not EngageState.ENGAGED:
            if self._measured_steering is not None:
                self._steering = self._measured_steering
            engaging = self.state is EngageState.ENGAGING
            return VehicleCommand(engaging, engaging, self._steering, 0.0, False, reasons, None, self.state)
        if reasons and self.latch_stops:
            if not self._latched:
                self.last_event = Event.STOP_LATCHED.value
            self._latched = tuple(dict.fromkeys(self._latched + reasons))
        reasons = tuple(dict.fromkeys(self._latched + reasons))
        if reasons:  # controlled stop: no accelerator, brake held, steering held
            return VehicleCommand(True, False, self._steering, -lim.stop_brake, True, reasons, None, self.state)
        target, throttle, stamp = self._command
        throttle = clip(throttle, -lim.max_brake, lim.max_throttle)
        speed = self._speed[0] if self._speed is not None else None
        if speed is not None and now_s - self._speed[1] <= lim.max_report_age_s:
            if abs(speed) >= lim.max_speed_mps:
                throttle = min(throttle, 0.0)
            if self._cruise_scale < 1.0:  # slowed: within seconds, with a gentle brake (capped_throttle)
                throttle = max(capped_throttle(throttle, abs(speed), self.speed_cap_mps), -lim.max_brake)
        target = clip(target, -lim.max_road_wheel_angle_rad, lim.max_road_wheel_angle_rad)
        step = lim.max_steering_rate_rad_s * dt
        self._steering = clip(target, self._steering - step, self._steering + step)
        return VehicleCommand(True, False, self._steering, throttle, False, (), stamp, self.state)

    def exit_commands(self) -> list[VehicleCommand]:
        """The commands to send, one per control period, when the node exits: if the car is
        engaged (or engaging), brake for exit_brake_s with the steering held and hazards on; then
        disable every system, so the driver, which re-sends the last command forever, holds a
        disabled car (manual driving) and not the last policy command."""
        lim = self.limits
        out = []
        if self.state is not EngageState.DISENGAGED:
            braking = VehicleCommand(True, False, self._steering, -lim.stop_brake, True, (), None, self.state)
            out += [braking] * math.ceil(lim.exit_brake_s * lim.control_rate_hz)
        self._disengage(Event.SHUTDOWN)
        disabled = VehicleCommand(False, False, self._steering, -lim.stop_brake, False, (StopReason.DISENGAGED,), None, self.state)
        return out + [disabled] * 3  # reliable QoS delivers them; three in case the reader was slow to match

    # ------------------------------------------------------------ state

    def _disengage(self, event: Event, now_s: float | None = None) -> None:
        if self.state is not EngageState.DISENGAGED:
            self._count(event, +1)
            if now_s is not None:
                self._disengaged_s = now_s
        # A latched stop ends with its engagement, here and not at the next tick: an engage request
        # within the same control period must start clean.
        self._latched = ()
        self._set(EngageState.DISENGAGED, event)

    def _count(self, event: Event, change: int) -> None:
        count = self.disengagements.get(event.value, 0) + change
        if count:
            self.disengagements[event.value] = count
        else:
            self.disengagements.pop(event.value, None)

    def _set(self, state: EngageState, event: Event) -> None:
        self.state = state
        self.last_event = event.value

    @property
    def engaged(self) -> bool:
        return self.state is EngageState.ENGAGED


@dataclass(frozen=True)
class PacmodCommand:
    """One control period of PACMod 3 commands (SteeringCmd, SystemCmdFloat x2, SystemCmdInt)."""

    enable: bool
    clear_override: bool
    steering_wheel_rad: float  # SteeringCmd.command
    rotation_rate_rad_s: float  # SteeringCmd.rotation_rate (steering wheel)
    accel: float  # accel_cmd, 0..1
    brake: float  # brake_cmd, 0..1
    hazards: bool  # turn_cmd TURN_HAZARDS, else TURN_NONE


def to_pacmod(command: VehicleCommand, limits: ControlLimits, steering_ratio: float) -> PacmodCommand:
    """Road-wheel angle and signed throttle -> PACMod 3 steering-wheel angle, accel and brake.
    The steering-wheel limits follow from the road-wheel ones and the ratio."""
    max_wheel = limits.max_road_wheel_angle_rad * steering_ratio
    return PacmodCommand(
        enable=command.enable,
        clear_override=command.clear_override,
        steering_wheel_rad=clip(command.steering_rad * steering_ratio, -max_wheel, max_wheel),
        rotation_rate_rad_s=limits.max_steering_rate_rad_s * steering_ratio,
        accel=clip(command.throttle, 0.0, limits.max_throttle),
        brake=clip(-command.throttle, 0.0, limits.max_brake),
        hazards=command.hazards,
    )


def from_pacmod(steering_wheel_rad, accel, brake, steering_ratio: float):
    """PACMod 3 steering-wheel angle (rad) and accelerator and brake pedals (0..1) -> road-wheel
    angle (rad) and signed throttle (negative = brake): the inverse of `to_pacmod` without its
    limits, for what a safety driver did (the reports' outputs). Both pedals pressed count as
    their difference. Takes numbers or NumPy arrays."""
    if not (math.isfinite(steering_ratio) and steering_ratio > 0):
        raise ValueError(f"steering_ratio must be a positive number, got {steering_ratio!r}")
    return steering_wheel_rad / steering_ratio, accel - brake
