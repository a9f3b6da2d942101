"""config/sim.yaml: the world's tunable numbers (units are written there)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import yaml

PROFILES = ("quick", "paper")


def default_config_path() -> Path:
    """config/sim.yaml of the source tree, else the installed share/sps_driving copy."""
    source = Path(__file__).resolve().parents[2] / "config" / "sim.yaml"
    if source.is_file():
        return source
    return Path(sys.prefix) / "share" / "sps_driving" / "config" / "sim.yaml"


def load_sim_config(path: str | Path | None = None, profile: str | None = None) -> dict:
    """The world config as a nested dict; `profile` applies an evaluation profile's overrides
    (episode length and rendered size)."""
    path = Path(path) if path is not None else default_config_path()
    if not path.is_file():
        raise FileNotFoundError(f"simulator config not found at {path}; pass --sim-config or restore config/sim.yaml")
    config = yaml.safe_load(path.read_text()) or {}
    for section in ("camera", "vehicle", "road", "traffic", "failures", "expert", "disturbance", "render"):
        if section not in config:
            raise ValueError(f"{path}: missing section {section!r}")
    return apply_profile(config, profile) if profile else config


def apply_profile(config: dict, profile: str) -> dict:
    profiles = config.get("profiles", {})
    if profile not in profiles:
        raise ValueError(f"unknown evaluation profile {profile!r}; config has {sorted(profiles)}")
    settings = profiles[profile]
    config = copy.deepcopy(config)
    config["episode_s"] = float(settings["episode_s"])
    config["camera"]["render_width"] = int(settings["render_width"])
    config["camera"]["render_height"] = int(settings["render_height"])
    config["profile"] = {"name": profile, **settings}
    return config
