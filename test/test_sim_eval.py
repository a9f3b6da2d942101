"""`sps-driving eval`: resumable closed-loop episodes and the Table 1 layout."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from samples import tiny_dinov2_policy
from scipy import stats

from sps_driving.cli import main
from sps_driving.sim.scenarios import SCENARIO_NAMES
from sps_driving.sim.statistics import interval95, paired_difference
from sps_driving.sim.tables import method_name, paired_against_da, rate_curves, summarize, table_rows, write_tables


def test_expert_eval_is_resumable_and_writes_tables(tmp_path):
    out = tmp_path / "eval"
    args = ["eval", "--expert", "--episodes", "2", "--episode-s", "4", "--workers", "1", "--out", str(out),
            "--scenarios", SCENARIO_NAMES[0], SCENARIO_NAMES[5]]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["method"] == "expert" and r["score"] == 1.0 for r in rows)
    assert main(args) == 0  # nothing left to run
    assert len((out / "results.jsonl").read_text().splitlines()) == 4
    # Another episode length runs anew; its table holds only its own episodes.
    assert main(args[:5] + ["3"] + args[6:]) == 0
    assert len((out / "results.jsonl").read_text().splitlines()) == 8
    assert "3 s, 448x280" in (out / "table1.md").read_text() and "4 s" not in (out / "table1.md").read_text()
    with (out / "table1.csv").open() as f:
        table = list(csv.reader(f))
    assert table[0] == ["scenario", "expert"]
    assert [r[0] for r in table[1:]] == [SCENARIO_NAMES[0], SCENARIO_NAMES[5], "average"]
    assert "Rural Summer Dry Day Car" in (out / "table1.md").read_text()
    assert "Interventions" in (out / "details.md").read_text()


def test_parallel_expert_eval_matches_the_serial_one(tmp_path):
    args = ["eval", "--expert", "--episodes", "2", "--episode-s", "3", "--scenarios", SCENARIO_NAMES[3], SCENARIO_NAMES[9]]
    assert main(args + ["--workers", "1", "--out", str(tmp_path / "serial")]) == 0
    assert main(args + ["--workers", "2", "--out", str(tmp_path / "parallel")]) == 0

    def by_key(folder):
        rows = [json.loads(line) for line in (tmp_path / folder / "results.jsonl").read_text().splitlines()]
        return {(r["scenario"], r["episode"]): (r["distance_m"], r["score"]) for r in rows}

    assert by_key("serial") == by_key("parallel") and len(by_key("serial")) == 4


def test_unknown_scenario_or_missing_policy_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="unknown weather 'fog'"):
        main(["eval", "--expert", "--out", str(tmp_path), "--scenarios", "rural-summer-fog-day-car"])
    with pytest.raises(SystemExit, match="no policy config"):
        main(["eval", "--policy", str(tmp_path / "missing"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="scene-season-weather-time-actor"):
        main(["collect", "--out", str(tmp_path / "c"), "--scenario", "rural"])


def _row(method, scenario, score, episode=0):
    return {"method": method, "scenario": scenario, "score": score, "interventions": int(score < 1), "episode": episode,
            "failures": {"lane_boundary": int(score < 1)}, "mean_speed_mps": 9.0, "episode_s": 15.0, "width": 224, "height": 140,
            "profile": "quick"}


def test_table1_layout_average_over_ood_and_gain_over_da():
    rows = []
    for i, scenario in enumerate(SCENARIO_NAMES):
        rows += [_row("DA", scenario, 1.0 if i == 0 else 0.8), _row("SPS-50", scenario, 1.0 if i == 0 else 0.9)]
        rows += [_row("SPS-50", scenario, 0.7, episode=1)] if i == 1 else []
    header, table = table_rows(summarize(rows))
    assert header == ["scenario", "DA", "SPS-50"]
    assert [r[0] for r in table] == list(SCENARIO_NAMES) + ["average", "gain_over_DA_points"]
    assert table[0][1:] == ["1.00", "1.00"] and table[1][1:] == ["0.80", "0.80"]
    sps_average = (0.8 + 0.9 * 13) / 14
    assert table[-2][1:] == ["0.800", f"{sps_average:.3f}"]
    assert table[-1][1:] == ["+0.0", f"{100 * (sps_average - 0.8):+.1f}"]


def test_tables_split_methods_and_variants_and_plot_accuracy_against_rate(tmp_path):
    scores = {"No-FM": 0.3, "DA": 0.6, "SPS-50": 0.7, "SPS-30": 0.65, "SPPS-30": 0.5, "expert": 1.0}
    rows = [_row(m, s, score) for m, score in scores.items() for s in SCENARIO_NAMES]
    write_tables(rows, tmp_path, "sps-driving eval ...")
    with (tmp_path / "table1.csv").open() as f:
        table1 = list(csv.reader(f))
    with (tmp_path / "table2.csv").open() as f:
        table2 = list(csv.reader(f))
    assert table1[0] == ["scenario", "No-FM", "DA", "SPS-50", "expert"]
    assert table2[0] == ["scenario", "DA", "SPS-50", "SPS-30", "SPPS-30"]
    assert [r[0] for r in table2[1:]] == list(SCENARIO_NAMES) + ["average", "gain_over_DA_points"]
    assert table2[-1][1:] == ["+0.0", "+10.0", "+5.0", "-10.0"]
    assert "Not yet run: I-ViT" in (tmp_path / "table1.md").read_text()
    assert "Not yet run: SPS-70, SPPS-70, SPPS-50, MSPPS-70, MSPPS-50, MSPPS-30" in (tmp_path / "table2.md").read_text()
    curves = rate_curves(summarize(rows))
    assert curves["SPS"] == [pytest.approx((0.3, 0.65, 0.65)), pytest.approx((0.5, 0.7, 0.7)), pytest.approx((1.0, 0.6, 0.6))]
    assert set(curves) == {"SPS", "SPPS"}
    assert (tmp_path / "accuracy_vs_rate.png").stat().st_size > 1000
    details = (tmp_path / "details.md").read_text()
    assert "| SPS-50 | +10.0 | [+10.0, +10.0] | 14 | 0 | 14 |" in details
    assert "| No-FM | -30.0 | [-30.0, -30.0] | 0 | 14 | 14 |" in details


def test_interval_is_scipys_t_interval():
    scores = [0.18, 1.0, 0.415, 0.52, 0.97, 0.33, 0.61]
    mean, half = interval95(scores)
    low, high = stats.t.interval(0.95, len(scores) - 1, loc=np.mean(scores), scale=stats.sem(scores))
    assert mean == pytest.approx(np.mean(scores)) and (mean - half, mean + half) == pytest.approx((low, high), rel=1e-12)
    # the printed tables' two decimals: t(0.975, 3) = 3.18
    assert interval95([1.0, 0.0, 1.0, 0.0]) == (0.5, pytest.approx(3.182446 * np.std([1, 0, 1, 0], ddof=1) / 2))
    assert interval95([0.4]) == (0.4, 0.0)


def test_paired_difference_against_da_over_the_same_ood_episodes():
    rows = []
    for i, scenario in enumerate(SCENARIO_NAMES):
        for episode in range(3):
            rows.append(_row("DA", scenario, 0.5, episode))
            rows.append(_row("SPS-50", scenario, 0.5 + 0.1 * (episode != 1) + (0.5 if i == 0 else 0.0), episode))
    rows.append(_row("SPS-30", SCENARIO_NAMES[1], 0.9))  # one pair only: left out
    (paired,) = paired_against_da(rows).items()
    method, d = paired
    assert method == "SPS-50" and d.pairs == 14 * 3 and (d.wins, d.losses) == (28, 0)  # the ID row is not counted
    assert d.mean == pytest.approx(0.2 / 3) and d.low <= d.mean <= d.high and 0 < d.low and d.high <= 0.1 + 1e-12
    again = paired_difference([0.2, 0.9, 0.4, 0.7, 0.1], [0.3, 0.5, 0.4, 0.2, 0.3])
    assert again == paired_difference([0.2, 0.9, 0.4, 0.7, 0.1], [0.3, 0.5, 0.4, 0.2, 0.3]), "seeded"
    assert (again.wins, again.losses, again.pairs) == (2, 2, 5)


def test_method_names():
    assert method_name({"selection": {"variant": "sps", "rate": 1.0}}) == "DA"
    assert method_name({"selection": {"variant": "sps", "rate": 0.5}}) == "SPS-50"
    assert method_name({"selection": {"variant": "mspps", "rate": 0.3}}) == "MSPPS-30"
    assert method_name({"backbone": "pixels", "selection": {"variant": "sps", "rate": 1.0}}) == "No-FM"
    assert method_name({"extractor": {"falloff": "none"}, "selection": {"variant": "sps", "rate": 1.0}}) == "I-ViT"


def test_policy_eval_with_the_dinov2_extractor(tmp_path):
    """The whole in-process loop (renderer -> DINOv2 -> SPS selection -> policy -> vehicle) with a
    tiny random grid MLP (the shipped architecture, random weights) over a short episode."""
    tiny_dinov2_policy(tmp_path / "policy")
    out = tmp_path / "eval"
    assert main(["eval", "--policy", str(tmp_path / "policy"), "--episodes", "1", "--episode-s", "0.5", "--workers", "1",
                 "--out", str(out), "--scenarios", SCENARIO_NAMES[2]]) == 0
    (row,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert row["method"] == "SPS-50" and row["dropped_frames"] == 0
    assert row["policy"] == "policy"  # outside the repository: the folder's name, no path of this machine
    assert 0.0 <= row["score"] <= 1.0 and row["distance_m"] > 0


def test_policy_driver_drops_unusable_frames_and_holds_the_last_command(tmp_path):
    from sps_driving.sim.episodes import PolicyDriver

    tiny_dinov2_policy(tmp_path / "policy", variant="spps", rate=0.3)
    driver = PolicyDriver(str(tmp_path / "policy"))
    assert method_name(driver.policy.config) == "SPPS-30"
    frame = np.random.default_rng(0).integers(0, 255, (140, 224, 3), dtype=np.uint8)
    first = driver(frame, 1_000)
    assert all(np.isfinite(first)) and driver.drops == 0
    assert driver(np.zeros((0, 0, 3), np.uint8), 2_000) == first
    assert driver.drops == 1


def test_results_name_policies_without_machine_paths_and_read_older_absolute_ones(tmp_path):
    from sps_driving.resources import SOURCE_ROOT, portable_path, recorded_path, shipped_policy
    from sps_driving.sim.results import read_results

    assert portable_path(shipped_policy()) == "models/sps50_dinov2"
    assert portable_path(SOURCE_ROOT / "runs" / "q" / "sps50") == "runs/q/sps50"
    assert portable_path(tmp_path / "runs" / "sps30") == "sps30"
    assert recorded_path("models/sps50_dinov2") == shipped_policy()
    assert recorded_path("/data/old_machine/runs/q/da") == Path("/data/old_machine/runs/q/da")
    committed = [SOURCE_ROOT / "docs" / "results" / "results.jsonl", SOURCE_ROOT / "docs" / "results" / "graph" / "results.jsonl"]
    for path in committed:
        rows = read_results(path)
        assert rows and all(not Path(row["policy"]).is_absolute() for row in rows), path
