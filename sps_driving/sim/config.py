"""config/sim.yaml: the world's tunable numbers (units are written there)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import yaml

from sps_driving.core.resources import config_path

PROFILES = ("quick", "paper")


def load_sim_config(path: str | Path | None = None, profile: str | None = None) -> dict:
    """The world config as a nested dict; `profile` applies an evaluation profile's overrides
    (episode length and rendered size)."""
    path = Path(path) if path is not None else config_path("sim.yaml")
    if not path.is_file():
        raise FileNotFoundError(f"simulator config not found at {path}; pass --sim-config or restore config/sim.yaml")
    config = yaml.safe_load(path.read_text()) or {}
    for section in ("camera", "vehicle", "road", "traffic", "failures", "expert", "disturbance", "render"):
        if section not in config:
            raise ValueError(f"{path}: missing section {section!r}")
    return apply_profile(config, profile) if profile else config


def command_sim_config(path: str | Path | None, episode_s: float | None, width: int | None) -> dict:
    """The world config a command runs: its --sim-config, with its --episode-s (s) and --width (px)
    where given."""
    config = load_sim_config(path)
    if episode_s is not None:
        config["episode_s"] = float(episode_s)
    if width is not None:
        set_render_width(config, width)
    return config


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


def set_render_width(config: dict, width: int) -> None:
    """Render at `width` px, the height following the car camera's aspect (square pixels)."""
    if width < 16:
        raise ValueError(f"render width must be at least 16 px, got {width}")
    cam = config["camera"]
    cam["render_width"] = int(width)
    cam["render_height"] = int(round(width * float(cam["native_height"]) / float(cam["native_width"])))


def widen_view(config: dict, scale: float) -> None:
    """Render `scale` times as many columns at the same focal length and height: the camera is a
    pinhole (sps_driving.sim.render), so widening its image plane widens the horizontal field of
    view to 2 atan(scale tan(hfov / 2)) and leaves the nominal frame as the central columns of the
    wide one, pixel for pixel (the vertical field of view is unchanged). Recorded as
    camera.view_width_scale; the evaluation widens the policy's extraction to match
    (sps_driving.core.view.widen_extraction)."""
    cam = config["camera"]
    width = int(cam["render_width"])
    wide = width * float(scale)
    if not (scale >= 1 and math.isclose(wide, round(wide), abs_tol=1e-9) and (round(wide) - width) % 2 == 0):
        raise ValueError(f"view width scale {scale} must be >= 1 and widen the {width} px render by an even number of px "
                         f"(the nominal frame then lies on whole px in the middle)")
    half_width = math.tan(math.radians(float(cam["hfov_deg"])) / 2) * round(wide) / width
    cam["render_width"] = int(round(wide))
    cam["hfov_deg"] = math.degrees(2 * math.atan(half_width))
    cam["view_width_scale"] = float(cam.get("view_width_scale", 1.0)) * round(wide) / width


def frame_stamp_ns(config: dict, episode: int, step: int) -> int:
    """Stamp of a step's frame: episodes start `episode_gap_s` apart from `epoch_ns`, frames follow
    at the control rate. `episode` is the layout seed in evaluation (a layout's patch selections,
    a function of the stamp, are the same whichever run drives it) and the episode's index in a
    collection. Collection and evaluation share it, so patch selection replays."""
    collect = config["collect"]
    period_ns = int(round(1e9 / float(config["control_rate_hz"])))
    return int(collect["epoch_ns"]) + episode * int(float(collect["episode_gap_s"]) * 1e9) + step * period_ns
