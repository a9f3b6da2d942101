"""Failure strips of in-process evaluation: every failure of a policy's episode is drawn as a strip
of what the policy saw in the 2 s before it (OUT/failures/<method>/); an episode without failure
writes none, and --no-failure-strips turns them off."""

import json
import math

import cv2
import numpy as np
import pytest
import torch
import yaml
from samples import tiny_policy

from sps_driving.cli import main
from sps_driving.core.policies.checkpoint import load_policy, save_policy
from sps_driving.sim.config import load_sim_config
from sps_driving.sim.failure_strips import StripSettings, strips_folder

SCENARIO = "rural-summer-dry-day-car"


def constant_steering_policy(directory, steering_logit: float, keep_weights: bool):
    """A tiny grid MLP on the pixels backbone whose steering is about 0.5 tanh(steering_logit) rad
    whatever it sees (random head weights kept, or zeroed for an exact constant), throttle about 0."""
    tiny_policy(directory, 16, 16, 147, backbone="pixels", architecture="mlp")
    policy = load_policy(directory)
    with torch.no_grad():
        if not keep_weights:
            policy.module.head.weight.zero_()
        policy.module.head.bias.copy_(torch.tensor([steering_logit, 0.0]))
    save_policy(policy.module, policy.config, directory)
    return directory


def evaluate(policy, out, episode_s, *extra):
    assert main(["eval", "--policy", str(policy), "--episodes", "1", "--episode-s", str(episode_s), "--workers", "1",
                 "--scenarios", SCENARIO, "--out", str(out), *extra]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    return rows[0]


def strip_tiles(path, config, settings) -> int:
    """The number of frames in a strip PNG (each the rendered frame scaled to the strip's height)."""
    cam = config["camera"]
    tile_width = round(cam["render_width"] * settings.height_px / cam["render_height"])
    height, width = cv2.imread(str(path)).shape[:2]
    assert height == settings.height_px and width % tile_width == 0
    return width // tile_width


def test_a_strip_holds_every_3rd_frame_of_the_last_2_s_before_the_failure(tmp_path):
    config = load_sim_config(profile="quick")
    settings = StripSettings.from_config(config)
    policy = constant_steering_policy(tmp_path / "drift", 0.03, keep_weights=True)  # ~0.015 rad: off the lane in ~2.7 s
    row = evaluate(policy, tmp_path / "eval", 4.0)
    assert row["interventions"] == 1 and row["success_s"] > settings.seconds and row["dropped_frames"] == 0
    strips = sorted(strips_folder(tmp_path / "eval", row["method"]).glob("*.png"))
    assert [p.name for p in strips] == [f"{SCENARIO}_seed0_t{row['success_s']:.1f}.png"]
    history = settings.history_frames(float(config["control_rate_hz"]))
    assert history < round(row["success_s"] * float(config["control_rate_hz"]))  # the buffer was full
    assert strip_tiles(strips[0], config, settings) == math.ceil(history / settings.every_n_frames) == 7
    image = cv2.imread(str(strips[0]))
    last_frame = image[40:, -image.shape[1] // 7:]  # below the caption
    assert len(np.unique(last_frame.reshape(-1, 3), axis=0)) > 50, "a drawn camera frame, not a blank"


def test_strips_are_bounded_per_episode_and_can_be_turned_off(tmp_path):
    config = load_sim_config(profile="quick")
    config["eval"]["failure_strips"]["max_per_episode"] = 2
    (tmp_path / "sim.yaml").write_text(yaml.safe_dump(config))
    policy = constant_steering_policy(tmp_path / "left", 3.0, keep_weights=True)  # 0.5 rad: off the lane within 1 s
    row = evaluate(policy, tmp_path / "eval", 3.0, "--sim-config", str(tmp_path / "sim.yaml"))
    assert row["interventions"] >= 3
    strips = sorted(strips_folder(tmp_path / "eval", row["method"]).glob("*.png"), key=lambda p: p.stat().st_mtime)
    assert len(strips) == 2 and strips[0].name == f"{SCENARIO}_seed0_t{row['success_s']:.1f}.png"
    rate = float(config["control_rate_hz"])
    settings = StripSettings.from_config(config)
    assert strip_tiles(strips[0], config, settings) == math.ceil(round(row["success_s"] * rate) / settings.every_n_frames)

    again = evaluate(policy, tmp_path / "plain", 3.0, "--no-failure-strips")
    assert again["interventions"] == row["interventions"] and again["score"] == row["score"]
    assert not (tmp_path / "plain" / "failures").exists()


def test_an_episode_without_failure_writes_no_strip(tmp_path):
    policy = constant_steering_policy(tmp_path / "straight", 0.0, keep_weights=False)
    row = evaluate(policy, tmp_path / "eval", 1.0)
    assert row["interventions"] == 0 and row["failures"] == {}
    assert not list((tmp_path / "eval").rglob("*.png"))


def test_a_config_without_strip_settings_is_a_clear_error_unless_strips_are_off(tmp_path):
    config = load_sim_config()
    del config["eval"]["failure_strips"]
    (tmp_path / "sim.yaml").write_text(yaml.safe_dump(config))
    policy = constant_steering_policy(tmp_path / "straight", 0.0, keep_weights=False)
    args = ["eval", "--policy", str(policy), "--episodes", "1", "--episode-s", "0.3", "--workers", "1", "--scenarios", SCENARIO,
            "--sim-config", str(tmp_path / "sim.yaml")]
    with pytest.raises(SystemExit, match="no eval.failure_strips"):
        main(args + ["--out", str(tmp_path / "eval")])
    assert main(args + ["--out", str(tmp_path / "plain"), "--no-failure-strips"]) == 0
