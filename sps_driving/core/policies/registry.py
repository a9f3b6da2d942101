"""The policy architectures by name: the one place that maps a config's "architecture" to the
settings it takes and the builder that makes its module.

A policy config (`PolicyArchitecture.config` builds it; sps_driving.core.policies.checkpoint
saves it) records: format, architecture ("transformer" when absent), backbone, grid {rows, cols},
descriptor_dim D, position_dim P (transformer sequence policies), selection {variant, rate, seed,
keep_probability}, state_inputs [names], policy (the architecture's SETTINGS: transformer {width,
depth, heads, mlp_ratio, dropout}; positional_transformer: those and reduce; relative_query:
those and {query_stride, readout}; mlp: {width, reduce, dropout, canvas, state_to_head}; cnn:
{width, dropout}; patch_policy: positional_transformer's and its window's,
core.history.WINDOW_SETTINGS; ensemble: none, its heads' configs under "members",
core.policies.ensemble), output {max_steering_rad}, and whatever the trainer adds (view: the
roi and its centre, training data, provenance, validation_loss).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from torch import nn

from sps_driving.core.grid import PatchGrid
from sps_driving.core.history import PATCH_POLICY
from sps_driving.core.policies import (
    cnn,
    ensemble,
    grid_mlp,
    patch_policy,
    positional_transformer,
    relative_query,
    transformer,
)
from sps_driving.core.policies.blocks import PolicySpec
from sps_driving.core.selection import SelectionConfig
from sps_driving.core.state import check_state_names

# config "architecture" -> (the names of its policy settings (config "policy"; values: config/train.yaml), its builder)
REGISTRY: dict[str, tuple[tuple[str, ...], Callable[[PolicySpec], nn.Module]]] = {
    positional_transformer.NAME: (positional_transformer.SETTINGS, positional_transformer.build),
    "transformer": (transformer.SETTINGS, transformer.build),
    "mlp": (grid_mlp.SETTINGS, grid_mlp.build),
    "cnn": (cnn.SETTINGS, cnn.build),
    PATCH_POLICY: (patch_policy.SETTINGS, patch_policy.build),
    relative_query.NAME: (relative_query.SETTINGS, relative_query.build),
    ensemble.NAME: (ensemble.SETTINGS, lambda spec: ensemble.build(spec.config, build_policy)),
}
ARCHITECTURES = {name: settings for name, (settings, _) in REGISTRY.items()}
# What `train` trains and the timing tools time: an ensemble is made of trained checkpoints (`sps-driving ensemble`).
TRAINABLE_ARCHITECTURES = [name for name in ARCHITECTURES if name != ensemble.NAME]
# Settings added after checkpoints without them were written: the value those checkpoints mean (a
# policy config leaves them out at that value).
SETTING_DEFAULTS = {"mlp": grid_mlp.SETTING_DEFAULTS}
# The architectures that can read the kept tokens as a sequence (spps, mspps), the one to train
# first; the others read the whole grid with zeros at dropped patches, where spps would equal sps.
SEQUENCE_ARCHITECTURES = (positional_transformer.NAME, "transformer", PATCH_POLICY, relative_query.NAME, ensemble.NAME)
# The architecture whose sequence policies read the backbone's position table.
POSITION_TABLE_ARCHITECTURE = "transformer"
# Checkpoints written before config "architecture" existed are all transformers.
UNRECORDED_ARCHITECTURE = "transformer"

def _require(config: dict, key: str):
    if key not in config:
        raise ValueError(f"policy config is missing {key!r}")
    return config[key]


def architecture_of(config: dict) -> str:
    """A policy config's architecture (see UNRECORDED_ARCHITECTURE for checkpoints without one)."""
    return config.get("architecture", UNRECORDED_ARCHITECTURE)


def state_inputs_of(config: dict) -> tuple[str, ...]:
    """A policy config's state inputs (sps_driving.core.state); checkpoints without the key read none."""
    return check_state_names(config.get("state_inputs", ()))


def check_architecture(architecture: str, selection: SelectionConfig) -> None:
    """Raise ValueError unless `architecture` is known and can take `selection`'s variant."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown policy architecture {architecture!r}; expected one of {list(ARCHITECTURES)}")
    if architecture not in SEQUENCE_ARCHITECTURES and selection.sparse_sequence:
        raise ValueError(f"a {architecture} policy reads the whole grid (zeros at dropped patches): use variant sps or "
                         f"threshold, not {selection.variant}, which feeds the kept tokens as a sequence "
                         f"(architecture {SEQUENCE_ARCHITECTURES[0]})")


@dataclass(frozen=True)
class PolicyArchitecture:
    """What a policy is, apart from the grid it reads: architecture, its settings and the output bound.

    The one builder of the policy config that `build_policy` reads (`config`): the trainer makes
    its checkpoints with it, and the timing tools time a checkpoint's architecture (`of`) on any
    backbone's grid with it.
    """

    name: str
    settings: dict  # exactly ARCHITECTURES[name]
    max_steering_rad: float  # rad; steering output bound

    def __post_init__(self) -> None:
        if self.name not in ARCHITECTURES:
            raise ValueError(f"unknown policy architecture {self.name!r}; expected one of {list(ARCHITECTURES)}")
        optional = set(SETTING_DEFAULTS.get(self.name, ()))
        if not set(ARCHITECTURES[self.name]) - optional <= set(self.settings) <= set(ARCHITECTURES[self.name]):
            raise ValueError(f"{self.name} policy settings must be exactly {list(ARCHITECTURES[self.name])} "
                             f"({sorted(optional) or 'none'} optional), got {sorted(self.settings)}")
        if not self.max_steering_rad > 0:
            raise ValueError(f"max_steering_rad must be positive, got {self.max_steering_rad}")

    @classmethod
    def of(cls, config: dict) -> PolicyArchitecture:
        """The architecture of a policy config (a checkpoint's config.json)."""
        output = _require(config, "output")
        if "max_steering_rad" not in output:
            raise ValueError("policy config output needs max_steering_rad")
        return cls(architecture_of(config), dict(_require(config, "policy")), float(output["max_steering_rad"]))

    def config(self, grid: PatchGrid, descriptor_dim: int, selection: SelectionConfig, backbone: str | None = None,
               position_dim: int | None = None, state_inputs: Sequence[str] = ()) -> dict:
        """The policy config of this architecture on a `grid` of `descriptor_dim` descriptors,
        reading `state_inputs` (names of sps_driving.core.state) besides.

        position_dim (P of the backbone's position table) lets a transformer sequence policy be
        built without the table itself (zeros, e.g. for timing); the other architectures ignore it.
        """
        check_architecture(self.name, selection)
        config = {
            "backbone": backbone,
            "grid": {"rows": grid.rows, "cols": grid.cols},
            "descriptor_dim": int(descriptor_dim),
            "selection": selection.to_dict(),
            "state_inputs": list(check_state_names(state_inputs)),
            "architecture": self.name,
            "policy": dict(self.settings),
            "output": {"max_steering_rad": self.max_steering_rad},
        }
        if position_dim is not None and selection.sparse_sequence and self.name == POSITION_TABLE_ARCHITECTURE:
            config["position_dim"] = int(position_dim)
        return config

    def describe(self) -> dict:
        return {"architecture": self.name, "policy": dict(self.settings), "max_steering_rad": self.max_steering_rad}


def build_policy(config: dict, position_table: np.ndarray | None = None) -> nn.Module:
    """A fresh policy module for `config` (see the module docstring for its keys).

    Sequence policies (spps, mspps) of architecture "transformer" need the backbone's position
    table [N, P]; without one they get a zero table of shape [N, config["position_dim"]] that
    loading a checkpoint fills. The other architectures ignore it.
    """
    grid_cfg = _require(config, "grid")
    grid = PatchGrid(int(grid_cfg["rows"]), int(grid_cfg["cols"]))
    descriptor_dim = int(_require(config, "descriptor_dim"))
    selection = SelectionConfig.from_dict(_require(config, "selection"))
    architecture = PolicyArchitecture.of(config)
    check_architecture(architecture.name, selection)
    spec = PolicySpec(config, grid, descriptor_dim, selection, architecture.settings, architecture.max_steering_rad,
                      len(state_inputs_of(config)), position_table)
    _, build = REGISTRY[architecture.name]
    return build(spec)
