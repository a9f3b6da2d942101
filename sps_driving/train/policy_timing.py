"""Per-frame policy inference time at several selection rates (the policy column of SPS Table 4).

    python -m sps_driving.train.policy_timing [--descriptor-dim 384] [--repeats 50] [--device cpu]

Grid policies (SPS) see all N tokens whatever the rate; sequence policies (SPPS) see only the
kept ones, so their time falls with the rate. Weights are random (timing does not depend on
them); dims come from config/train.yaml. A benchmark that prints numbers, not a test.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from tqdm import tqdm

from sps_driving.core.grid import PatchGrid
from sps_driving.core.policy import DrivingPolicy, build_policy
from sps_driving.core.selection import SelectionConfig
from sps_driving.train.trainer import TRAIN_CONFIG, TrainConfig


def time_policy(variant: str, rate: float, grid: PatchGrid, descriptor_dim: int, cfg: TrainConfig,
                repeats: int = 50, warmup: int = 5, device: str = "cpu") -> float:
    """Median wall time in ms of one `DrivingPolicy.predict` call (one frame, batch 1)."""
    config = {
        "grid": {"rows": grid.rows, "cols": grid.cols},
        "descriptor_dim": descriptor_dim,
        "selection": SelectionConfig(variant, rate).to_dict(),
        "policy": {"width": cfg.width, "depth": cfg.depth, "heads": cfg.heads, "mlp_ratio": cfg.mlp_ratio,
                   "dropout": cfg.dropout},
        "output": {"max_steering_rad": cfg.max_steering_rad},
    }
    rng = np.random.default_rng(0)
    policy = DrivingPolicy(build_policy(config, rng.normal(size=(grid.n, descriptor_dim))), config, device=device)
    indices = policy.selector.select(0)
    descriptors = rng.normal(size=(len(indices), descriptor_dim)).astype(np.float32)
    times = []
    for run in range(warmup + repeats):
        start = time.perf_counter()
        policy.predict(descriptors, indices)
        if run >= warmup:
            times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--descriptor-dim", type=int, default=384, help="D (DINOv2 ViT-S: 384, BLIP-2 head: 64)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--cols", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig.from_yaml(TRAIN_CONFIG, cache="-", out="-")
    grid = PatchGrid(args.rows, args.cols)
    runs = [(variant, rate) for variant in ("sps", "spps") for rate in (1.0, 0.5, 0.3)]
    results = {run: time_policy(*run, grid, args.descriptor_dim, cfg, args.repeats, device=args.device)
               for run in tqdm(runs, desc="policy timing")}
    print(f"policy width {cfg.width}, depth {cfg.depth}, grid {grid.rows}x{grid.cols}, D={args.descriptor_dim}, "
          f"{args.device}, {torch.get_num_threads()} thread(s); median ms per frame:")
    for (variant, rate), ms in results.items():
        print(f"  {variant:5s} rate {rate:.1f}: {ms:7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
