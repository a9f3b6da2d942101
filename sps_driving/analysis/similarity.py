"""Cosine-similarity overlays of one seed patch against all others (SPS appendix A.2, Figure 6).

For seed patch i, s_j = cos(f_i, f_j) over the H' x W' grid, upsampled to the frame and laid
over it as a heatmap: red is high similarity, blue low or negative. Similarity far from the
seed shows how self-attention spreads scene content into every descriptor.

The map is upsampled over the whole frame, which assumes the backbone saw the whole frame
(resized, not cropped).
"""

from __future__ import annotations

import cv2
import numpy as np

from sps_driving.core.grid import PatchGrid

_SEED_MARK_RGB = (255, 255, 255)


def cosine_similarity_map(descriptors: np.ndarray, grid: PatchGrid, seed: int) -> np.ndarray:
    """[rows, cols] cosine similarity of every patch to patch `seed` (0 against an all-zero patch)."""
    x = np.asarray(descriptors, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] != grid.n:
        raise ValueError(f"expected [{grid.n}, D] descriptors for a {grid.rows}x{grid.cols} grid, got {x.shape}")
    if not 0 <= seed < grid.n:
        raise ValueError(f"seed patch {seed} outside the grid of {grid.n} patches")
    norms = np.linalg.norm(x, axis=1)
    unit = x / np.where(norms > 0, norms, 1.0)[:, None]
    return np.clip(unit @ unit[seed], -1.0, 1.0).reshape(grid.rows, grid.cols)


def overlay(image_rgb: np.ndarray, similarity: np.ndarray, opacity: float) -> np.ndarray:
    """uint8 RGB frame with the [rows, cols] similarity map, normalized to [0, 1] (min to max of
    this map, as appendix A.2 does) and blended on top; a constant map shows as all low."""
    if not 0.0 <= opacity <= 1.0:
        raise ValueError(f"overlay opacity must be in [0, 1], got {opacity}")
    height, width = image_rgb.shape[:2]
    # Per-map normalization: descriptors of one frame are mostly positively similar (correlated),
    # so a fixed [-1, 1] scale would paint every map the same colour.
    spread = float(similarity.max() - similarity.min())
    scaled = ((similarity - similarity.min()) / spread if spread > 0 else np.zeros_like(similarity)).astype(np.float32)
    upsampled = cv2.resize(scaled, (width, height), interpolation=cv2.INTER_LINEAR)
    heat_bgr = cv2.applyColorMap(np.round(upsampled * 255).astype(np.uint8), cv2.COLORMAP_JET)
    heat = cv2.cvtColor(heat_bgr, cv2.COLOR_BGR2RGB)
    return cv2.addWeighted(image_rgb, 1.0 - opacity, heat, opacity, 0.0)


def overlay_grid(
    image_rgb: np.ndarray, descriptors: np.ndarray, grid: PatchGrid, cell_width: int, opacity: float
) -> np.ndarray:
    """One image of rows x cols cells: cell (r, c) is the overlay for seed patch r * cols + c,
    its seed patch outlined. Each cell is the frame scaled to `cell_width` pixels wide."""
    height, width = image_rgb.shape[:2]
    cell_height = max(1, round(cell_width * height / width))
    frame = cv2.resize(image_rgb, (cell_width, cell_height), interpolation=cv2.INTER_AREA)
    mosaic = np.zeros((grid.rows * cell_height, grid.cols * cell_width, 3), dtype=np.uint8)
    for seed in range(grid.n):
        row, col = divmod(seed, grid.cols)
        cell = overlay(frame, cosine_similarity_map(descriptors, grid, seed), opacity)
        _outline_patch(cell, grid, row, col)
        mosaic[row * cell_height : (row + 1) * cell_height, col * cell_width : (col + 1) * cell_width] = cell
    return mosaic


def _outline_patch(cell: np.ndarray, grid: PatchGrid, row: int, col: int) -> None:
    height, width = cell.shape[:2]
    top, bottom = round(row * height / grid.rows), round((row + 1) * height / grid.rows) - 1
    left, right = round(col * width / grid.cols), round((col + 1) * width / grid.cols) - 1
    cv2.rectangle(cell, (left, top), (max(left, right), max(top, bottom)), _SEED_MARK_RGB, 1)
