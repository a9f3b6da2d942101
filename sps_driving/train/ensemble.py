"""`sps-driving ensemble --out DIR CHECKPOINT CHECKPOINT ...`: one policy of several trained
checkpoints of one method, the mean of their commands (sps_driving.core.policies.ensemble). The
checkpoints must read the same descriptors, selection, state inputs and output bound; their
weights are copied unchanged, head i from the i-th checkpoint.

    sps-driving ensemble --out runs/ens_sps50pt runs/sps50pt_s0 runs/sps50pt_s1 runs/sps50pt_s2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoints", nargs="+", type=Path, help="the trained checkpoints, its heads in order")
    parser.add_argument("--out", type=Path, required=True, help="the ensemble's checkpoint folder (must not exist)")


def make_ensemble(checkpoints: list[Path], out: Path) -> Path:
    """Write the ensemble of `checkpoints` to `out`; ValueError if they cannot be one policy."""
    from sps_driving.core.policies.checkpoint import load_policy, save_policy
    from sps_driving.core.policies.ensemble import ensemble_config, of_heads
    from sps_driving.core.resources import portable_path

    if out.exists():
        raise ValueError(f"{out} exists: choose a new folder for the ensemble")
    heads = [load_policy(path) for path in checkpoints]
    config = ensemble_config([head.config for head in heads], [portable_path(path) for path in checkpoints])
    return save_policy(of_heads([head.module for head in heads]), config, out)


def run(args) -> int:
    try:
        out = make_ensemble(args.checkpoints, args.out)
    except (OSError, ValueError) as error:
        print(f"ensemble: {error}", file=sys.stderr)
        return 2
    print(f"ensemble of {len(args.checkpoints)} checkpoints: {out}")
    return 0
