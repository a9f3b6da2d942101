"""Vehicle command shaping: limits, steering rate limit, staleness watchdog, controlled stop,
engagement with the drive-by-wire system and the PACMod 3 command mapping. Pure logic, no ROS.

Units follow sps_driving.topics: steering is the front road-wheel angle in rad (left positive);
throttle is in [-1, 1], negative = brake. The vehicle interface node calls `VehicleController.step`
on a timer at the control rate, so any reason to stop takes effect within one control period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import Enum


@dataclass(frozen=True)
class ControlLimits:
    """Conservative defaults; config/graph.yaml (vehicle_interface) holds the values in use."""

    max_road_wheel_angle_rad: float = 0.35  # |steering| limit at the road wheels
    max_steering_rate_rad_s: float = 0.3  # road-wheel angle change per second
    max_throttle: float = 0.3  # accelerator pedal, 0..1
    max_brake: float = 0.8  # brake pedal, 0..1
    stop_brake: float = 0.5  # brake pedal held during a controlled stop, 0..1
    max_command_age_s: float = 0.25  # no fresh policy command within this -> controlled stop
    max_camera_age_s: float = 0.25  # no camera frame within this -> controlled stop
    max_safety_age_s: float = 0.5  # no safety-monitor status within this -> controlled stop (when required)
    # Camera stamp to command arrival: a command computed from an older frame is refused and
    # stops the car (the pipeline is lagging). 0 disables the check (replaying old stamps).
    max_command_latency_s: float = 1.0
    control_rate_hz: float = 30.0  # watchdog and command output rate

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            may_be_zero = f.name == "max_command_latency_s"  # 0 = check off
            if not (isinstance(value, (int, float)) and math.isfinite(value) and (value > 0 or (may_be_zero and value == 0))):
                kind = "non-negative" if may_be_zero else "positive"
                raise ValueError(f"control limit {f.name} must be a {kind} finite number, got {value!r}")
        for name in ("max_throttle", "max_brake", "stop_brake"):
            if getattr(self, name) > 1.0:
                raise ValueError(f"{name} is a pedal fraction in (0, 1], got {getattr(self, name)}")
        if self.stop_brake > self.max_brake:
            raise ValueError(f"stop_brake {self.stop_brake} exceeds max_brake {self.max_brake}")

    @classmethod
    def from_dict(cls, values: dict) -> "ControlLimits":
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown control limits {sorted(unknown)}; expected some of {sorted(known)}")
        return cls(**{k: float(v) for k, v in values.items()})

    @property
    def control_period_s(self) -> float:
        return 1.0 / self.control_rate_hz


class StopReason(str, Enum):
    NO_COMMAND = "no_command"  # nothing received yet
    COMMAND_TIMEOUT = "command_timeout"  # policy or an upstream stage stopped
    INVALID_COMMAND = "invalid_command"  # latest command was NaN/Inf
    LATE_COMMAND = "late_command"  # latest command came from a frame older than max_command_latency_s
    CAMERA_TIMEOUT = "camera_timeout"  # camera stopped
    SAFETY_STOP = "safety_stop"  # the safety monitor requests a stop
    SAFETY_MONITOR_TIMEOUT = "safety_monitor_timeout"  # the safety monitor went silent
    DISENGAGED = "disengaged"  # drive-by-wire not engaged (manual driving)


@dataclass(frozen=True)
class Actuation:
    steering_rad: float  # road-wheel angle, within limits
    throttle: float  # in [-max_brake, max_throttle]
    reasons: tuple[StopReason, ...]  # empty while driving from the policy
    source_stamp_ns: int | None  # camera stamp of the policy command in use, None while stopping

    @property
    def stopping(self) -> bool:
        return bool(self.reasons)


class VehicleController:
    """Turns policy commands into limited actuation; any stop reason gives a controlled stop
    (no accelerator, `stop_brake` on the brake, steering held with its rate limit)."""

    def __init__(self, limits: ControlLimits, require_safety_monitor: bool = True):
        self.limits = limits
        self.require_safety_monitor = require_safety_monitor
        self._safety_time_s: float | None = None
        self._command: tuple[float, float, int] | None = None  # steering, throttle, camera stamp
        self._command_time_s: float | None = None
        self._command_invalid = False
        self._command_late = False
        self._camera_time_s: float | None = None
        self._safety_stop = False
        self._steering = 0.0
        self._last_step_s: float | None = None
        self.invalid_commands = 0
        self.late_commands = 0

    def on_command(
        self, steering: float, throttle: float, stamp_ns: int, now_s: float, latency_s: float | None = None
    ) -> bool:
        """Accept a policy command; a non-finite one, or one whose camera frame is older than
        max_command_latency_s (`latency_s`: now minus the frame's stamp), is counted and makes
        the car stop until an acceptable one arrives. Returns acceptance."""
        if not (math.isfinite(steering) and math.isfinite(throttle)):
            self.invalid_commands += 1
            self._command_invalid = True
            return False
        self._command_invalid = False
        limit = self.limits.max_command_latency_s
        if limit > 0 and latency_s is not None and latency_s > limit:
            self.late_commands += 1
            self._command_late = True
            return False
        self._command_late = False
        self._command = (float(steering), float(throttle), int(stamp_ns))
        self._command_time_s = now_s
        return True

    def on_camera_frame(self, now_s: float) -> None:
        self._camera_time_s = now_s

    def on_safety_status(self, stop_requested: bool, now_s: float) -> None:
        self._safety_stop = bool(stop_requested)
        self._safety_time_s = now_s

    def stop_reasons(self, now_s: float, engaged: bool) -> tuple[StopReason, ...]:
        lim = self.limits
        reasons = []
        if not engaged:
            reasons.append(StopReason.DISENGAGED)
        if self._safety_stop:
            reasons.append(StopReason.SAFETY_STOP)
        if self.require_safety_monitor and (
            self._safety_time_s is None or now_s - self._safety_time_s > lim.max_safety_age_s
        ):
            reasons.append(StopReason.SAFETY_MONITOR_TIMEOUT)
        if self._command_invalid:
            reasons.append(StopReason.INVALID_COMMAND)
        if self._command_late:
            reasons.append(StopReason.LATE_COMMAND)
        if self._command_time_s is None:
            reasons.append(StopReason.NO_COMMAND)
        elif now_s - self._command_time_s > lim.max_command_age_s:
            reasons.append(StopReason.COMMAND_TIMEOUT)
        if self._camera_time_s is None or now_s - self._camera_time_s > lim.max_camera_age_s:
            reasons.append(StopReason.CAMERA_TIMEOUT)
        return tuple(reasons)

    def step(self, now_s: float, engaged: bool = True) -> Actuation:
        """One control period: the actuation to send now."""
        lim = self.limits
        dt = lim.control_period_s if self._last_step_s is None else now_s - self._last_step_s
        # A late timer tick must not allow a large steering jump; a clock step back allows none.
        dt = min(max(dt, 0.0), 2.0 * lim.control_period_s)
        self._last_step_s = now_s
        reasons = self.stop_reasons(now_s, engaged)
        if reasons:
            target_steering, throttle, stamp = self._steering, -lim.stop_brake, None
        else:
            target_steering, throttle, stamp = self._command
            throttle = clip(throttle, -lim.max_brake, lim.max_throttle)
        target_steering = clip(target_steering, -lim.max_road_wheel_angle_rad, lim.max_road_wheel_angle_rad)
        max_delta = lim.max_steering_rate_rad_s * dt
        self._steering = clip(target_steering, self._steering - max_delta, self._steering + max_delta)
        return Actuation(self._steering, throttle, reasons, stamp)


def clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


class EngageState(str, Enum):
    DISENGAGED = "disengaged"
    ENGAGING = "engaging"
    ENGAGED = "engaged"


class Engagement:
    """Engagement with the drive-by-wire system, driven by its reports.

    Engaging: commands go out with enable=True and clear_override=True until the car reports
    enabled without override, or gives up after engage_timeout_s (a car that never answers, or
    never enables, must not be left with enable requests going out). Engaged: an override or a
    disable reported by the car disengages and counts as a safety-driver intervention; a fault or
    stale reports disengage without counting one. Re-engaging always needs a new request.
    """

    def __init__(self, report_timeout_s: float, engage_timeout_s: float = 2.0):
        for name, value in (("report_timeout_s", report_timeout_s), ("engage_timeout_s", engage_timeout_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive, got {value}")
        self.report_timeout_s = report_timeout_s
        self.engage_timeout_s = engage_timeout_s
        self._engage_requested_s = 0.0
        self.state = EngageState.DISENGAGED
        self.interventions = 0
        self.last_event = ""
        self._report_time_s: float | None = None

    @property
    def engaged(self) -> bool:
        return self.state is EngageState.ENGAGED

    @property
    def enable(self) -> bool:
        return self.state is not EngageState.DISENGAGED

    @property
    def clear_override(self) -> bool:
        return self.state is EngageState.ENGAGING

    def request(self, engage: bool, now_s: float) -> None:
        if engage and self.state is EngageState.DISENGAGED:
            self._engage_requested_s = now_s
            self._set(EngageState.ENGAGING, "engage_requested")
        elif not engage and self.state is not EngageState.DISENGAGED:
            self._set(EngageState.DISENGAGED, "disengage_requested")

    def on_report(self, enabled: bool, override_active: bool, fault: bool, now_s: float) -> str | None:
        """Feed one vehicle report; returns the event it caused, if any."""
        self._report_time_s = now_s
        if self.state is EngageState.DISENGAGED:
            return None
        if fault:
            return self._set(EngageState.DISENGAGED, "fault")
        if self.state is EngageState.ENGAGING:
            return self._set(EngageState.ENGAGED, "engaged") if enabled and not override_active else None
        if override_active or not enabled:
            self.interventions += 1
            return self._set(EngageState.DISENGAGED, "override" if override_active else "disabled_by_vehicle")
        return None

    def check(self, now_s: float) -> str | None:
        """Stale reports disengage (the car's state is unknown); so does an engage that takes too long."""
        if self.state is EngageState.DISENGAGED:
            return None
        if self.state is EngageState.ENGAGING and now_s - self._engage_requested_s > self.engage_timeout_s:
            return self._set(EngageState.DISENGAGED, "engage_timeout")
        if self._report_time_s is not None and now_s - self._report_time_s > self.report_timeout_s:
            return self._set(EngageState.DISENGAGED, "report_timeout")
        return None

    def _set(self, state: EngageState, event: str) -> str:
        self.state = state
        self.last_event = event
        return event


@dataclass(frozen=True)
class PacmodLimits:
    steering_ratio: float = 14.8  # steering-wheel angle / road-wheel angle
    max_steering_wheel_angle_rad: float = 5.2  # hard clip on the steering-wheel command


@dataclass(frozen=True)
class PacmodCommand:
    steering_wheel_rad: float  # SteeringCmd.command
    rotation_rate_rad_s: float  # SteeringCmd.rotation_rate (steering wheel)
    accel: float  # SystemCmdFloat.command on accel_cmd, 0..1
    brake: float  # SystemCmdFloat.command on brake_cmd, 0..1


def to_pacmod(actuation: Actuation, limits: ControlLimits, pacmod: PacmodLimits) -> PacmodCommand:
    """Road-wheel angle and signed throttle -> PACMod 3 steering-wheel angle, accel and brake."""
    wheel = clip(
        actuation.steering_rad * pacmod.steering_ratio,
        -pacmod.max_steering_wheel_angle_rad,
        pacmod.max_steering_wheel_angle_rad,
    )
    return PacmodCommand(
        steering_wheel_rad=wheel,
        rotation_rate_rad_s=limits.max_steering_rate_rad_s * pacmod.steering_ratio,
        accel=clip(actuation.throttle, 0.0, limits.max_throttle),
        brake=clip(-actuation.throttle, 0.0, limits.max_brake),
    )
