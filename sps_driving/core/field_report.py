"""A field test's interventions: each end of the stack's driving with its kind, the engaged time and
distance between them, and distance and time per intervention with a Poisson interval.

The stack drives from an engagement until it disengages or a stop begins (the car then brakes
and holds until the safety driver takes over). Each such end is one event, of one kind:
- `override_steering`, `override_brake`, `override_accel`: the safety driver took over by that
  system (its PACMod 3 report showed the override first); `override` where no system report says which;
- `failsafe_stop`: the failsafe found the vehicle interface silent and braked;
- `safety_stop:<failure>`: the safety monitor asked for a stop (lane_boundary, collision, heading;
  `stale_input` when only its inputs went stale);
- `stale_input`: the vehicle interface stopped on a stale or missing input (command, camera,
  reports, speed, the monitor or the failsafe gone quiet);
- `controlled_stop:<reason>`: the vehicle interface stopped for another reason (overspeed, gear, ...);
- `pacmod_fault`, `pacmod_timeout`: the PACMod reported a fault or a CAN timeout and disabled;
- `operator_disengage`: the operator's disengage (no override, fault or timeout): the end of a run,
  not an intervention;
- `requested_handover`: the safety monitor's OOD rule asked the safety driver to take over
  (topics.HANDOVER_EVENTS): a request, listed and counted apart, not an intervention (what ended
  the engagement after it is its own event).
A stop is the event of its episode; the takeover that ends the held stop is not counted again.
Every kind but `operator_disengage` and `requested_handover` is an intervention.

Rates: engaged distance (or time) per intervention, with the exact (Garwood) two-sided Poisson
interval on the count at the configured confidence; with no intervention, the one-sided bound
(distance per intervention at least D / -ln(1 - confidence)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import chi2

from sps_driving.core import topics
from sps_driving.core.monitor import Transition

OPERATOR_DISENGAGE = "operator_disengage"
REQUESTED_HANDOVER = topics.HANDOVER_EVENT
OVERRIDE_KINDS = {topic: f"override_{name}" for name, topic in topics.PACMOD_SYSTEM_REPORTS.items()}
# The vehicle interface's stop reasons (core.control.StopReason) that mean an input went stale or missing.
STALE_REASONS = ("no_command", "command_timeout", "late_command", "camera_timeout", "safety_monitor_timeout",
                 "failsafe_timeout", "report_timeout", "speed_unknown")
DISENGAGEMENT_KINDS = {"fault": "pacmod_fault", "timeout": "pacmod_timeout", "disable": OPERATOR_DISENGAGE}


@dataclass(frozen=True)
class Stop:
    time_ns: int
    source: str  # "safety_monitor", "failsafe" or "vehicle_interface"
    reasons: tuple[str, ...]


@dataclass
class Event:
    time_ns: int
    kind: str
    detail: str  # the report fields or stop reasons that show it
    intervention: bool
    speed_mps: float | None = None
    engaged_s_since: float = 0.0  # the stack's driving since the previous intervention (or the drive's start)
    engaged_m_since: float | None = None
    ended_by: str = ""  # for a stop: the disengagement that ended it
    note: str = ""  # the safety driver's note that followed it
    note_time_ns: int | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def override_kind(fields: tuple[str, ...]) -> str:
    """The system whose report showed the override first ("source: field" labels in order seen)."""
    for label in fields:
        kind = OVERRIDE_KINDS.get(label.split(": ", 1)[0])
        if kind:
            return kind
    return "override"


def stop_kind(stop: Stop, failures: list[tuple[int, str]], window_ns: int) -> str:
    """The kind of a stop; a vehicle interface stop on the safety monitor's request takes the
    failure the monitor logged within `window_ns` before it."""
    if stop.source == "failsafe":
        return "failsafe_stop"
    if stop.source == "safety_monitor":
        found = stop.reasons[0].split(";")[0] if stop.reasons else ""
        failure = found.split(",")[0].strip() if found and not found.startswith("stale") else ""
        return f"safety_stop:{failure or 'stale_input'}"
    reasons = stop.reasons
    if "failsafe_active" in reasons:
        return "failsafe_stop"
    if "safety_stop" in reasons:
        recent = [kind for t, kind in failures if stop.time_ns - window_ns <= t <= stop.time_ns]
        return f"safety_stop:{recent[-1] if recent else 'unknown'}"
    if any(r in STALE_REASONS for r in reasons):
        return "stale_input"
    return f"controlled_stop:{reasons[0] if reasons else 'unknown'}"


def disengagement_kind(transition: Transition) -> str:
    if transition.cause == "override":
        return override_kind(transition.fields)
    return DISENGAGEMENT_KINDS.get(transition.cause, OPERATOR_DISENGAGE)


def handover_events(times_ns: list[int]) -> list[Event]:
    """The safety monitor's handover requests as events that are not interventions."""
    return [Event(t, REQUESTED_HANDOVER, "OOD rule", False) for t in times_ns]


def episodes(transitions: list[Transition], end_ns: int) -> list[tuple[int, Transition | None]]:
    """(engaged at, the disengagement that ended it or None when the recording ended first)."""
    out, start = [], None
    for t in transitions:
        if t.event == "engaged":
            start = t.time_ns
        elif start is not None:
            out.append((start, t))
            start = None
    if start is not None and start < end_ns:
        out.append((start, None))
    return out


def drive_events(transitions: list[Transition], stops: list[Stop], failures: list[tuple[int, str]], end_ns: int,
                 window_ns: int) -> tuple[list[Event], list[tuple[int, int]]]:
    """(every event in time order, the intervals [from, to) ns in which the stack drove)."""
    events, driving = [], []
    for start, end in episodes(transitions, end_ns):
        stop_end = end.time_ns if end is not None else end_ns
        stop = next((s for s in sorted(stops, key=lambda s: s.time_ns) if start <= s.time_ns < stop_end), None)
        if stop is not None:
            driving.append((start, stop.time_ns))
            ended = "" if end is None else f"{disengagement_kind(end)} {(end.time_ns - stop.time_ns) / 1e9:.1f} s later"
            events.append(Event(stop.time_ns, stop_kind(stop, failures, window_ns),
                                f"{stop.source}: {', '.join(stop.reasons) or 'stop'}", True, ended_by=ended))
        elif end is not None:
            driving.append((start, end.time_ns))
            kind = disengagement_kind(end)
            events.append(Event(end.time_ns, kind, ", ".join(end.fields), kind != OPERATOR_DISENGAGE))
        else:
            driving.append((start, end_ns))
    return events, driving


class Odometer:
    """Distance driven by a time, from speeds (m/s) at log times: the trapezoid rule on |speed|,
    a gap with an invalid (NaN) speed at either end counting nothing."""

    def __init__(self, log_ns: np.ndarray, speed_mps: np.ndarray):
        self.t = np.asarray(log_ns, np.int64)
        v = np.abs(np.asarray(speed_mps, np.float64))
        step = 0.5 * (v[1:] + v[:-1]) * np.diff(self.t) * 1e-9
        self.metres = np.concatenate([[0.0], np.cumsum(np.nan_to_num(step, nan=0.0))])
        self.speed = v

    def at(self, time_ns) -> np.ndarray:
        return np.interp(np.asarray(time_ns, np.float64), self.t.astype(np.float64), self.metres)

    def speed_at(self, time_ns: int) -> float | None:
        if not len(self.t):
            return None
        value = float(np.interp(float(time_ns), self.t.astype(np.float64), self.speed))
        return value if math.isfinite(value) else None


def within(intervals: list[tuple[int, int]], start_ns: int, end_ns: int) -> list[tuple[int, int]]:
    """The parts of `intervals` between start_ns and end_ns."""
    return [(max(a, start_ns), min(b, end_ns)) for a, b in intervals if min(b, end_ns) > max(a, start_ns)]


def engaged_between(driving: list[tuple[int, int]], odometer: Odometer | None, start_ns: int,
                    end_ns: int) -> tuple[float, float | None]:
    """(s, m) the stack drove between two times."""
    parts = within(driving, start_ns, end_ns)
    seconds = sum(b - a for a, b in parts) * 1e-9
    if odometer is None:
        return seconds, None
    return seconds, float(sum(odometer.at(b) - odometer.at(a) for a, b in parts))


def fill_since(events: list[Event], driving: list[tuple[int, int]], odometer: Odometer | None, start_ns: int) -> None:
    """Each event's speed, and the stack's driving since the previous intervention."""
    previous = start_ns
    for event in events:
        event.engaged_s_since, event.engaged_m_since = engaged_between(driving, odometer, previous, event.time_ns)
        event.speed_mps = None if odometer is None else odometer.speed_at(event.time_ns)
        if event.intervention:
            previous = event.time_ns


def attach_notes(events: list[Event], notes: list[tuple[int, str]], window_ns: int) -> list[tuple[int, str]]:
    """Give each note to the latest event at or before it within `window_ns`; returns the notes
    that follow none."""
    loose = []
    for time_ns, text in notes:
        before = [e for e in events if e.time_ns <= time_ns <= e.time_ns + window_ns]
        if before:
            event = before[-1]
            event.note = f"{event.note}; {text}" if event.note else text
            event.note_time_ns = event.note_time_ns or time_ns
        else:
            loose.append((time_ns, text))
    return loose


def garwood(count: int, confidence: float) -> tuple[float, float]:
    """The exact two-sided Poisson interval (Garwood 1936) on the mean of a count."""
    if count < 0 or not 0 < confidence < 1:
        raise ValueError(f"need count >= 0 and 0 < confidence < 1, got {count}, {confidence}")
    alpha = 1.0 - confidence
    low = 0.0 if count == 0 else float(chi2.ppf(alpha / 2, 2 * count) / 2)
    return low, float(chi2.ppf(1 - alpha / 2, 2 * count + 2) / 2)


def per_event(amount: float | None, count: int, confidence: float) -> dict:
    """`amount` (km or minutes) per event with its interval: {"value", "low", "high"} (None for
    infinity), or with no event {"value": None, "at_least": one-sided bound}."""
    if amount is None:
        return {"value": None, "low": None, "high": None}
    if count == 0:
        return {"value": None, "at_least": amount / -math.log(1.0 - confidence), "one_sided": True}
    low, high = garwood(count, confidence)
    return {"value": amount / count, "low": amount / high, "high": amount / low}
