"""The three failure rules of SPS section 4.2, shared by the on-car safety monitor and the simulator.

A failure is (i) a lane boundary crossed, (ii) a collision or dangerously close approach, or
(iii) heading more than 30 degrees off the lane direction. Each one is one safety-driver
intervention in field tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class Failure(str, Enum):
    LANE = "lane_boundary"
    COLLISION = "collision"
    HEADING = "heading"


@dataclass(frozen=True)
class FailureThresholds:
    # Lateral offset (m) of the vehicle reference point from the lane centre at which the lane
    # boundary counts as crossed: half of a 3.6 m lane.
    lane_boundary_offset_m: float = 1.8
    # Free gap (m) between the vehicle footprint and the nearest obstacle at or below which the
    # approach counts as a collision ("dangerously close").
    min_obstacle_gap_m: float = 1.0
    # Heading error (rad) between the vehicle and the lane direction: 30 degrees.
    max_heading_error_rad: float = math.radians(30.0)

    def __post_init__(self) -> None:
        for name in ("lane_boundary_offset_m", "max_heading_error_rad"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value}")
        if not (math.isfinite(self.min_obstacle_gap_m) and self.min_obstacle_gap_m >= 0):
            raise ValueError(f"min_obstacle_gap_m must be >= 0, got {self.min_obstacle_gap_m}")


def check_failures(
    thresholds: FailureThresholds,
    lateral_offset_m: float,
    heading_error_rad: float,
    obstacle_gap_m: float = math.inf,
) -> list[Failure]:
    """Failures present in one state. A NaN input is unknown, never a failure by itself:
    missing or stale inputs are the monitor's staleness rule, not these."""
    failures = []
    if abs(lateral_offset_m) > thresholds.lane_boundary_offset_m:
        failures.append(Failure.LANE)
    if obstacle_gap_m <= thresholds.min_obstacle_gap_m:
        failures.append(Failure.COLLISION)
    if abs(heading_error_rad) > thresholds.max_heading_error_rad:
        failures.append(Failure.HEADING)
    return failures
