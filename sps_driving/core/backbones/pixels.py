"""The No-FM baseline's backbone: every patch's own pixels, average-pooled; no foundation model.

It sits behind the PatchExtractor protocol on DINOv2's patch grid (14 px patches of the
input_size frame: 224x224 -> 16x16), so feature caches, selection, training and evaluation treat
it like any other backbone and compare on the same patches. Preprocessing is DINOv2's (the
frame's roi, cv2 INTER_AREA resize to input_size, scaled to [0, 1], ImageNet mean and std); each 14x14 px patch is
then averaged over pixel_pool x pixel_pool px blocks into p x p pixels, p = 14 / pixel_pool, and
flattened channel-major ([3, p, p]), so D = 3 p^2 (147 at pixel_pool 2). The CNN policy
(`core.policies.cnn.CnnPolicy`) folds the grid back into that pooled image.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sps_driving.core.backbones import patch_indices
from sps_driving.core.backbones.dinov2 import IMAGENET_MEAN, IMAGENET_STD
from sps_driving.core.grid import PatchGrid
from sps_driving.core.image import check_roi, normalized_pixels

NAME = "pixels"
PATCH_PX = 14  # DINOv2's patch: both baselines and the masked methods see the same grid
POOLS = tuple(s for s in range(1, PATCH_PX + 1) if PATCH_PX % s == 0)  # 1, 2, 7, 14
CHANNELS = 3
# Channels of the fixed 2-D sin-cos position table (position_table(); sequence policies only).
POSITION_DIM = 64


def pooled_side(descriptor_dim: int) -> int | None:
    """p for a pixels descriptor of D = 3 p^2 channels, else None."""
    side = round((descriptor_dim / CHANNELS) ** 0.5)
    return side if side >= 1 and CHANNELS * side * side == descriptor_dim else None


def sincos_position_table(grid: PatchGrid, dim: int = POSITION_DIM) -> np.ndarray:
    """float32 [N, dim] fixed 2-D sin-cos position embeddings (as MAE's): the first half encodes
    the patch row, the second its column, each as sin and cos at dim / 4 frequencies
    1 / 10000^(i / (dim / 4))."""
    if dim < 4 or dim % 4:
        raise ValueError(f"a 2-D sin-cos table needs a multiple of 4 channels, got {dim}")
    quarter = dim // 4
    frequencies = 1.0 / 10000.0 ** (np.arange(quarter) / quarter)

    def encode(positions: np.ndarray) -> np.ndarray:
        angles = positions[:, None] * frequencies[None, :]
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)

    rows, cols = grid.coords.T
    return np.concatenate([encode(rows), encode(cols)], axis=1).astype(np.float32)


@dataclass
class PixelState:
    """One encoded frame: every patch's descriptor [N, D]."""

    patches: np.ndarray


class PixelExtractor:
    """Pooled normalized pixels per patch (the No-FM baseline) behind the PatchExtractor protocol."""

    name = NAME

    def __init__(self, input_size: tuple[int, int] = (224, 224), pixel_pool: int = 2, roi: list[float] | None = None):
        height, width = (int(s) for s in input_size)
        if height <= 0 or width <= 0 or height % PATCH_PX or width % PATCH_PX:
            raise ValueError(f"input_size must be two positive multiples of {PATCH_PX} px, got {list(input_size)}")
        if isinstance(pixel_pool, bool) or pixel_pool not in POOLS:
            raise ValueError(f"pixel_pool must divide the {PATCH_PX} px patch: one of {POOLS} px, got {pixel_pool!r}")
        self.input_size = (height, width)
        self.roi = check_roi(roi)
        self.pixel_pool = int(pixel_pool)
        self.side = PATCH_PX // self.pixel_pool
        self.grid = PatchGrid(height // PATCH_PX, width // PATCH_PX)
        self.dim = CHANNELS * self.side**2

    @classmethod
    def from_config(cls, config: dict) -> PixelExtractor:
        return cls(input_size=tuple(config["input_size"]), pixel_pool=config["pixel_pool"], roi=config.get("roi"))

    def encode(self, image_rgb: np.ndarray) -> PixelState:
        """uint8 HxWx3 RGB -> every patch's pooled pixels; ImageError (a ValueError) on a bad frame."""
        pixels = normalized_pixels(image_rgb, self.input_size, "area", IMAGENET_MEAN, IMAGENET_STD, self.roi)[0]
        rows, cols, side, pool = self.grid.rows, self.grid.cols, self.side, self.pixel_pool
        pooled = pixels.reshape(CHANNELS, rows, side, pool, cols, side, pool).mean(axis=(3, 6))
        # [3, rows, p, cols, p] -> [rows, cols, 3, p, p]: row-major patches, each channel-major
        patches = pooled.transpose(1, 3, 0, 2, 4).reshape(self.grid.n, self.dim)
        return PixelState(np.ascontiguousarray(patches, dtype=np.float32))

    def descriptors(self, state: PixelState, indices: np.ndarray) -> np.ndarray:
        return state.patches[patch_indices(indices, self.grid.n)]

    def runtime_facts(self) -> dict:
        """No model: cv2 resizes and numpy pools, on one thread."""
        return {"backend": "torch", "runtime": f"numpy {np.__version__}", "precision": "fp32", "threads": 1, "device": "cpu"}

    def position_table(self) -> np.ndarray:
        """[N, 64] a fixed 2-D sin-cos table: raw pixels carry no position embedding of their own."""
        return sincos_position_table(self.grid)
