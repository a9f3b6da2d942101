"""A CNN (architecture "cnn", the No-FM baseline): `CnnPolicy` folds the grid of the `pixels`
backbone (each descriptor its patch's pooled pixels) back into an image, zeros at dropped
patches, and runs a PilotNet-like convolution stack and MLP on it; the state inputs are
concatenated to its MLP input."""

from __future__ import annotations

import torch
from torch import nn

from sps_driving.core.backbones.pixels import CHANNELS, pooled_side
from sps_driving.core.backbones.pixels import NAME as PIXELS_BACKBONE
from sps_driving.core.grid import PatchGrid
from sps_driving.core.policies.blocks import BoundedHead, DenseGridInput, PolicySpec, add_state_input, with_state

SETTINGS = ("width", "dropout")
# PilotNet's convolutions (Bojarski et al. 2016): (out channels, kernel px, stride)
PILOTNET_CONVS = ((24, 5, 2), (36, 5, 2), (48, 5, 2), (64, 3, 1), (64, 3, 1))


class CnnPolicy(DenseGridInput, nn.Module):
    """The No-FM baseline: a PilotNet-like CNN on the image the `pixels` backbone's grid folds into.

    Each descriptor is its patch's pooled pixels, channel-major [3, p, p] (D = 3 p^2), so the
    [B, rows * cols, D] grid is the image [B, 3, rows p, cols p]; dropped patches are zeros (the
    mean pixel after normalization). PilotNet's five convolutions (ReLU, padded so any grid
    works) and a two-layer MLP of `width` units feed the shared bounded head.
    """

    def __init__(self, grid: PatchGrid, descriptor_dim: int, width: int, dropout: float, max_steering_rad: float,
                 state_dim: int = 0):
        super().__init__()
        add_state_input(self, state_dim)
        side = pooled_side(descriptor_dim)
        if side is None:
            raise ValueError(
                f"a cnn policy reads the pixels backbone's pooled patches (D = 3 p^2, e.g. 147 at pixel_pool 2); "
                f"descriptor_dim {descriptor_dim} is not one"
            )
        self.grid, self.side = grid, side
        layers, channels, height, width_px = [], CHANNELS, grid.rows * side, grid.cols * side
        for out_channels, kernel, stride in PILOTNET_CONVS:
            layers += [nn.Conv2d(channels, out_channels, kernel, stride, padding=kernel // 2), nn.ReLU()]
            channels, height, width_px = out_channels, -(-height // stride), -(-width_px // stride)
        self.convs = nn.Sequential(*layers)
        self.mlp = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(channels * height * width_px + state_dim, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(),
        )
        self.head = BoundedHead(width, max_steering_rad)

    def grid_image(self, grids: torch.Tensor) -> torch.Tensor:
        """[B, rows * cols, 3 p^2] -> [B, 3, rows p, cols p]: every patch's pixels back in place."""
        rows, cols, side = self.grid.rows, self.grid.cols, self.side
        patches = grids.reshape(grids.shape[0], rows, cols, CHANNELS, side, side)
        return patches.permute(0, 3, 1, 4, 2, 5).reshape(grids.shape[0], CHANNELS, rows * side, cols * side)

    def forward(self, grids: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """grids [B, N, D] with zeros at dropped patches (and states [B, S]) -> [B, 2] (steering rad, throttle)."""
        image_features = self.mlp[:2](self.convs(self.grid_image(grids)))  # flattened, dropout (not on the state)
        return self.head(self.mlp[2:](with_state(self, image_features, state)))



def build(spec: PolicySpec) -> nn.Module:
    if spec.config.get("backbone") != PIXELS_BACKBONE:
        raise ValueError(f"a cnn policy reads the {PIXELS_BACKBONE!r} backbone's pooled pixels, "
                         f"not {spec.config.get('backbone')!r} descriptors")
    return CnnPolicy(spec.grid, spec.descriptor_dim, width=int(spec.settings["width"]),
                     dropout=float(spec.settings["dropout"]), max_steering_rad=spec.max_steering_rad,
                     state_dim=spec.state_dim)
