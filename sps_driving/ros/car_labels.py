"""Labels from the car's own drives: what the safety driver did, read from a recording's PACMod 3
reports (pacmod3_msgs, ROS 2 layout), for `sps-driving extract` and `sps-driving replay`.

Each camera frame gets the reports' outputs linearly interpolated to its header stamp: the
steering-wheel angle (`steering_rpt.output`, rad) as the policy's road-wheel angle through the
configured steering ratio, the pedals (`accel_rpt.output`, `brake_rpt.output`, 0..1) as one
signed throttle (core.control.from_pacmod: the vehicle interface's split read backwards) and
the vehicle speed (`vehicle_speed_rpt`, m/s) as the speed state input. Two reports of a topic
around the stamp further apart than `max_report_gap_s` (or none on one side) give no label.

A handover (an engagement, a disengagement or a safety-driver override) changes who drives. A
label is never made of reports from both sides of one (the frame is dropped, `across_handover`),
and a frame within `handover_guard_s` of one, by log time, is dropped as `near_engage`,
`near_disengage` or `near_override`: around a handover, wheel and pedals are partly the human's
and partly the stack's.

Only the human's driving is the expert: a frame while the stack drove (PACMod enabled without
an override) is left out unless `label_stack_driving`; so are frames in reverse (the shift
report's gear, when recorded, or a negative speed) and at standstill (below `min_speed_mps`).
Who drove when comes from the engagement history `sps-driving interventions` reads (the drive's,
sps_driving.ros.drive, by log time, so a frame is placed by its log time);
its safety-driver overrides are the interventions, and the frames within
`intervention_window_s` after each are marked: the states where the stack failed, labelled by
the human who took over (what human-gated DAgger trains on).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import yaml

from sps_driving.core import topics
from sps_driving.core.control import from_pacmod
from sps_driving.core.resources import config_path
from sps_driving.core.state import PACMOD_SPEED_REPORT, nearest
from sps_driving.ros.drive import Drive
from sps_driving.ros.engagement import BOOL, GLOBAL_RPT, SYSTEM_RPT_FLOAT, SYSTEM_RPT_INT

# The reports every label is made of: name -> (topic, message type).
REPORTS = {
    "steering_wheel_rad": (topics.PACMOD_STEERING_RPT, SYSTEM_RPT_FLOAT),
    "accel": (topics.PACMOD_ACCEL_RPT, SYSTEM_RPT_FLOAT),
    "brake": (topics.PACMOD_BRAKE_RPT, SYSTEM_RPT_FLOAT),
    "speed_mps": (topics.PACMOD_SPEED_RPT, PACMOD_SPEED_REPORT),
}
GEAR_REPORT = (topics.PACMOD_SHIFT_RPT, SYSTEM_RPT_INT)  # optional: the gear, for the reverse rule
# Reports that say whether the stack drives (sps_driving.ros.engagement reads them).
ENGAGEMENT_REPORTS = ((topics.PACMOD_GLOBAL_RPT, GLOBAL_RPT), (topics.PACMOD_ENABLED, BOOL))
HANDOVERS = ("engage", "disengage", "override")
# Why a frame gets no label, in the order the rules are applied.
# Where a bag's labels come from: the reference command, the car's reports, or the first of them the bag has.
LABEL_SOURCES = ("auto", "command", "pacmod3")
DROP_REASONS = ("stack_driving", *(f"near_{kind}" for kind in HANDOVERS), "report_gap", "across_handover", "speed_invalid",
                "reverse", "standstill")


@dataclass(frozen=True)
class CarLabelRules:
    """Which frames of a car recording become labels (config/train.yaml `extract:` has the values in use)."""

    max_report_gap_s: float = 0.1  # s between the two reports of a topic around a frame
    min_speed_mps: float = 0.5  # m/s; slower is standstill (0: keep every forward frame)
    exclude_reverse: bool = True
    label_stack_driving: bool = False  # true: frames while the stack drove are labels too
    intervention_window_s: float = 3.0  # s after each override whose frames are marked
    handover_guard_s: float = 0.1  # s before and after each handover whose frames are dropped (0: none)

    def __post_init__(self) -> None:
        if not (self.max_report_gap_s > 0 and self.min_speed_mps >= 0 and self.intervention_window_s >= 0
                and self.handover_guard_s >= 0):
            raise ValueError("need max_report_gap_s > 0, and min_speed_mps, intervention_window_s and handover_guard_s >= 0")


@dataclass(frozen=True)
class HumanLabel:
    """A frame's label, or why it has none (`drop_reason`; the values are then NaN)."""

    steering: float  # road-wheel angle, rad, left positive
    throttle: float  # [-1, 1], negative = brake
    speed_mps: float
    intervention: bool  # within intervention_window_s after a safety-driver override
    drop_reason: str | None = None


def has_reports(present: dict) -> bool:
    """Whether a recording with topics `present` ({topic: message type}) has every report labels need."""
    return all(present.get(topic) == msgtype for topic, msgtype in REPORTS.values())


def missing_reports(present: dict, rules: CarLabelRules) -> list[str]:
    """The report topics (with their types) a recording lacks for labels under `rules`."""
    missing = [f"{topic} ({msgtype})" for topic, msgtype in REPORTS.values() if present.get(topic) != msgtype]
    if not rules.label_stack_driving and not any(present.get(t) == m for t, m in ENGAGEMENT_REPORTS):
        # Without them the stack's own driving could not be told from the human's.
        missing.append(" or ".join(f"{t} ({m})" for t, m in ENGAGEMENT_REPORTS))
    return missing


def bracket(stamps: np.ndarray, at_ns: int, max_gap_ns: int) -> tuple[int, float] | None:
    """Where `at_ns` falls in a report series (sorted int64 stamps): (i, f) with the value at it
    values[i] + f (values[i + 1] - values[i]); None when the reports around it are further apart
    than `max_gap_ns` or one side has none."""
    right = int(np.searchsorted(stamps, at_ns, side="right"))
    left = right - 1
    if left >= 0 and stamps[left] == at_ns:
        return left, 0.0
    if left < 0 or right >= len(stamps) or int(stamps[right]) - int(stamps[left]) > max_gap_ns:
        return None
    return left, (at_ns - int(stamps[left])) / (int(stamps[right]) - int(stamps[left]))


def interpolate(values: np.ndarray, where: tuple[int, float]) -> float:
    """The value of a series at a `bracket` position (NaN where a report used is NaN)."""
    i, fraction = where
    return float(values[i]) if fraction == 0.0 else float(values[i] + fraction * (values[i + 1] - values[i]))


def _series(drive: Drive, topic: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A report series of the drive in stamp order: (stamps, values, log times)."""
    series = drive.series.get(topic)
    if series is None:  # recorded, but not one message
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64)
    order = np.argsort(series.stamp_ns, kind="stable")
    return series.stamp_ns[order], series.values[order, 0], series.log_ns[order]


def label_source(present: dict, chosen: str, command_topic: str) -> str:
    """"command" or "pacmod3": where the labels of a bag with topics `present` ({topic: message
    type}) come from. auto: the reference command when the bag has it (the world's bags), else
    the PACMod 3 reports."""
    if chosen not in LABEL_SOURCES:
        raise ValueError(f"label_source must be one of {LABEL_SOURCES}, got {chosen!r}")
    if chosen != "auto":
        return chosen
    return "command" if command_topic in present or not has_reports(present) else "pacmod3"


def configured_rules(path=None) -> tuple[CarLabelRules, str]:
    """(the car-label rules, the label source) of config/train.yaml's `extract:` section."""
    section = (yaml.safe_load(Path(path or config_path("train.yaml")).read_text()) or {}).get("extract", {})
    names = {f.name for f in fields(CarLabelRules)}
    return CarLabelRules(**{k: v for k, v in section.items() if k in names}), section.get("label_source", "auto")


class CarLabels:
    """The human's commands of one recording, ready to label its frames (`label`)."""

    def __init__(self, reports: dict, gear: tuple | None, transitions: list, rules: CarLabelRules, steering_ratio: float,
                 sources: dict):
        """reports: {name of REPORTS: (stamps, values, log times)}, speed NaN where invalid; gear:
        (stamps, values) of the shift report or None; transitions: the engagement history
        (core.monitor.Transition, by log time); sources: {topic: role} of that history."""
        if not (math.isfinite(steering_ratio) and steering_ratio > 0):
            raise ValueError(f"steering_ratio must be a positive number, got {steering_ratio!r}")
        self.reports, self.gear, self.rules, self.steering_ratio = reports, gear, rules, float(steering_ratio)
        self.autonomy = autonomy_spans(transitions)
        self._autonomy_starts = [start for start, _ in self.autonomy]
        self.interventions = [t for t in transitions if t.cause == "override"]
        self._override_times = sorted(t.time_ns for t in self.interventions)
        # (log time ns, kind) of every handover, in time order
        self.handovers = sorted((t.time_ns, handover_kind(t)) for t in transitions)
        self._handover_times = np.asarray([time for time, _ in self.handovers], dtype=np.int64)
        self.sources = dict(sources)
        self.max_gap_ns = int(round(rules.max_report_gap_s * 1e9))
        self.window_ns = int(round(rules.intervention_window_s * 1e9))
        self.guard_ns = int(round(rules.handover_guard_s * 1e9))

    def stack_driving(self, log_time_ns: int) -> bool:
        i = bisect.bisect_right(self._autonomy_starts, log_time_ns) - 1
        return i >= 0 and log_time_ns < self.autonomy[i][1]

    def after_override(self, log_time_ns: int) -> bool:
        i = bisect.bisect_right(self._override_times, log_time_ns) - 1
        return i >= 0 and log_time_ns - self._override_times[i] < self.window_ns

    def near_handover(self, log_time_ns: int) -> str | None:
        """The kind of the handover nearest to `log_time_ns` when it is within the guard."""
        i = nearest(self._handover_times, log_time_ns)
        if i is None or abs(int(self._handover_times[i]) - log_time_ns) >= self.guard_ns:
            return None
        return self.handovers[i][1]

    def across_handover(self, where: dict) -> bool:
        """Whether the reports a label is made of (`bracket` positions by report name) were
        recorded on both sides of a handover."""
        used = []
        for name, (i, fraction) in where.items():
            log_times = self.reports[name][2]
            used += [log_times[i], log_times[i + 1]] if fraction > 0 else [log_times[i]]
        # A report logged at a handover is the one that shows it: it is on the side after.
        return bool(np.any((self._handover_times > min(used)) & (self._handover_times <= max(used))))

    def reverse_gear(self, stamp_ns: int) -> bool:
        """The latest shift report at or before the frame says reverse."""
        if self.gear is None:
            return False
        stamps, values = self.gear
        i = int(np.searchsorted(stamps, stamp_ns, side="right")) - 1
        return i >= 0 and int(values[i]) == shift_reverse()

    def label(self, stamp_ns: int, log_time_ns: int) -> HumanLabel:
        """The label of the frame with header stamp `stamp_ns`, recorded at `log_time_ns`."""
        def dropped(reason: str) -> HumanLabel:
            return HumanLabel(math.nan, math.nan, math.nan, False, reason)

        if not self.rules.label_stack_driving and self.stack_driving(log_time_ns):
            return dropped("stack_driving")
        handover = self.near_handover(log_time_ns)
        if handover:
            return dropped(f"near_{handover}")
        where = {name: bracket(stamps, stamp_ns, self.max_gap_ns) for name, (stamps, _, _) in self.reports.items()}
        if any(w is None for w in where.values()):
            return dropped("report_gap")
        if self.across_handover(where):
            return dropped("across_handover")
        at = {name: interpolate(values, where[name]) for name, (_, values, _) in self.reports.items()}
        if not math.isfinite(at["speed_mps"]):
            return dropped("speed_invalid")
        if self.rules.exclude_reverse and (self.reverse_gear(stamp_ns) or at["speed_mps"] < 0):
            return dropped("reverse")
        if abs(at["speed_mps"]) < self.rules.min_speed_mps:
            return dropped("standstill")
        steering, throttle = from_pacmod(at["steering_wheel_rad"], at["accel"], at["brake"], self.steering_ratio)
        return HumanLabel(steering, throttle, at["speed_mps"], self.after_override(log_time_ns))

    def describe(self) -> dict:
        """What the labels were made from and by which rules (the feature cache's metadata)."""
        return {
            "from": "pacmod3 reports",
            "reports": {name: topic for name, (topic, _) in REPORTS.items()},
            "steering": f"{topics.PACMOD_STEERING_RPT} output (steering-wheel rad) / steering_ratio",
            "throttle": f"{topics.PACMOD_ACCEL_RPT} output - {topics.PACMOD_BRAKE_RPT} output",
            "steering_ratio": self.steering_ratio,
            "reverse_from": ([GEAR_REPORT[0]] if self.gear is not None else []) + ["negative speed"],
            "engagement_from": self.sources,
            "rules": asdict(self.rules),
            "interventions": [{"time_ns": t.time_ns, "fields": list(t.fields)} for t in self.interventions],
            "handovers": {kind: sum(k == kind for _, k in self.handovers) for kind in HANDOVERS},
        }


def handover_kind(transition) -> str:
    """"engage", "override" (a safety driver's) or "disengage" (any other cause) of a Transition."""
    if transition.event == "engaged":
        return "engage"
    return "override" if transition.cause == "override" else "disengage"


def autonomy_spans(transitions: list) -> list[tuple[int, float]]:
    """[(start, end)] log times (ns) the stack drove; the end of one still open at the end is inf."""
    spans, start = [], None
    for transition in transitions:
        if transition.event == "engaged":
            start = transition.time_ns
        elif start is not None:
            spans.append((start, transition.time_ns))
            start = None
    if start is not None:  # still engaged when the recording ended
        spans.append((start, math.inf))
    return spans


def shift_reverse() -> int:
    """SystemRptInt.SHIFT_REVERSE of the PACMod 3 message definitions."""
    from sps_driving.ros.bagio import TYPESTORE

    return int(TYPESTORE.types[SYSTEM_RPT_INT].SHIFT_REVERSE)


def read_car_labels(drive: Drive, rules: CarLabelRules, steering_ratio: float) -> CarLabels:
    """The PACMod 3 reports and the engagement history of a drive. ValueError when it lacks reports
    labels need (`missing_reports`)."""
    missing = missing_reports(drive.topics, rules)
    if missing:
        raise ValueError(f"bag {drive.path} has no {', '.join(missing)}: no labels from the car's reports")
    reports = {name: _series(drive, topic) for name, (topic, _) in REPORTS.items()}
    has_gear = drive.topics.get(GEAR_REPORT[0]) == GEAR_REPORT[1] and GEAR_REPORT[0] in drive.series
    gear = _series(drive, GEAR_REPORT[0])[:2] if has_gear else None
    transitions = drive.engagement.transitions if drive.engagement is not None else []
    return CarLabels(reports, gear, transitions, rules, steering_ratio, drive.engagement_sources)
