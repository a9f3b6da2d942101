"""Safety-monitor logic and intervention counting on top of core/failures.py. Pure logic, no ROS.

`SafetyMonitor` runs live (safety_monitor node): it flags the three failures of SPS section 4.2,
treats missing or stale required inputs as unsafe, requests a stop while either holds, and counts
one intervention per failure episode (no failure -> at least one failure). `AutonomyLog` counts
safety-driver interventions in a recorded field test from the drive-by-wire reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sps_driving.core.failures import Failure, FailureThresholds, check_failures

INPUTS = ("lane", "obstacle")


@dataclass(frozen=True)
class MonitorConfig:
    thresholds: FailureThresholds = field(default_factory=FailureThresholds)
    max_input_age_s: float = 0.5  # an input older than this is stale
    # Stale or missing required inputs request a stop. Lane state is required by default (without
    # it no failure can be seen); the obstacle range is optional (no obstacle sensor on some cars).
    required_inputs: tuple[str, ...] = ("lane",)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_input_age_s) and self.max_input_age_s > 0):
            raise ValueError(f"max_input_age_s must be positive, got {self.max_input_age_s}")
        unknown = set(self.required_inputs) - set(INPUTS)
        if unknown:
            raise ValueError(f"unknown required inputs {sorted(unknown)}; expected some of {INPUTS}")


@dataclass(frozen=True)
class MonitorStatus:
    failures: tuple[Failure, ...]  # failures present now
    new_failures: tuple[Failure, ...]  # failures that began at this step
    stale_inputs: tuple[str, ...]  # required inputs missing or older than max_input_age_s
    stop_requested: bool
    interventions: int  # failure episodes so far
    failure_counts: dict  # Failure -> onsets so far


class SafetyMonitor:
    def __init__(self, config: MonitorConfig):
        self.config = config
        self._lane: tuple[float, float] | None = None
        self._lane_time_s: float | None = None
        self._gap = math.inf
        self._gap_time_s: float | None = None
        self._active: set[Failure] = set()
        self.interventions = 0
        self.failure_counts = {f: 0 for f in Failure}
        self.invalid_inputs = 0

    def on_lane(self, lateral_offset_m: float, heading_error_rad: float, now_s: float) -> bool:
        """A NaN/Inf lane state is counted and ignored (the input then goes stale). Returns validity."""
        if not (math.isfinite(lateral_offset_m) and math.isfinite(heading_error_rad)):
            self.invalid_inputs += 1
            return False
        self._lane = (float(lateral_offset_m), float(heading_error_rad))
        self._lane_time_s = now_s
        return True

    def on_obstacle(self, gap_m: float, now_s: float) -> bool:
        """+inf means no obstacle in range (REP 117); NaN or a negative gap is invalid."""
        if math.isnan(gap_m) or gap_m < 0:
            self.invalid_inputs += 1
            return False
        self._gap = float(gap_m)
        self._gap_time_s = now_s
        return True

    def _fresh(self, time_s: float | None, now_s: float) -> bool:
        return time_s is not None and now_s - time_s <= self.config.max_input_age_s

    def step(self, now_s: float) -> MonitorStatus:
        lane_fresh = self._fresh(self._lane_time_s, now_s)
        gap_fresh = self._fresh(self._gap_time_s, now_s)
        stale = tuple(
            name
            for name, fresh in (("lane", lane_fresh), ("obstacle", gap_fresh))
            if name in self.config.required_inputs and not fresh
        )
        lateral, heading = self._lane if lane_fresh else (math.nan, math.nan)
        failures = check_failures(self.config.thresholds, lateral, heading, self._gap if gap_fresh else math.inf)
        new = tuple(f for f in failures if f not in self._active)
        if failures and not self._active:
            self.interventions += 1
        for f in new:
            self.failure_counts[f] += 1
        self._active = set(failures)
        return MonitorStatus(
            failures=tuple(failures),
            new_failures=new,
            stale_inputs=stale,
            stop_requested=bool(failures or stale),
            interventions=self.interventions,
            failure_counts=dict(self.failure_counts),
        )


@dataclass(frozen=True)
class Transition:
    time_ns: int
    event: str  # "engaged", "override" or "disabled"


class AutonomyLog:
    """Engagement history of a field test from drive-by-wire reports, fed in time order.

    Autonomous = the latest `enabled` says enabled and no report source shows an override. Each
    end of an autonomy episode is one safety-driver intervention ("override": a pedal or the wheel
    was used; "disabled": the disengage button). Several report sources going off for one takeover
    are one transition, since only the combined state is tracked.
    """

    def __init__(self) -> None:
        self.transitions: list[Transition] = []
        self._enabled = False
        self._overrides: dict[str, bool] = {}
        self._autonomous = False
        self._since_ns: int | None = None
        self.autonomy_ns = 0
        self.autonomy_distance_m = 0.0
        self.total_distance_m = 0.0
        self._speed: tuple[int, float] | None = None
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        self.has_speed = False

    @property
    def interventions(self) -> list[Transition]:
        return [t for t in self.transitions if t.event != "engaged"]

    def _touch(self, time_ns: int) -> None:
        if self.first_ns is None:
            self.first_ns = time_ns
        self.last_ns = time_ns if self.last_ns is None else max(self.last_ns, time_ns)

    def on_report(self, time_ns: int, source: str, enabled: bool | None, override_active: bool | None) -> None:
        """One report; None leaves that flag of the state unchanged (e.g. a Bool `enabled` topic)."""
        self._touch(time_ns)
        if enabled is not None:
            self._enabled = bool(enabled)
        if override_active is not None:
            self._overrides[source] = bool(override_active)
        overridden = any(self._overrides.values())
        autonomous = self._enabled and not overridden
        if autonomous and not self._autonomous:
            self._since_ns = time_ns
            self.transitions.append(Transition(time_ns, "engaged"))
        elif self._autonomous and not autonomous:
            self.autonomy_ns += time_ns - self._since_ns
            self.transitions.append(Transition(time_ns, "override" if overridden else "disabled"))
        self._autonomous = autonomous

    def on_speed(self, time_ns: int, speed_mps: float) -> None:
        if not math.isfinite(speed_mps):
            return
        self._touch(time_ns)
        self.has_speed = True
        if self._speed is not None:
            t0, v0 = self._speed
            dist = 0.5 * (abs(v0) + abs(speed_mps)) * max(time_ns - t0, 0) * 1e-9
            self.total_distance_m += dist
            if self._autonomous:
                self.autonomy_distance_m += dist
        self._speed = (time_ns, float(speed_mps))

    def finish(self) -> None:
        """Close an autonomy episode still open at the end of the recording (not an intervention)."""
        if self._autonomous and self.last_ns is not None:
            self.autonomy_ns += self.last_ns - self._since_ns
            self._since_ns = self.last_ns

    def summary(self) -> dict:
        count = len(self.interventions)
        hours = self.autonomy_ns / 3.6e12
        km = self.autonomy_distance_m / 1000.0
        return {
            "interventions": count,
            "overrides": sum(t.event == "override" for t in self.transitions),
            "disables": sum(t.event == "disabled" for t in self.transitions),
            "engagements": sum(t.event == "engaged" for t in self.transitions),
            "recording_s": 0.0 if self.first_ns is None else (self.last_ns - self.first_ns) * 1e-9,
            "autonomy_s": self.autonomy_ns * 1e-9,
            "autonomy_km": km if self.has_speed else None,
            "total_km": self.total_distance_m / 1000.0 if self.has_speed else None,
            "interventions_per_hour": count / hours if hours > 0 else None,
            "interventions_per_km": count / km if self.has_speed and km > 0 else None,
            "transitions": [{"time_ns": t.time_ns, "event": t.event} for t in self.transitions],
        }
