"""Real photographs for backbone tests: matplotlib ships them as sample data."""

import cv2
import numpy as np
from matplotlib import cbook


def sample_photo(name: str) -> np.ndarray:
    """uint8 RGB [H, W, 3] of one of matplotlib's sample images."""
    bgr = cv2.imread(str(cbook.get_sample_data(name, asfileobj=False)), cv2.IMREAD_COLOR)
    assert bgr is not None, name
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def tiny_dinov2_policy(directory, variant: str = "sps", rate: float = 0.5):
    """A tiny random transformer policy (real architecture, random weights) over the embedded
    DINOv2 grid (16x16, D = 384), saved at `directory`; returns the directory."""
    import torch

    from sps_driving.core.policy import build_policy, save_policy

    config = {"backbone": "dinov2_vits14", "grid": {"rows": 16, "cols": 16}, "descriptor_dim": 384,
              "selection": {"variant": variant, "rate": rate, "seed": 0},
              "policy": {"width": 16, "depth": 1, "heads": 2, "mlp_ratio": 1.0, "dropout": 0.0},
              "output": {"max_steering_rad": 0.5}}
    if variant in ("spps", "mspps"):
        config["position_dim"] = 384
    torch.manual_seed(0)
    save_policy(build_policy(config), config, directory)
    return directory
