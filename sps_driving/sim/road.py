"""Curved roads: a centerline from piecewise-linear curvature (straights, clothoid transitions,
arcs), and the lane frame (arc length s, lateral offset left positive, heading error).

The reference line is the centre of the ego lane; the oncoming lane lies to its left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def wrap_angle(a: float) -> float:
    return (a + math.pi) % (2.0 * math.pi) - math.pi


@dataclass(frozen=True)
class LanePose:
    s: float  # m along the reference line
    lateral: float  # m, left positive
    heading_error: float  # rad, vehicle yaw minus lane direction, wrapped to [-pi, pi)


class Road:
    """Centerline sampled every `sample_m` from a curvature profile kappa(s) (1/m)."""

    def __init__(self, knots_s: np.ndarray, knots_kappa: np.ndarray, sample_m: float, lane_width_m: float, shoulder_m: float):
        self.knots_s = np.asarray(knots_s, dtype=np.float64)
        self.knots_kappa = np.asarray(knots_kappa, dtype=np.float64)
        self.lane_width = float(lane_width_m)
        self.shoulder = float(shoulder_m)
        self.length = float(self.knots_s[-1])
        self.s = np.arange(0.0, self.length + 1e-9, sample_m)
        self.kappa = np.interp(self.s, self.knots_s, self.knots_kappa)
        ds = np.diff(self.s)
        # Heading integrates curvature exactly for a piecewise-linear profile (trapezoid rule).
        self.heading = np.concatenate([[0.0], np.cumsum(0.5 * (self.kappa[1:] + self.kappa[:-1]) * ds)])
        mid = self.heading[:-1] + 0.5 * np.diff(self.heading)
        self.x = np.concatenate([[0.0], np.cumsum(np.cos(mid) * ds)])
        self.y = np.concatenate([[0.0], np.cumsum(np.sin(mid) * ds)])
        self._sample = float(sample_m)

    def curvature_at(self, s: float) -> float:
        return float(np.interp(s, self.knots_s, self.knots_kappa))

    def max_curvature(self, s0: float, s1: float) -> float:
        lo, hi = self._index(s0), self._index(s1) + 1
        return float(np.abs(self.kappa[lo : hi + 1]).max())

    def pose_at(self, s: float) -> tuple[float, float, float]:
        """(x, y, heading) of the reference line at arc length s."""
        s = min(max(s, 0.0), self.length)
        return (float(np.interp(s, self.s, self.x)), float(np.interp(s, self.s, self.y)), float(np.interp(s, self.s, self.heading)))

    def point(self, s: float, lateral: float) -> tuple[float, float]:
        x, y, h = self.pose_at(s)
        return x - lateral * math.sin(h), y + lateral * math.cos(h)

    def points(self, s: np.ndarray, lateral: np.ndarray) -> np.ndarray:
        """[..., 2] world points of lane-frame coordinates (vectorized `point`)."""
        s = np.clip(s, 0.0, self.length)
        h = np.interp(s, self.s, self.heading)
        x = np.interp(s, self.s, self.x) - lateral * np.sin(h)
        y = np.interp(s, self.s, self.y) + lateral * np.cos(h)
        return np.stack([x, y], axis=-1)

    def heading_at(self, s: np.ndarray) -> np.ndarray:
        return np.interp(np.clip(s, 0.0, self.length), self.s, self.heading)

    def _index(self, s: float) -> int:
        return int(min(max(round(s / self._sample), 0), len(self.s) - 1))

    def to_lane(self, x: float, y: float, yaw: float, s_hint: float, window_m: float = 30.0) -> LanePose:
        """Project a world pose onto the reference line, searching near `s_hint`."""
        lo = self._index(s_hint - window_m)
        hi = max(self._index(s_hint + window_m), lo + 1)
        d2 = (self.x[lo : hi + 1] - x) ** 2 + (self.y[lo : hi + 1] - y) ** 2
        i = lo + int(np.argmin(d2))
        i = min(i, len(self.s) - 2)
        # Refine on the segment from the nearest sample, toward the side the point lies on.
        best = None
        for j in (max(i - 1, 0), i):
            ax, ay = self.x[j], self.y[j]
            ex, ey = self.x[j + 1] - ax, self.y[j + 1] - ay
            seg2 = ex * ex + ey * ey
            t = min(max(((x - ax) * ex + (y - ay) * ey) / seg2, 0.0), 1.0)
            px, py = ax + t * ex, ay + t * ey
            dist2 = (x - px) ** 2 + (y - py) ** 2
            if best is None or dist2 < best[0]:
                best = (dist2, j, t, px, py, ex, ey)
        _, j, t, px, py, ex, ey = best
        s = self.s[j] + t * (self.s[j + 1] - self.s[j])
        heading = self.heading[j] + t * (self.heading[j + 1] - self.heading[j])
        lateral = (ex * (y - py) - ey * (x - px)) / math.hypot(ex, ey)
        return LanePose(float(s), float(lateral), wrap_angle(yaw - heading))


def generate_road(rng: np.random.Generator, config: dict) -> Road:
    """A random road: an initial straight, then straights, clothoid transitions and arcs."""
    road = config["road"]
    knots_s, knots_k = [0.0], [0.0]
    s = road["start_s_m"] + rng.uniform(*road["straight_m"])
    knots_s.append(s)
    knots_k.append(0.0)
    while s < road["length_m"]:
        radius = rng.uniform(road["min_radius_m"], road["max_radius_m"])
        kappa = rng.choice([-1.0, 1.0]) / radius
        for length, k in (
            (rng.uniform(*road["transition_m"]), kappa),
            (rng.uniform(*road["arc_m"]), kappa),
            (rng.uniform(*road["transition_m"]), 0.0),
            (rng.uniform(*road["straight_m"]), 0.0),
        ):
            s += length
            knots_s.append(s)
            knots_k.append(k)
    return Road(np.array(knots_s), np.array(knots_k), road["sample_m"], road["lane_width_m"], road["shoulder_m"])
