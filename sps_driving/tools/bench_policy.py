"""`sps-driving bench --policy-forward CKPT [CKPT ...]`: the policy stage alone, as the policy node
calls it (`predict` on one frame's kept descriptors at the checkpoint's own selection, one torch
thread), for each checkpoint as it runs and, where it has transformer layers, as it ran on
PyTorch's stock inference fast path. Calls of every variant are interleaved in rounds so that load
on the machine affects all alike; per-frame ms, median, 99th percentile and best round."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from sps_driving.core.policies.blocks import FusedAttentionEncoderLayer, StridedSelfAttention
from sps_driving.core.resources import portable_path, source_revision

ROUNDS = 10


def stock_attention_copy(module: nn.Module) -> nn.Module | None:
    """A copy of `module` whose encoder layers are PyTorch's stock ones (same weights), so that they
    take its inference fast path; None when the module has no such layer."""
    stock = copy.deepcopy(module)
    layers = [m for m in stock.modules() if isinstance(m, FusedAttentionEncoderLayer)]
    for layer in layers:
        layer.__class__ = nn.TransformerEncoderLayer
        if isinstance(layer.self_attn, StridedSelfAttention):
            layer.self_attn.__class__ = nn.MultiheadAttention
    return stock if layers else None


def add_arguments(parser) -> None:
    parser.add_argument("--policy-forward", nargs="+", type=Path, metavar="CKPT",
                        help="time each checkpoint's policy forward alone, as the policy node calls it (an ensemble too)")
    parser.add_argument("--frames", type=int, default=1000, help="--policy-forward: frames timed per variant")


def run_policy_forward(args) -> int:
    from sps_driving.core.policies.checkpoint import DrivingPolicy, load_policy

    torch.set_num_threads(1)  # as in the policy node, beside the extractor on the other threads
    variants = {}
    for checkpoint in args.policy_forward:
        policy = load_policy(checkpoint)
        indices = policy.selector.select(0)
        frames = np.random.default_rng(0).standard_normal((16, len(indices), policy.descriptor_dim)).astype(np.float32)
        state = {name: 8.0 for name in policy.state_inputs} or None
        name = portable_path(checkpoint)
        variants[name] = (policy, indices, frames, state)
        stock = stock_attention_copy(policy.module)
        if stock is not None:
            variants[f"{name} (stock fast path)"] = (DrivingPolicy(stock, policy.config, checkpoint), indices, frames, state)
    per_round = max(args.frames // ROUNDS, 1)
    calls = {name: [] for name in variants}
    with torch.inference_mode():
        for policy, indices, frames, state in variants.values():  # warm up
            for i in range(20):
                policy.predict(frames[i % 16], indices, state)
        for _ in range(ROUNDS):
            for name, (policy, indices, frames, state) in variants.items():
                for i in range(per_round):
                    started = time.perf_counter()
                    policy.predict(frames[i % 16], indices, state)
                    calls[name].append(1e3 * (time.perf_counter() - started))
    result = {"revision": source_revision(), "torch_threads": 1, "load_average_1min": os.getloadavg()[0],
              "frames_per_variant": per_round * ROUNDS, "policy_forward_ms": {
                  name: {"kept_patches": len(variants[name][1]), "p50": round(float(np.percentile(v, 50)), 3),
                         "p99": round(float(np.percentile(v, 99)), 3),
                         "best_round": round(min(float(np.mean(v[r * per_round:(r + 1) * per_round]))
                                                 for r in range(ROUNDS)), 3)}
                  for name, v in calls.items()}}
    print(json.dumps(result, indent=1))
    return 0
