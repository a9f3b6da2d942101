"""State inputs: what a policy may read besides the camera frame, the one place that lists them.

The expert's throttle tracks (cruise target speed - current speed), and neither is visible in a
camera frame; a policy that outputs throttle needs them as inputs (policy config `state_inputs`).
Each input has a name (its unit in the name, as in the checkpoint), a unit, what it means and
where it is read: the topics that carry it (sps_driving.core.topics; first the one preferred when a
recording has several) with their message type, whose value `sps_driving.ros.msgs.speed_from_message`
reads. Recordings are matched to camera frames by header stamp (`sps-driving extract`, the policy
node), and the in-process simulator passes them directly (sps_driving.sim.episodes).

A policy standardizes each input with training statistics kept in its checkpoint; `state_vector`
turns a {name: value} mapping into the policy's input vector and refuses a missing or non-finite
value: a frame without a known state is dropped, never driven from a guess.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sps_driving.core import topics

TWIST = "geometry_msgs/msg/TwistStamped"  # linear.x
PACMOD_SPEED_REPORT = "pacmod3_msgs/msg/VehicleSpeedRpt"  # vehicle_speed, when vehicle_speed_valid


@dataclass(frozen=True)
class StateInput:
    name: str
    unit: str
    meaning: str
    sources: tuple[tuple[str, str], ...]  # (topic, message type), the preferred first


STATE_INPUTS = {
    spec.name: spec
    for spec in (
        StateInput(
            "speed_mps", "m/s", "the car's forward speed",
            # The drive-by-wire's own measurement first: a car recording with both carries it.
            ((topics.PACMOD_SPEED_RPT, PACMOD_SPEED_REPORT), (topics.VEHICLE_TWIST, TWIST)),
        ),
        StateInput(
            "target_speed_mps", "m/s",
            "the cruise target speed the safety driver set (as for adaptive cruise control); the expert tracks it, "
            "slower in curves",
            ((topics.TARGET_SPEED, TWIST),),
        ),
    )
}
STATE_NAMES = tuple(STATE_INPUTS)
# The vehicle interface's backend (config/graph.yaml) -> the topic the car's speed is read from
# there: the same report the vehicle interface holds its speed cap with.
SPEED_TOPICS = {"pacmod3": topics.PACMOD_SPEED_RPT, "topics": topics.VEHICLE_TWIST}


def live_source(name: str, vehicle_backend: str) -> tuple[str, str]:
    """(topic, message type) a live graph reads state input `name` from: the car's speed from the
    report the vehicle interface's backend reads (SPEED_TOPICS), the others from their first topic."""
    spec = STATE_INPUTS[name]
    if name != "speed_mps":
        return spec.sources[0]
    if vehicle_backend not in SPEED_TOPICS:
        raise ValueError(f"unknown vehicle backend {vehicle_backend!r}; expected one of {list(SPEED_TOPICS)}")
    return next(source for source in spec.sources if source[0] == SPEED_TOPICS[vehicle_backend])


def recorded_source(name: str, present: Mapping[str, str]) -> tuple[str, str] | None:
    """The first source (topic, message type) of state input `name` that a recording with topics
    `present` ({topic: message type}) has, or None."""
    return next(((t, msgtype) for t, msgtype in STATE_INPUTS[name].sources if present.get(t) == msgtype), None)


def recorded_vehicle_backend(present: Mapping[str, str]) -> str:
    """The vehicle backend whose speed report a recording with topics `present` carries, read the
    way `recorded_source` reads it ("topics" when it has none)."""
    source = recorded_source("speed_mps", present)
    return next((backend for backend, topic in SPEED_TOPICS.items() if source and source[0] == topic), "topics")


def check_state_names(names: Sequence[str]) -> tuple[str, ...]:
    """`names` as a tuple, or ValueError when one is unknown or repeated."""
    names = tuple(names)
    unknown = [n for n in names if n not in STATE_INPUTS]
    if unknown:
        raise ValueError(f"unknown state inputs {unknown}; expected some of {list(STATE_NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"state inputs repeat a name: {list(names)}")
    return names


def state_vector(names: Sequence[str], state: Mapping[str, float] | None) -> np.ndarray:
    """float32 [len(names)] of `state`'s values in the order of `names`; ValueError when one is
    missing or not a finite number (the caller drops the frame)."""
    values = []
    for name in names:
        value = None if state is None else state.get(name)
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"the policy reads state input {name} ({STATE_INPUTS[name].unit}), and none was given") from None
        if not math.isfinite(value):
            raise ValueError(f"state input {name} is {value}, not a finite number")
        values.append(value)
    return np.asarray(values, dtype=np.float32)


def nearest(stamps: np.ndarray, stamp: int) -> int | None:
    """Index of the stamp in sorted int64 `stamps` nearest to `stamp` (None when there is none)."""
    if len(stamps) == 0:
        return None
    right = int(np.searchsorted(stamps, stamp))
    candidates = [i for i in (right - 1, right) if 0 <= i < len(stamps)]
    return min(candidates, key=lambda i: abs(int(stamps[i]) - stamp))


class StateUnavailable(ValueError):
    """No usable value of a state input for a frame; `kind` is "missing", "stale" or "invalid"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class StateTracker:
    """The recent values of some state inputs by header stamp, for the frames a live policy sees.

    A frame's value of an input is the received one whose stamp is nearest to the frame's stamp
    (as `sps-driving extract` pairs them for training), if within that input's `max_age_s`;
    an input with a `fallback` uses it until its first message arrives. `at(stamp)` raises
    StateUnavailable for a frame without a fresh, valid value of every input.
    """

    def __init__(self, max_age_s: Mapping[str, float], fallback: Mapping[str, float] | None = None, history: int = 256):
        check_state_names(list(max_age_s))
        self.max_age_ns = {name: int(round(float(age) * 1e9)) for name, age in max_age_s.items()}
        self.fallback = dict(fallback or {})
        self.history = history
        self._stamps: dict[str, list[int]] = {name: [] for name in max_age_s}
        self._values: dict[str, list[float]] = {name: [] for name in max_age_s}

    def add(self, name: str, stamp_ns: int, value: float | None) -> None:
        """A received value (None or non-finite: the sender said it is not valid then)."""
        stamps, values = self._stamps[name], self._values[name]
        position = int(np.searchsorted(stamps, stamp_ns, side="right"))
        stamps.insert(position, int(stamp_ns))
        values.insert(position, math.nan if value is None else float(value))
        if len(stamps) > self.history:
            del stamps[0], values[0]

    def at(self, stamp_ns: int) -> dict[str, float]:
        state = {}
        for name, max_age_ns in self.max_age_ns.items():
            stamps = self._stamps[name]
            if not stamps:
                if name in self.fallback:
                    state[name] = float(self.fallback[name])
                    continue
                raise StateUnavailable("missing", f"no {name} received yet")
            index = nearest(np.asarray(stamps, dtype=np.int64), stamp_ns)
            age_ns = abs(stamps[index] - int(stamp_ns))
            if age_ns > max_age_ns:
                raise StateUnavailable(
                    "stale", f"{name} stale: the nearest is {age_ns / 1e9:.3f} s from the frame (limit {max_age_ns / 1e9:g} s)")
            value = self._values[name][index]
            if not math.isfinite(value):
                raise StateUnavailable("invalid", f"{name} not valid at the frame (its report says so, or it is not finite)")
            state[name] = value
        return state
