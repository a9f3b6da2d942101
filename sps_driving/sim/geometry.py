"""Planar footprints: oriented rectangles and the free gap between them (failure rule ii)."""

from __future__ import annotations

import math

import numpy as np


def rectangle(x: float, y: float, yaw: float, length: float, width: float) -> np.ndarray:
    """Corners [4, 2] of a length x width rectangle centred at (x, y), long side along yaw."""
    c, s = math.cos(yaw), math.sin(yaw)
    half = np.array([[1, 1], [1, -1], [-1, -1], [-1, 1]], dtype=np.float64) * (length / 2.0, width / 2.0)
    rot = np.array([[c, -s], [s, c]])
    return half @ rot.T + (x, y)


def _separated(a: np.ndarray, b: np.ndarray) -> bool:
    """Separating-axis test for two convex polygons."""
    for poly in (a, b):
        edges = np.roll(poly, -1, axis=0) - poly
        for nx, ny in np.stack([-edges[:, 1], edges[:, 0]], axis=1):
            pa, pb = a @ (nx, ny), b @ (nx, ny)
            if pa.max() < pb.min() or pb.max() < pa.min():
                return True
    return False


def _point_segment_distances(points: np.ndarray, poly: np.ndarray) -> np.ndarray:
    """Distance of every point to every edge of `poly`: [P, E]."""
    start = poly
    edge = np.roll(poly, -1, axis=0) - poly
    rel = points[:, None, :] - start[None, :, :]
    t = np.clip((rel * edge).sum(-1) / np.maximum((edge * edge).sum(-1), 1e-12), 0.0, 1.0)
    nearest = start[None] + t[..., None] * edge[None]
    return np.linalg.norm(points[:, None, :] - nearest, axis=-1)


def polygon_gap(a: np.ndarray, b: np.ndarray) -> float:
    """Free distance (m) between two convex polygons; 0 when they touch or overlap."""
    if not _separated(a, b):
        return 0.0
    return float(min(_point_segment_distances(a, b).min(), _point_segment_distances(b, a).min()))
