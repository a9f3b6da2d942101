"""The interface every per-patch descriptor backend implements (SPS eqs. 1-2).

A backend turns one RGB frame into descriptors for any subset of patch indices. Callers
(the extractor node, the feature-cache writer, the simulator's in-process policy loop,
the benchmark) depend only on this protocol.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from sps_driving.core.grid import PatchGrid


class PatchExtractor(Protocol):
    name: str  # backbone name recorded in feature caches and checkpoints, e.g. "dinov2_vits14"
    grid: PatchGrid  # H' x W' patch grid of the backbone
    dim: int  # descriptor channels D

    def encode(self, image_rgb: np.ndarray) -> object:
        """Run the work shared by all patches of one uint8 HxWx3 RGB frame (resize, normalize,
        backbone layers before the masked one). Returns an opaque per-frame state."""

    def descriptors(self, state: object, indices: np.ndarray) -> np.ndarray:
        """float32 [k, D] descriptors for patch `indices` (int64 [k], row-major) of an encoded frame."""

    def position_table(self) -> np.ndarray:
        """float32 [N, P] the backbone's own patch position embeddings (for SPPS / MSPPS policies)."""
