"""Per-frame policy inference time at several selection rates (the policy column of SPS Table 4).

    python -m sps_driving.train.policy_timing [--policy DIR | --architecture NAME] [--repeats 50] [--device cpu]

Times the architecture of the shipped policy (what the car runs), of a
checkpoint (--policy), or one of config/train.yaml's (--architecture), on the checkpoint's grid
(or --rows, --cols, --descriptor-dim). Grid variants (sps) see all N patches whatever the rate;
sequence variants (spps, transformers only) see only the kept ones, so their time falls with the
rate. Weights are random (timing does not depend on them). A benchmark that prints numbers, not a test.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from tqdm import tqdm

from sps_driving.core.backbones.pixels import NAME as PIXELS_BACKBONE
from sps_driving.core.grid import PatchGrid
from sps_driving.core.policies.checkpoint import DrivingPolicy, read_policy_config
from sps_driving.core.policies.registry import (
    SEQUENCE_ARCHITECTURES,
    TRAINABLE_ARCHITECTURES,
    PolicyArchitecture,
    build_policy,
)
from sps_driving.core.policies.streaming import StreamingPolicy
from sps_driving.core.resources import portable_path, shipped_policy
from sps_driving.core.selection import SelectionConfig
from sps_driving.train.trainer import TRAIN_CONFIG, TrainConfig

RATES = (1.0, 0.5, 0.3)


def time_policy(architecture: PolicyArchitecture, variant: str, rate: float, grid: PatchGrid, descriptor_dim: int,
                backbone: str | None = None, repeats: int = 50, warmup: int = 5, device: str = "cpu") -> float:
    """Median wall time in ms of one frame's command (batch 1; a patch policy with a full window)."""
    config = architecture.config(grid, descriptor_dim, SelectionConfig(variant, rate), backbone=backbone)
    rng = np.random.default_rng(0)
    policy = DrivingPolicy(build_policy(config, rng.normal(size=(grid.n, descriptor_dim))), config, device=device)
    streaming = StreamingPolicy(policy)
    indices = policy.selector.select(0)
    descriptors = rng.normal(size=(len(indices), descriptor_dim)).astype(np.float32)
    times = []
    for run in range(warmup + repeats):
        start = time.perf_counter()
        streaming.predict_full_window(descriptors, indices)
        if run >= warmup:
            times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--policy", help="checkpoint whose architecture and grid are timed (default: the shipped one)")
    source.add_argument("--architecture", choices=TRAINABLE_ARCHITECTURES, help="config/train.yaml's settings of this one")
    parser.add_argument("--descriptor-dim", type=int, help="D (default: the checkpoint's; DINOv2 ViT-S: 384, BLIP-2 head: 64)")
    parser.add_argument("--rows", type=int, help="grid rows (default: the checkpoint's)")
    parser.add_argument("--cols", type=int, help="grid columns (default: the checkpoint's)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.architecture:
        architecture = TrainConfig.from_yaml(TRAIN_CONFIG, cache="-", out="-", architecture=args.architecture).policy_architecture()
        # The shipped policy's grid; a cnn reads the pixels backbone's patches.
        checkpoint = read_policy_config(shipped_policy())
        checkpoint["backbone"] = PIXELS_BACKBONE if args.architecture == "cnn" else checkpoint.get("backbone")
        what = f"config/train.yaml's {args.architecture}"
    else:
        checkpoint = read_policy_config(args.policy or shipped_policy())
        architecture = PolicyArchitecture.of(checkpoint)
        what = f"the architecture of {portable_path(args.policy or shipped_policy())}"
    grid = PatchGrid(args.rows or int(checkpoint["grid"]["rows"]), args.cols or int(checkpoint["grid"]["cols"]))
    descriptor_dim = args.descriptor_dim or int(checkpoint["descriptor_dim"])
    variants = ("sps", "spps") if architecture.name in SEQUENCE_ARCHITECTURES else ("sps",)
    runs = [(variant, rate) for variant in variants for rate in RATES]
    results = {run: time_policy(architecture, *run, grid, descriptor_dim, checkpoint.get("backbone"), args.repeats,
                                device=args.device)
               for run in tqdm(runs, desc="policy timing")}
    settings = ", ".join(f"{k} {v}" for k, v in architecture.settings.items())
    print(f"{architecture.name} policy ({settings}; {what}), grid {grid.rows}x{grid.cols}, D={descriptor_dim}, "
          f"{args.device}, {torch.get_num_threads()} thread(s); median ms per frame:")
    for (variant, rate), ms in results.items():
        print(f"  {variant:5s} rate {rate:.1f}: {ms:7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
