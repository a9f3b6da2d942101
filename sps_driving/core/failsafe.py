"""The failsafe's decision, as pure logic (no ROS).

The PACMod 3 driver re-sends the last command it received every 33 ms and has no timeout of its
own, so a vehicle interface that is killed (`kill -9`, out of memory) or frozen (SIGSTOP, a hung
interpreter) while engaged would leave the car on its last accelerator and steering command. The
failsafe is a separate small process that watches the vehicle interface's per-period heartbeat and
the car's reports. When the heartbeat has been silent for `silence_timeout_s` while the car reports
drive-by-wire enabled, it commands the controlled stop itself (accelerator 0, stop_brake, steering
held at its measured angle, hazard lights) every period, and holds it until the safety driver
takes over (an override, or the car disabled): then it sends disable a few times and goes quiet,
so the driver holds a disabled car. When the heartbeat comes back it goes quiet at once.

It acts only after it has heard the vehicle interface at least once: a car enabled by something
else before the stack ever ran is none of its business. And it does not take a stall of its own
for the vehicle interface's silence: after a period that came later than the silence limit (this
process stopped, or starved of CPU), it judges on the next one, once the heartbeats sent meanwhile
have been taken in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class FailsafeState(str, Enum):
    IDLE = "idle"  # the vehicle interface is alive (or the car is not enabled)
    STOPPING = "stopping"  # commanding the controlled stop
    RELEASING = "releasing"  # the safety driver took over: sending disable, then quiet


@dataclass(frozen=True)
class FailsafeCommand:
    enable: bool
    steering_wheel_rad: float  # hold the measured angle
    accel: float  # 0..1
    brake: float  # 0..1
    hazards: bool


class Failsafe:
    RELEASE_PERIODS = 15  # disable commands sent after a takeover (0.5 s at 30 Hz)

    def __init__(self, silence_timeout_s: float, stop_brake: float):
        if not (math.isfinite(silence_timeout_s) and silence_timeout_s > 0):
            raise ValueError(f"silence_timeout_s must be positive, got {silence_timeout_s!r}")
        if not (math.isfinite(stop_brake) and 0 < stop_brake <= 1):
            raise ValueError(f"stop_brake is a pedal fraction in (0, 1], got {stop_brake!r}")
        self.silence_timeout_s = silence_timeout_s
        self.stop_brake = stop_brake
        self.state = FailsafeState.IDLE
        self.trips = 0
        self._heartbeat_s: float | None = None
        self._tick_s: float | None = None
        self._car_enabled = False
        self._override = False
        self._steering_wheel_rad = 0.0
        self._release_left = 0

    @property
    def active(self) -> bool:
        return self.state is not FailsafeState.IDLE

    def on_heartbeat(self, now_s: float) -> None:
        self._heartbeat_s = now_s

    def on_car(self, enabled: bool, override: bool) -> None:
        """The global report: any system enabled, any override active."""
        self._car_enabled = bool(enabled)
        self._override = bool(override)

    def on_steering(self, steering_wheel_rad: float) -> None:
        if math.isfinite(steering_wheel_rad):
            self._steering_wheel_rad = float(steering_wheel_rad)

    def tick(self, now_s: float) -> FailsafeCommand | None:
        """What to send this period; None = nothing (the vehicle interface is in charge)."""
        stalled = self._tick_s is not None and now_s - self._tick_s > self.silence_timeout_s
        self._tick_s = now_s
        silent = self._heartbeat_s is not None and now_s - self._heartbeat_s > self.silence_timeout_s
        if not silent:
            self.state = FailsafeState.IDLE
            return None
        if self.state is FailsafeState.IDLE:
            if not self._car_enabled or self._override or stalled:
                return None
            self.state = FailsafeState.STOPPING
            self.trips += 1
        if self.state is FailsafeState.STOPPING and (self._override or not self._car_enabled):
            self.state = FailsafeState.RELEASING
            self._release_left = self.RELEASE_PERIODS
        if self.state is FailsafeState.STOPPING:
            return FailsafeCommand(True, self._steering_wheel_rad, 0.0, self.stop_brake, True)
        if self._release_left > 0:
            self._release_left -= 1
            return FailsafeCommand(False, self._steering_wheel_rad, 0.0, self.stop_brake, False)
        return None
