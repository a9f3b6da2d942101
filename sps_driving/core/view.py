"""Where a policy looks: the centre of the region of interest on the patch grid, a policy's window
on a wider grid, and the extraction settings of a wider view.

The extraction resizes the frame's region of interest (`roi`, sps_driving.core.image) to its
input size, which the backbone tiles into the patch grid. The grid covers the roi exactly, so the
roi's centre is the grid's centre, ((rows - 1) / 2, (cols - 1) / 2) in patch coordinates (the row
and column of patch centres), whichever patches a selection keeps.

A wider view (`view_width_scale` S; the world renders one with sps_driving.sim.config.widen_view):
the camera renders S times as many columns at the same focal length, so the nominal frame is the
central 1/S of the wide one, pixel for pixel. `widen_extraction` keeps the roi's centre, makes it
S times as wide and the input S times as wide, so every patch covers the pixels it covered and
the nominal grid is the central window of a grid S times as wide (16x16 -> 16x24 and the road
band's 12x24 -> 12x36 at S = 1.5). A policy that reads a window around the centre (a
`relative_query` policy, or a grid MLP with a canvas) runs there unchanged: `WindowSelector`
selects its patches in that window exactly as on the nominal grid for the same frame stamp.
"""

from __future__ import annotations

import math

import numpy as np

from sps_driving.core.grid import PatchGrid
from sps_driving.core.image import check_roi
from sps_driving.core.selection import PatchSelector

# Fractions of the frame are rounded to this many decimals (the px edges are rounded from them).
ROI_DECIMALS = 12


def grid_center(grid: PatchGrid) -> tuple[float, float]:
    """The roi's centre in patch coordinates (row, col): the grid's, which tiles the roi."""
    return (grid.rows - 1) / 2, (grid.cols - 1) / 2


def view_record(grid: PatchGrid, roi) -> dict:
    """What a checkpoint records of where the policy looked: the roi ([top, bottom, left, right]
    fractions of the frame, null for the whole frame), its centre as fractions of the frame
    (row, col) and in patch coordinates of the grid (row, col)."""
    roi = check_roi(roi)
    top, bottom, left, right = roi if roi is not None else (0.0, 1.0, 0.0, 1.0)
    return {"roi": roi, "center_frame": [(top + bottom) / 2, (left + right) / 2], "center_patch": list(grid_center(grid))}


def window_origin(window: PatchGrid, grid: PatchGrid) -> tuple[int, int]:
    """(row, col) of `window`'s first cell when it is centred on `grid`, which must hold it on
    whole cells (an even number of extra rows and columns); ValueError otherwise."""
    extra_rows, extra_cols = grid.rows - window.rows, grid.cols - window.cols
    if extra_rows < 0 or extra_cols < 0 or extra_rows % 2 or extra_cols % 2:
        raise ValueError(f"a {window.rows}x{window.cols} window cannot be centred on whole cells of a {grid.rows}x{grid.cols} "
                         f"grid: it needs at least as many rows and columns, and an even number more of each")
    return extra_rows // 2, extra_cols // 2


def wider_grid(grid: PatchGrid, scale: float) -> PatchGrid:
    """The grid of a view `scale` times as wide (`widen_extraction`): as many rows, cols * scale columns."""
    cols = grid.cols * float(scale)
    if not (scale >= 1 and math.isclose(cols, round(cols), abs_tol=1e-9)):
        raise ValueError(f"view width scale {scale} must be >= 1 and give a whole number of columns from {grid.cols}")
    wide = PatchGrid(grid.rows, int(round(cols)))
    window_origin(grid, wide)
    return wide


def widen_extraction(config: dict, scale: float) -> dict:
    """Extraction settings for a frame rendered `scale` times as wide at the same focal length:
    the roi about the same centre, `scale` times as wide (as fractions of the wide frame), and an
    input `scale` times as wide, so a patch covers the same pixels (module docstring). The roi
    always fits: the nominal frame lies in the middle of the wide one."""
    scale = float(scale)
    if not scale >= 1:
        raise ValueError(f"view width scale must be >= 1, got {scale}")
    if not config.get("input_size"):
        raise ValueError(f"backbone {config.get('backbone')!r} has no input_size setting to widen")
    height, width = (int(v) for v in config["input_size"])
    wide_width = width * scale
    if not math.isclose(wide_width, round(wide_width), abs_tol=1e-9):
        raise ValueError(f"view width scale {scale} does not give a whole number of input px from {width} px")
    roi = check_roi(config.get("roi"))
    if roi is not None:
        top, bottom, left, right = roi
        middle, half = (left + right) / 2, scale * (right - left) / 2
        # x (fraction of the nominal frame) -> (x + (scale - 1) / 2) / scale (fraction of the wide one)
        left, right = ((x + (scale - 1) / 2) / scale for x in (middle - half, middle + half))
        roi = [top, bottom, *(min(1.0, max(0.0, round(x, ROI_DECIMALS))) for x in (left, right))]
    return {**config, "input_size": [height, int(round(wide_width))], "roi": roi}


class WindowSelector:
    """A policy's selection on a wider grid: its own selector's patches of the `window` grid it
    was trained on, placed in that window centred on `grid` (the same cells relative to the
    centre for the same stamp); no patch outside the window is selected."""

    def __init__(self, selector: PatchSelector, grid: PatchGrid):
        self.selector, self.grid, self.config = selector, grid, selector.config
        top, left = window_origin(selector.grid, grid)
        rows, cols = np.divmod(np.arange(selector.grid.n), selector.grid.cols)
        self.cells = ((rows + top) * grid.cols + cols + left).astype(np.int64)  # window index -> grid index

    @property
    def sparse_sequence(self) -> bool:
        return self.selector.sparse_sequence

    def select(self, stamp_ns: int) -> np.ndarray:
        """Sorted int64 patch indices of `grid` kept for the frame stamped `stamp_ns`."""
        return self.cells[self.selector.select(stamp_ns)]

    def stamp_masks(self, stamps_ns) -> np.ndarray:
        """bool [B, grid.n] keep masks of `select` for each stamp."""
        masks = np.zeros((len(stamps_ns), self.grid.n), dtype=bool)
        masks[:, self.cells] = self.selector.stamp_masks(stamps_ns)
        return masks
