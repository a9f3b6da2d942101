"""Ensembles (architecture "ensemble"): one policy made of several trained checkpoints of one
method, its heads, unchanged. Each frame is extracted and selected once; every head reads the
same kept patches and the same state, and the command is the mean of the heads' steering and the
mean of their throttle (each head's is bounded, so their mean is too), then limited as any
command. Weights are not averaged: networks trained from different initializations do not share
a basin.

The config records every head's own config under "members" (in order; the weights file holds head
i's weights under "heads.i."), and what the heads must share as the ensemble's own keys: grid,
descriptor_dim, selection (with the first head's seed: the heads' are their training seeds),
state_inputs, output, backbone, extractor and view. So every runtime that
loads a checkpoint (eval, replay, the car's policy node) drives the same policy.
"""

from __future__ import annotations

import torch
from torch import nn

from sps_driving.core.policies.blocks import DenseGridInput, SequencePolicy

NAME = "ensemble"
SETTINGS: tuple[str, ...] = ()
# What every head must share, as the ensemble's config records it once.
SHARED = ("grid", "descriptor_dim", "selection", "state_inputs", "output", "backbone", "extractor", "view")


class _Ensemble(nn.Module):
    def __init__(self, heads: list[nn.Module]):
        super().__init__()
        self.heads = nn.ModuleList(heads)
        # [H, B, 2]: each head's commands of the last forward, kept (detached) so that their
        # disagreement can be read without running the heads again.
        self.last_head_commands: torch.Tensor | None = None

    def forward(self, *inputs) -> torch.Tensor:
        """The heads' [B, 2] commands (steering rad, throttle), averaged."""
        commands = torch.stack([head(*inputs) for head in self.heads])
        self.last_head_commands = commands.detach()
        return commands.mean(dim=0)


def head_disagreement(module: nn.Module) -> float | None:
    """The standard deviation over an ensemble's heads of their steering commands (rad) in its last
    single-frame forward; None for a module that is not an ensemble or has not run."""
    commands = module.last_head_commands if isinstance(module, _Ensemble) else None
    if commands is None or commands.shape[1] != 1:
        return None
    return float(commands[:, 0, 0].std(unbiased=False))


class DenseGridEnsemble(DenseGridInput, _Ensemble):
    """Heads that read the whole grid (zeros at dropped patches)."""


class SequenceEnsemble(SequencePolicy, _Ensemble):
    """Heads that read the kept tokens as a sequence (spps, mspps)."""


def ensemble_config(members: list[dict], names: list[str]) -> dict:
    """The config of the ensemble of checkpoints whose configs are `members` (named `names` in
    its record); ValueError naming the key where two disagree, or for fewer than two heads."""
    if len(members) < 2:
        raise ValueError(f"an ensemble needs at least two checkpoints, got {len(members)}")
    if any(member.get("architecture") == NAME for member in members):
        raise ValueError("an ensemble's heads are trained checkpoints, not ensembles")
    for key in SHARED:
        values = [_shared_part(member, key) for member in members]
        if any(value != values[0] for value in values):
            differ = ", ".join(f"{name}: {value!r}" for name, value in zip(names, values))
            raise ValueError(f"the checkpoints of an ensemble must share {key!r}, and they differ ({differ})")
    return {**{key: members[0].get(key) for key in SHARED}, "architecture": NAME, "policy": {},
            "members": [{**member, "checkpoint": name} for member, name in zip(members, names)]}


def _shared_part(member: dict, key: str):
    """What the heads must agree on under `key`: a selection but for its seed, which the trainer
    sets to the training seed (the ensemble draws with its first head's)."""
    value = member.get(key)
    return {k: v for k, v in value.items() if k != "seed"} if key == "selection" and isinstance(value, dict) else value


def build(config: dict, build_head) -> nn.Module:
    """The ensemble module of `config`, each head built by `build_head(member config)`."""
    return of_heads([build_head(member) for member in config["members"]])


def of_heads(heads: list[nn.Module]) -> nn.Module:
    """The ensemble module of these head modules (all grid readers or all sequence readers)."""
    sequence = [isinstance(head, SequencePolicy) for head in heads]
    if any(sequence) != all(sequence):
        raise ValueError("an ensemble's heads must all read the grid or all read the kept tokens as a sequence")
    return (SequenceEnsemble if all(sequence) else DenseGridEnsemble)(heads)
