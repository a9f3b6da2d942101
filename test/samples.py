"""Test samples: real photographs for backbone tests (matplotlib ships them as sample data) and
tiny random policies of the real architectures."""

import cv2
import numpy as np
from matplotlib import cbook


def sample_photo(name: str) -> np.ndarray:
    """uint8 RGB [H, W, 3] of one of matplotlib's sample images."""
    bgr = cv2.imread(str(cbook.get_sample_data(name, asfileobj=False)), cv2.IMREAD_COLOR)
    assert bgr is not None, name
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


# Tiny settings of the real architectures: the grid MLP (what ships), the transformers (which
# the sequence-fed variants, spps and mspps, need), the CNN (No-FM, on the pixels backbone), the
# patch policy (windows of 3 frames 0.1 s apart) and the relative-query policy.
TINY_SETTINGS = {"mlp": {"width": 16, "reduce": 2, "dropout": 0.0},
                 "transformer": {"width": 16, "depth": 1, "heads": 2, "mlp_ratio": 2.0, "dropout": 0.0},
                 "positional_transformer": {"width": 16, "depth": 1, "heads": 2, "mlp_ratio": 2.0, "dropout": 0.0,
                                            "reduce": 2},
                 "cnn": {"width": 16, "dropout": 0.0},
                 "patch_policy": {"width": 16, "depth": 1, "heads": 2, "mlp_ratio": 2.0, "dropout": 0.0, "reduce": 2,
                                  "window_frames": 3, "frame_stride_s": 0.1, "stride_tolerance_s": 0.015, "max_gap_s": 0.5,
                                  "shared_selection": False},
                 "relative_query": {"width": 16, "depth": 1, "heads": 2, "mlp_ratio": 2.0, "dropout": 0.0, "reduce": 2,
                                    "query_stride": 1, "readout": "flatten"}}


def tiny_policy(directory, rows=8, cols=8, dim=16, variant="sps", rate=0.5, seed=0, backbone="dinov2_vits14",
                architecture=None, state_inputs=()):
    """A tiny random policy (real architecture, random weights) saved as a checkpoint at
    `directory`; returns the directory. The architecture is the shipped one, the grid MLP, unless
    the variant feeds the kept patches as a sequence (then the positional transformer) or one is named; it
    reads `state_inputs` (sps_driving.core.state names) besides, standardized as if speeds were
    spread 8 +- 2 m/s."""
    import torch

    from sps_driving.core.grid import PatchGrid
    from sps_driving.core.policies.checkpoint import save_policy
    from sps_driving.core.policies.registry import SEQUENCE_ARCHITECTURES, PolicyArchitecture, build_policy
    from sps_driving.core.selection import SelectionConfig

    selection = SelectionConfig(variant, rate, seed)
    name = architecture or (SEQUENCE_ARCHITECTURES[0] if selection.sparse_sequence else "mlp")
    config = PolicyArchitecture(name, TINY_SETTINGS[name], 0.5).config(PatchGrid(rows, cols), dim, selection,
                                                                       backbone=backbone, position_dim=dim,
                                                                       state_inputs=state_inputs)
    torch.manual_seed(seed)
    policy = build_policy(config)
    if state_inputs:
        policy.state.set_statistics([8.0] * len(state_inputs), [2.0] * len(state_inputs))
    return save_policy(policy, config, directory)


def tiny_dinov2_policy(directory, variant: str = "sps", rate: float = 0.5, architecture=None, state_inputs=()):
    """A tiny random policy over the embedded DINOv2 grid (16x16, D = 384): see tiny_policy."""
    return tiny_policy(directory, 16, 16, 384, variant, rate, architecture=architecture, state_inputs=state_inputs)
