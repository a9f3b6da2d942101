"""`sps-driving bench --eval`: episodes per hour of eval's worker pool and the split of a frame's
time, configurations side by side, and whether a configuration changes the results; and the
bench_cpu.md tables rendered from it. A tiny random policy on the embedded DINOv2; no speed asserted."""

import json

import pytest
from samples import tiny_dinov2_policy

from sps_driving import cli
from sps_driving.sim.scenarios import SCENARIO_NAMES
from sps_driving.sim.throughput import STAGES, same_results
from sps_driving.tools import bench_report


def test_same_results_compares_each_episode_with_the_references():
    rows = [{"scenario": "a", "episode": 1, "score": 1.0, "failures": {}, "dropped_frames": 0, "min_gap_m": 2.5}]
    assert same_results(rows, rows)
    assert not same_results(rows, [{**rows[0], "min_gap_m": 2.4999}])
    assert not same_results(rows, [{**rows[0], "failures": {"lane": 1}}])


def test_bench_eval_side_by_side(tmp_path, capsys):
    policy = tiny_dinov2_policy(tmp_path / "policy")
    argv = ["bench", "--eval", "--checkpoint", str(policy), "--configs", "int8", "--episodes", "2", "--episode-s", "0.5",
            "--scenarios", SCENARIO_NAMES[0], SCENARIO_NAMES[3], "--json", "--out", str(tmp_path / "eval.json")]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tasks"] == [[SCENARIO_NAMES[0], 0], [SCENARIO_NAMES[3], 1]] and result["episode_s"] == 0.5
    default, int8 = result["configurations"]  # the reference first, whatever was asked for
    assert (default["name"], default["workers"], default["threads_per_worker"], default["precision"]) == ("default", 2, 1, "fp32")
    assert default["speedup"] == 1.0 and default["same_results"]
    assert int8["precision"] == "int8" and int8["speedup"] == pytest.approx(default["wall_s"] / int8["wall_s"])
    for configuration in (default, int8):
        assert configuration["episodes_per_hour"] == pytest.approx(3600 * 2 / configuration["wall_s"])
        split = configuration["ms_per_frame"]
        assert set(split) == set(STAGES) and sum(split.values()) == pytest.approx(configuration["frame_ms"])
        assert split["extraction"] > 0 and split["render"] > 0
    text = bench_report.render(None, None, result)
    assert "| int8 | 2 x 1 |" in text and "episodes per hour" in text
