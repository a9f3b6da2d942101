"""Safety-monitor logic and intervention counting on top of core/failures.py. Pure logic, no ROS.

`SafetyMonitor` runs live (safety_monitor node): it flags the three failures of SPS section 4.2,
treats missing or stale required inputs as unsafe, requests a stop while either holds, and counts
one intervention per failure episode (no failure -> at least one failure). `AutonomyLog` counts
safety-driver interventions (overrides) in a recorded field test from the drive-by-wire reports,
and the other disengagements by cause (fault, timeout, disable).
"""

from __future__ import annotations

import math
from collections import deque
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
        """REP 117: +inf means nothing in range, -inf an obstacle too close to measure (a gap of
        0 m); NaN or another negative gap is invalid."""
        if math.isnan(gap_m) or (gap_m < 0 and gap_m != -math.inf):
            self.invalid_inputs += 1
            return False
        self._gap = max(float(gap_m), 0.0)
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


# A disengagement's causes, highest precedence first: when the reports around one disengagement
# show several, the safety driver's takeover counts first, then a fault, then a timeout.
CAUSES = ("override", "fault", "timeout", "disable")
# Reports within this of the end of autonomy (before and after, s) decide its cause. The PACMod
# reports arrive at about 30 Hz (33 ms) on several topics; the driver clears enable on the report
# after a fault, so a fault or timeout flag shows up to about two periods before enable goes off,
# and the flags of the same CAN cycle can arrive on other topics a period after it. 0.2 s covers
# that with recording jitter to spare while staying far shorter than a re-engagement takes.
CAUSE_WINDOW_S = 0.2


@dataclass(frozen=True)
class Transition:
    time_ns: int
    event: str  # "engaged" or "disengaged"
    cause: str = ""  # of a disengagement: one of CAUSES
    fields: tuple[str, ...] = ()  # "source: field" of the reports that show the cause
    other_fields: tuple[str, ...] = ()  # signs of lower-precedence causes in the same window

    def as_dict(self) -> dict:
        if self.event == "engaged":
            return {"time_ns": self.time_ns, "event": self.event}
        return {
            "time_ns": self.time_ns, "event": self.event, "cause": self.cause,
            "fields": list(self.fields), "other_fields": list(self.other_fields),
        }


@dataclass
class _Pending:
    """A disengagement whose cause waits for the reports that follow it within the window."""

    index: int  # its place in AutonomyLog.transitions
    time_ns: int
    episode_start_ns: int  # when the autonomy episode it ends began
    trigger: str  # the report field that ended autonomy
    signs: dict = field(default_factory=dict)  # cause -> labels, in the order seen

    def add(self, cause: str, label: str) -> None:
        labels = self.signs.setdefault(cause, [])
        if label not in labels:
            labels.append(label)


class AutonomyLog:
    """Engagement history of a field test from drive-by-wire reports, fed in time order.

    Autonomous = the latest `enabled` says enabled and no report source shows an override. Several
    report sources going off for one takeover are one transition, since only the combined state is
    tracked. Each end of autonomy is a disengagement whose cause comes from every report within
    CAUSE_WINDOW_S of it, by the precedence of CAUSES: "override" (a pedal or the wheel: the only
    safety-driver intervention), "fault", "timeout", else "disable" (the operator's button or the
    stack). A flag already set when the autonomy episode began did not end it and is not a sign.
    Causes are final once the window after a disengagement has passed, or at `finish()`.
    """

    def __init__(self, cause_window_s: float = CAUSE_WINDOW_S) -> None:
        if not (math.isfinite(cause_window_s) and cause_window_s >= 0):
            raise ValueError(f"cause_window_s must be finite and not negative, got {cause_window_s}")
        self.cause_window_ns = int(round(cause_window_s * 1e9))
        self.transitions: list[Transition] = []
        self._enabled = False
        self._overrides: dict[str, str] = {}  # source -> its override label, while it shows one
        self._autonomous = False
        self._since_ns: int | None = None
        self._set_since: dict[str, dict[str, int]] = {}  # source -> {label: time set without a break}
        self._recent: deque = deque()  # (time_ns, cause, label, set_since_ns) of signs within the window
        self._pending: list[_Pending] = []
        self.autonomy_ns = 0
        self.autonomy_distance_m = 0.0
        self.total_distance_m = 0.0
        self._speed: tuple[int, float] | None = None
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        self.has_speed = False

    @property
    def interventions(self) -> list[Transition]:
        """Safety-driver overrides."""
        return [t for t in self.transitions if t.cause == "override"]

    def _touch(self, time_ns: int) -> None:
        if self.first_ns is None:
            self.first_ns = time_ns
        self.last_ns = time_ns if self.last_ns is None else max(self.last_ns, time_ns)

    def on_report(
        self,
        time_ns: int,
        source: str,
        enabled: bool | None,
        override_active: bool | None,
        faults: tuple[str, ...] = (),
        timeouts: tuple[str, ...] = (),
        override_field: str = "override_active",
        disabled_field: str = "enabled=false",
    ) -> None:
        """One report. None leaves that part of the state unchanged (e.g. a Bool `enabled` topic has no
        override flag). faults, timeouts: names of this report's flags that are set; override_field,
        disabled_field: how this report shows an override and not being enabled, for the record."""
        self._touch(time_ns)
        self._settle(time_ns)
        signs = [("fault", name) for name in faults] + [("timeout", name) for name in timeouts]
        if override_active:
            signs.insert(0, ("override", override_field))
        was_set = self._set_since.get(source, {})
        now_set = {f"{source}: {name}": was_set.get(f"{source}: {name}", time_ns) for _, name in signs}
        self._set_since[source] = now_set
        for cause, name in signs:
            label = f"{source}: {name}"
            self._recent.append((time_ns, cause, label, now_set[label]))
            for pending in self._pending:
                if now_set[label] >= pending.episode_start_ns:
                    pending.add(cause, label)
        while self._recent and self._recent[0][0] < time_ns - self.cause_window_ns:
            self._recent.popleft()

        if enabled is not None:
            self._enabled = bool(enabled)
        if override_active is not None:
            if override_active:
                self._overrides[source] = f"{source}: {override_field}"
            else:
                self._overrides.pop(source, None)
        autonomous = self._enabled and not self._overrides
        if autonomous and not self._autonomous:
            self._since_ns = time_ns
            self.transitions.append(Transition(time_ns, "engaged"))
        elif self._autonomous and not autonomous:
            self.autonomy_ns += time_ns - self._since_ns
            trigger = next(iter(self._overrides.values())) if self._overrides else f"{source}: {disabled_field}"
            pending = _Pending(len(self.transitions), time_ns, self._since_ns, trigger)
            for _, cause, label, set_since in self._recent:
                if set_since >= self._since_ns:
                    pending.add(cause, label)
            self.transitions.append(Transition(time_ns, "disengaged"))
            self._pending.append(pending)
        self._autonomous = autonomous

    def _settle(self, now_ns: float) -> None:
        """Decide the cause of every disengagement whose window has passed by now_ns."""
        while self._pending and self._pending[0].time_ns + self.cause_window_ns < now_ns:
            p = self._pending.pop(0)
            cause = next((c for c in CAUSES[:-1] if p.signs.get(c)), "disable")
            fields = tuple(p.signs[cause]) if cause != "disable" else (p.trigger,)
            others = tuple(label for c in CAUSES if c != cause for label in p.signs.get(c, ()))
            self.transitions[p.index] = Transition(p.time_ns, "disengaged", cause, fields, others)

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
        """Decide the causes still open and close an autonomy episode still open at the end of the
        recording (not a disengagement)."""
        self._settle(math.inf)
        if self._autonomous and self.last_ns is not None:
            self.autonomy_ns += self.last_ns - self._since_ns
            self._since_ns = self.last_ns

    def summary(self) -> dict:
        """Counts and rates after `finish()`: interventions are safety-driver overrides only; the
        other disengagements are counted by cause."""
        count = len(self.interventions)
        hours = self.autonomy_ns / 3.6e12
        km = self.autonomy_distance_m / 1000.0
        return {
            "interventions": count,
            "disengagements": {c: sum(t.cause == c for t in self.transitions) for c in CAUSES[1:]},
            "engagements": sum(t.event == "engaged" for t in self.transitions),
            "recording_s": 0.0 if self.first_ns is None else (self.last_ns - self.first_ns) * 1e-9,
            "autonomy_s": self.autonomy_ns * 1e-9,
            "autonomy_km": km if self.has_speed else None,
            "total_km": self.total_distance_m / 1000.0 if self.has_speed else None,
            "interventions_per_hour": count / hours if hours > 0 else None,
            "interventions_per_km": count / km if self.has_speed and km > 0 else None,
            "cause_window_s": self.cause_window_ns * 1e-9,
            "transitions": [t.as_dict() for t in self.transitions],
        }


@dataclass(frozen=True)
class OodRuleConfig:
    """The reaction to the OOD score (sps_driving.core.ood); the defaults are config/ood.yaml's rule
    (units and reasons there)."""

    slow_threshold: float = 1.1
    cruise_scale: float = 0.5
    slow_hold_s: float = 2.0
    handover_threshold: float = 1.3
    handover_after_s: float = 1.0
    handover_clear_threshold: float = 1.1
    handover_clear_s: float = 2.0
    handover_timeout_s: float = 5.0
    max_score_age_s: float = 0.5

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"OOD rule: {name} must be a finite number >= 0, got {value}")
        if not 0 < self.cruise_scale <= 1:
            raise ValueError(f"OOD rule: cruise_scale must lie in (0, 1], got {self.cruise_scale}")
        if not self.handover_clear_threshold <= self.handover_threshold:
            raise ValueError(f"OOD rule: handover_clear_threshold {self.handover_clear_threshold} must not exceed "
                             f"handover_threshold {self.handover_threshold} (the hysteresis band)")
        if self.max_score_age_s <= 0:
            raise ValueError(f"OOD rule: max_score_age_s must be positive, got {self.max_score_age_s}")

    @classmethod
    def from_config(cls, rule: dict) -> OodRuleConfig:
        unknown = set(rule) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"OOD rule: unknown settings {sorted(unknown)}")
        return cls(**{name: float(value) for name, value in rule.items()})


@dataclass(frozen=True)
class OodStatus:
    score: float  # the latest score (NaN: none yet or stale)
    stale: bool  # no score within max_score_age_s
    slowed: bool  # the car is slowed
    cruise_scale: float  # the fraction of the cruise target the speed is capped at now (1.0 when not slowed)
    handover_requested: bool
    new_handover: bool  # the request began at this step
    stop_requested: bool  # a request went unanswered for handover_timeout_s
    handovers: int  # requests so far


class OodRule:
    """Score -> slow-down (a fraction of the cruise target), handover request (with hysteresis) and, unanswered, a stop.

    Slowed while the score is above slow_threshold and for slow_hold_s after. A handover is requested
    once the score has stayed above handover_threshold for handover_after_s, and ends once it has
    stayed below handover_clear_threshold for handover_clear_s (or by `clear`, the safety driver
    taking over); a request open for handover_timeout_s asks for a controlled stop. A stale score
    lowers nothing and keeps an open request open: no evidence is not evidence of being back in
    distribution."""

    def __init__(self, config: OodRuleConfig):
        self.config = config
        self._score = math.nan
        self._score_time_s: float | None = None
        self._above_slow_s: float | None = None  # last time above slow_threshold
        self._above_since_s: float | None = None  # since when above handover_threshold without a break
        self._below_since_s: float | None = None  # since when below handover_clear_threshold, while requested
        self._requested_since_s: float | None = None
        self.handovers = 0
        self.invalid_scores = 0

    def on_score(self, score: float, now_s: float) -> bool:
        """A non-finite or negative score is counted and ignored. Returns validity."""
        if not (math.isfinite(score) and score >= 0):
            self.invalid_scores += 1
            return False
        c = self.config
        self._score, self._score_time_s = float(score), now_s
        if score > c.slow_threshold:
            self._above_slow_s = now_s
        if score > c.handover_threshold:
            self._above_since_s = now_s if self._above_since_s is None else self._above_since_s
        else:
            self._above_since_s = None
        if score < c.handover_clear_threshold:
            self._below_since_s = now_s if self._below_since_s is None else self._below_since_s
        else:
            self._below_since_s = None
        return True

    def clear(self) -> None:
        """The safety driver took over: the open request is answered."""
        self._requested_since_s = None
        self._above_since_s = None

    def step(self, now_s: float) -> OodStatus:
        c = self.config
        stale = self._score_time_s is None or now_s - self._score_time_s > c.max_score_age_s
        slowed = not stale and self._above_slow_s is not None and now_s - self._above_slow_s <= c.slow_hold_s
        new = False
        if self._requested_since_s is None:
            if not stale and self._above_since_s is not None and now_s - self._above_since_s >= c.handover_after_s:
                self._requested_since_s, new = now_s, True
                self.handovers += 1
                self._below_since_s = None
        elif not stale and self._below_since_s is not None and now_s - self._below_since_s >= c.handover_clear_s:
            self._requested_since_s = None
        requested = self._requested_since_s is not None
        return OodStatus(
            score=math.nan if stale else self._score, stale=stale, slowed=slowed,
            cruise_scale=c.cruise_scale if slowed else 1.0, handover_requested=requested, new_handover=new,
            stop_requested=requested and now_s - self._requested_since_s >= c.handover_timeout_s,
            handovers=self.handovers,
        )
