"""The OOD score in evaluation episodes: every frame's scores logged, and the safety monitor's rule
(sps_driving.core.monitor.OodRule) acting on them as in the graph.

With the rule on, the car is slowed by the rule's scale from the frame after a score above the
slow threshold, and a requested handover ends the episode there: the safety driver takes the
wheel. A constant cruise scale (the rule's honest baseline, slower everywhere) slows every frame
instead. How the car is slowed (`SLOW_BY`): a speed cap at the scale times the cruise target,
enforced on the throttle command (sps_driving.core.control.capped_throttle) while the policy reads
its own target, as the graph's vehicle interface does; or the policy's cruise target times the
scale (the first mechanism measured, which made the shipped policy drive faster).

Rows get `ood`: per-frame time, scores of each method (those of the policy's calibration,
sps_driving.core.ood.calibration_methods; HEAD_DISAGREEMENT, for an
ensemble; SELECTION_DISAGREEMENT, with selection draws), the steering command each frame gave
(rad; the report derives scores of the policy's own behaviour from it), the car's true lane pose
(the simulator's lateral offset, m, and heading error, rad: what a score of the car's place in its
lane could know at best), the failure times, the frames driven slowed and the handover's time
(null: none).
"""

from __future__ import annotations

import math

from sps_driving.core.monitor import OodRule, OodRuleConfig
from sps_driving.core.ood import METHODS, SCORE_METHODS

SCORE_DIGITS = 4  # decimals kept of each logged score
SLOW_BY = ("speed_cap", "target")  # the first is the graph's (the vehicle interface's speed cap)


def ood_settings(rule: dict | None, method: str, cruise_scale: float = 1.0, selection_draws: int = 0,
                 slow_by: str = SLOW_BY[0]) -> dict:
    """The `ood` entry of an evaluation's simulator config: the rule's settings (None: off), the
    score it reads, a constant cruise scale, how a scale slows the car (SLOW_BY), and the other
    selections of each frame whose steering spread is logged (0: none;
    sps_driving.core.ood.SelectionDisagreement); checked here so a bad one stops the run, not a
    worker."""
    if rule is not None:
        OodRuleConfig.from_config(rule)
    if method not in SCORE_METHODS:
        raise ValueError(f"OOD score method must be one of {SCORE_METHODS}, got {method!r}")
    if not (math.isfinite(cruise_scale) and 0 < cruise_scale <= 1):
        raise ValueError(f"cruise scale must lie in (0, 1], got {cruise_scale}")
    if rule is not None and cruise_scale != 1.0:
        raise ValueError("the OOD rule and a constant cruise scale are two methods: evaluate them apart")
    if selection_draws != 0 and selection_draws < 2:
        raise ValueError(f"selection draws must be 0 (none) or at least 2, got {selection_draws}")
    if slow_by not in SLOW_BY:
        raise ValueError(f"slow by must be one of {SLOW_BY}, got {slow_by!r}")
    return {"rule": rule, "method": method, "cruise_scale": float(cruise_scale), "selection_draws": int(selection_draws),
            "slow_by": slow_by}


class OodEpisodeLog:
    """One episode's scores (`logged`: the names each frame has) and the rule's state;
    `cruise_scale` is the slow-down of the next frame (1.0: none)."""

    def __init__(self, settings: dict | None, logged: tuple[str, ...] = METHODS):
        settings = settings or {}
        self.method = settings.get("method", METHODS[-1])
        self.fixed_scale = float(settings.get("cruise_scale", 1.0))
        self.slow_by = settings.get("slow_by", SLOW_BY[0])
        rule = settings.get("rule")
        self.rule = None if rule is None else OodRule(OodRuleConfig.from_config(rule))
        self.times: list[float] = []
        self.scores: dict[str, list] = {m: [] for m in logged}
        self.steering: list[float] = []
        self.lane_offset: list[float] = []
        self.heading_error: list[float] = []
        self.failure_times: list[float] = []
        self.slowed_frames = 0
        self.cruise_scale = self.fixed_scale
        self.handover_s: float | None = None

    def frame(self, time_s: float, scores: dict | None, steering_rad: float, lane_offset_m: float = math.nan,
              heading_error_rad: float = math.nan) -> None:
        """A frame's scores (None: a dropped frame, logged as NaN), the steering it was driven with and
        the car's true lane pose, then the rule's step at its time."""
        self.times.append(round(time_s, 3))
        self.steering.append(round(float(steering_rad), SCORE_DIGITS + 1))
        self.lane_offset.append(round(lane_offset_m, SCORE_DIGITS) if math.isfinite(lane_offset_m) else None)
        self.heading_error.append(round(heading_error_rad, SCORE_DIGITS + 1) if math.isfinite(heading_error_rad) else None)
        for m, logged in self.scores.items():
            value = math.nan if scores is None else scores[m]
            logged.append(round(value, SCORE_DIGITS) if math.isfinite(value) else None)
        if self.cruise_scale < 1.0:
            self.slowed_frames += 1
        if self.rule is None:
            return
        if scores is not None:
            self.rule.on_score(scores[self.method], time_s)
        status = self.rule.step(time_s)
        self.cruise_scale = status.cruise_scale
        if status.new_handover and self.handover_s is None:
            self.handover_s = time_s

    def failure(self, time_s: float) -> None:
        self.failure_times.append(round(time_s, 3))

    @property
    def handed_over(self) -> bool:
        return self.handover_s is not None

    def as_dict(self) -> dict:
        return {"method": self.method, "rule": self.rule is not None, "cruise_scale": self.fixed_scale, "slow_by": self.slow_by,
                "time_s": self.times, "scores": self.scores, "steering_rad": self.steering,
                "lane_offset_m": self.lane_offset, "heading_error_rad": self.heading_error, "failure_times_s": self.failure_times,
                "slowed_frames": self.slowed_frames, "frames": len(self.times), "handover_s": self.handover_s}
