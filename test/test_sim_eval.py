"""`sps-driving eval`: resumable closed-loop episodes and the Table 1 layout."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from samples import tiny_dinov2_policy

from sps_driving.cli import main
from sps_driving.sim.scenarios import SCENARIO_NAMES
from sps_driving.sim.tables import method_name, method_reports, rate_curves, seed_scores, summarize, table_rows, training_seed, write_tables


def read_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def test_expert_eval_is_resumable_and_writes_tables(tmp_path):
    out = tmp_path / "eval"
    args = ["eval", "--expert", "--episodes", "2", "--episode-s", "4", "--workers", "1", "--out", str(out),
            "--scenarios", SCENARIO_NAMES[0], SCENARIO_NAMES[5]]
    assert main(args) == 0
    rows = read_rows(out)
    assert len(rows) == 4 and all(r["method"] == "expert" and r["score"] == 1.0 for r in rows)
    assert sorted((r["scenario"], r["seed"]) for r in rows) == sorted((s, e) for s in args[-2:] for e in (0, 1))
    assert all(r["first_seed"] == 0 and r["training_seed"] is None for r in rows)
    assert main(args) == 0  # nothing left to run
    assert len(read_rows(out)) == 4
    # Another episode length runs anew; its table holds only its own episodes.
    assert main(args[:5] + ["3"] + args[6:]) == 0
    assert len(read_rows(out)) == 8
    assert "3 s, 448x280" in (out / "table1.md").read_text() and "4 s" not in (out / "table1.md").read_text()
    with (out / "table1.csv").open() as f:
        table = list(csv.reader(f))
    assert table[0] == ["scenario", "expert"]
    assert [r[0] for r in table[1:3]] == [SCENARIO_NAMES[0], SCENARIO_NAMES[5]] and table[3][0] == "average"
    assert "Rural Summer Dry Day Car" in (out / "table1.md").read_text()
    assert "Interventions" in (out / "details.md").read_text()


def test_first_seed_chooses_the_layouts_and_resume_skips_the_done_ones(tmp_path):
    from sps_driving.sim.config import load_sim_config
    from sps_driving.sim.episodes import run_episode

    out, scenario = tmp_path / "eval", SCENARIO_NAMES[3]
    base = ["eval", "--expert", "--episode-s", "2", "--workers", "1", "--out", str(out), "--scenarios", scenario]
    assert main(base + ["--first-seed", "100", "--episodes", "2"]) == 0
    assert sorted(r["seed"] for r in read_rows(out)) == [100, 101]
    assert main(base + ["--first-seed", "100", "--episodes", "3"]) == 0  # only layout 102 is new
    assert sorted(r["seed"] for r in read_rows(out)) == [100, 101, 102]
    assert main(base + ["--first-seed", "101", "--episodes", "2"]) == 0  # 101 and 102 are done, whichever run drove them
    assert main(base + ["--episodes", "2"]) == 0  # development layouts 0 and 1
    rows = read_rows(out)
    assert sorted(r["seed"] for r in rows) == [0, 1, 100, 101, 102]
    assert {r["seed"]: r["first_seed"] for r in rows} == {0: 0, 1: 0, 100: 100, 101: 100, 102: 100}
    # The tables hold the run's own layouts only.
    assert "Layouts (episode seeds, shared by all scenarios and methods): 0..1" in (out / "table1.md").read_text()
    # A row is its layout's episode: the layout comes from the seed, not from the run that drove it.
    config = load_sim_config(profile="quick")
    config["episode_s"] = 2.0
    by_seed = {r["seed"]: r for r in rows}
    for seed in (0, 101):
        alone = run_episode(config, scenario, seed)
        assert {k: by_seed[seed][k] for k in alone} == alone
    assert by_seed[0]["distance_m"] != by_seed[100]["distance_m"] != by_seed[101]["distance_m"]
    with pytest.raises(SystemExit, match="training collections"):
        main(base + ["--first-seed", "999999", "--episodes", "2"])


def test_resume_never_takes_another_checkpoints_rows_for_its_own(tmp_path):
    from sps_driving.core.resources import SOURCE_ROOT
    from sps_driving.sim.results import EvalSettings, missing_tasks

    path = tmp_path / "results.jsonl"
    done = {"method": "SPS-50", "training_seed": 0, "policy": "runs/round1/sps50", "scenario": SCENARIO_NAMES[0], "seed": 100,
            "episode_s": 20.0, "width": 224, "height": 140}
    path.write_text(json.dumps(done) + "\n")
    settings = EvalSettings("SPS-50", str(SOURCE_ROOT / "runs/round1/sps50"), "quick", 2, 20.0, 224, 140, 100, 0)
    assert missing_tasks(settings, [SCENARIO_NAMES[0]], path) == [(SCENARIO_NAMES[0], 101)]
    another_seed = EvalSettings("SPS-50", str(SOURCE_ROOT / "runs/round1/sps50_seed1"), "quick", 2, 20.0, 224, 140, 100, 1)
    assert len(missing_tasks(another_seed, [SCENARIO_NAMES[0]], path)) == 2
    retrained = EvalSettings("SPS-50", str(SOURCE_ROOT / "runs/round2/sps50"), "quick", 2, 20.0, 224, 140, 100, 0)
    with pytest.raises(ValueError, match="runs/round1/sps50, not runs/round2/sps50"):
        missing_tasks(retrained, [SCENARIO_NAMES[0]], path)


def test_parallel_expert_eval_matches_the_serial_one(tmp_path):
    args = ["eval", "--expert", "--episodes", "2", "--episode-s", "3", "--scenarios", SCENARIO_NAMES[3], SCENARIO_NAMES[9]]
    assert main(args + ["--workers", "1", "--out", str(tmp_path / "serial")]) == 0
    assert main(args + ["--workers", "2", "--out", str(tmp_path / "parallel")]) == 0

    def by_key(folder):
        return {(r["scenario"], r["seed"]): (r["distance_m"], r["score"]) for r in read_rows(tmp_path / folder)}

    assert by_key("serial") == by_key("parallel") and len(by_key("serial")) == 4


def test_an_episode_does_not_depend_on_what_its_process_drove_before(tmp_path):
    """Panda3D's transform cache handed out transforms composed in earlier episodes, and a frame
    came out a grey level apart in a few pixels: here, after another policy's episode in the same
    snow, the next episode drove 12.48117 m instead of 12.48188 m. It must drive as in a fresh process."""
    from sps_driving.sim.config import load_sim_config
    from sps_driving.sim.episodes import PolicyDriver, run_episode
    from sps_driving.sim.render import get_renderer

    policy = tiny_dinov2_policy(tmp_path / "policy")
    other = tiny_dinov2_policy(tmp_path / "other", state_inputs=("speed_mps", "target_speed_mps"))
    config = load_sim_config(None, profile="quick")
    config["episode_s"] = 1.5
    renderer = get_renderer(config)
    run_episode(config, "rural-winter-snow-day-animal", 0, PolicyDriver(str(other)), renderer)
    after = run_episode(config, "rural-winter-snow-day-animal", 7, PolicyDriver(str(policy)), renderer)
    # --workers 2: the episode runs in a spawned process that has drawn nothing before
    assert main(["eval", "--policy", str(policy), "--first-seed", "7", "--episodes", "1", "--episode-s", "1.5", "--workers", "2",
                 "--no-failure-strips", "--scenarios", "rural-winter-snow-day-animal", "--out", str(tmp_path / "fresh")]) == 0
    (fresh,) = read_rows(tmp_path / "fresh")
    assert after["distance_m"] == fresh["distance_m"] and after["min_gap_m"] == fresh["min_gap_m"]


def test_policy_eval_gives_the_same_episodes_twice_and_on_two_workers(tmp_path):
    """A tiny random policy (renderer -> DINOv2 -> SPS selection -> policy -> vehicle) in rain and
    snow: the same command twice, and on two workers instead of one (other episodes before each
    one in its process, another order), gives the same rows, field for field. Before the renderer
    drew opaque geometry in a fixed order, these rows differed in the third decimal of the distance."""
    tiny_dinov2_policy(tmp_path / "policy")
    args = ["eval", "--policy", str(tmp_path / "policy"), "--first-seed", "7", "--episodes", "2", "--episode-s", "1.5",
            "--scenarios", "urban-summer-rain-day-animal", "rural-winter-snow-day-animal"]
    runs = {}
    for name, workers in (("first", 1), ("again", 1), ("two_workers", 2)):
        assert main(args + ["--workers", str(workers), "--out", str(tmp_path / name)]) == 0
        runs[name] = {(r["scenario"], r["seed"]): r for r in read_rows(tmp_path / name)}
    assert len(runs["first"]) == 4 and {seed for _, seed in runs["first"]} == {7, 8}
    assert runs["first"] == runs["again"] == runs["two_workers"]
    rows = list(runs["first"].values())
    assert all(r["min_gap_m"] is not None and r["training_seed"] == 0 for r in rows)
    assert len({(r["distance_m"], r["min_gap_m"]) for r in rows}) == 4, "every episode drove its own way"


def test_unknown_scenario_or_missing_policy_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="unknown weather 'fog'"):
        main(["eval", "--expert", "--out", str(tmp_path), "--scenarios", "rural-summer-fog-day-car"])
    with pytest.raises(SystemExit, match="no policy config"):
        main(["eval", "--policy", str(tmp_path / "missing"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="scene-season-weather-time-actor"):
        main(["collect", "--out", str(tmp_path / "c"), "--scenario", "rural"])


def _row(method, scenario, score, seed=0, training_seed=0, obstacles=()):
    return {"method": method, "scenario": scenario, "score": score, "interventions": int(score < 1), "seed": seed,
            "training_seed": training_seed, "failures": {"lane_boundary": int(score < 1)}, "mean_speed_mps": 9.0,
            "episode_s": 15.0, "width": 224, "height": 140, "profile": "quick", "obstacles": list(obstacles)}


def _obstacle(passed, margin_m):
    return {"actor": 0, "model": "sedan", "passed": passed, "min_gap_m": 1.0 + margin_m, "margin_m": margin_m}


def test_table1_layout_average_over_ood_and_gain_over_da():
    rows = []
    for i, scenario in enumerate(SCENARIO_NAMES):
        rows += [_row("DA", scenario, 1.0 if i == 0 else 0.8), _row("SPS-50", scenario, 1.0 if i == 0 else 0.9)]
        rows += [_row("SPS-50", scenario, 0.7, seed=1), _row("DA", scenario, 0.8, seed=1)] if i == 1 else []
    header, table = table_rows(summarize(rows), method_reports(rows))
    by_name = {r[0]: r[1:] for r in table}
    assert header == ["scenario", "DA", "SPS-50"]
    assert [r[0] for r in table][:16] == list(SCENARIO_NAMES) + ["average"]
    assert table[0][1:] == ["1.00", "1.00"] and table[1][1:] == ["0.80", "0.80"]
    sps_average = (0.8 + 0.9 * 13) / 14  # the scenario with two layouts counts once
    assert by_name["average"] == ["0.800", f"{sps_average:.3f}"]
    assert by_name["gain_over_DA_points"] == ["+0.0", f"{100 * (sps_average - 0.8):+.1f}"]
    assert by_name["layouts"] == ["1", "1"] and by_name["training_seeds"] == ["1", "1"]


def test_tables_split_methods_and_variants_and_plot_accuracy_against_rate(tmp_path):
    scores = {"No-FM": 0.3, "DA": 0.6, "SPS-50": 0.7, "SPS-30": 0.65, "SPPS-30": 0.5, "PP-50-T4": 0.75, "PP-30-T4": 0.55,
              "PP-50-T4-shared": 0.45, "SPS-50-PT": 0.8, "expert": 1.0}
    rows = [_row(m, s, score) for m, score in scores.items() for s in SCENARIO_NAMES]
    write_tables(rows, tmp_path, "sps-driving eval ...")
    with (tmp_path / "table1.csv").open() as f:
        table1 = list(csv.reader(f))
    with (tmp_path / "table2.csv").open() as f:
        table2 = list(csv.reader(f))
    assert table1[0] == ["scenario", "No-FM", "DA", "SPS-50", "PP-30-T4", "PP-50-T4", "PP-50-T4-shared", "expert"]
    assert table2[0] == ["scenario", "DA", "SPS-50", "SPS-50-PT", "SPS-30", "SPPS-30"], "a suffixed variant beside its column"
    assert [r[0] for r in table2[1:17]] == list(SCENARIO_NAMES) + ["average"]
    assert {r[0]: r[1:] for r in table2}["gain_over_DA_points"] == ["+0.0", "+10.0", "+20.0", "+5.0", "-10.0"]
    assert "Not yet run: I-ViT" in (tmp_path / "table1.md").read_text()
    assert "Not yet run: SPS-70, SPPS-70, SPPS-50, MSPPS-70, MSPPS-50, MSPPS-30" in (tmp_path / "table2.md").read_text()
    curves = rate_curves(summarize(rows))
    assert curves["SPS"] == [pytest.approx((0.3, 0.65, 0.65)), pytest.approx((0.5, 0.7, 0.7)), pytest.approx((1.0, 0.6, 0.6))]
    assert curves["PP-T4"] == [pytest.approx((0.3, 0.55, 0.55)), pytest.approx((0.5, 0.75, 0.75))], "no DA end"
    assert curves["PP-T4-shared"] == [pytest.approx((0.5, 0.45, 0.45))]
    assert curves["SPS-PT"] == [pytest.approx((0.5, 0.8, 0.8))], "a suffixed variant on its own, no DA end"
    assert set(curves) == {"SPS", "SPPS", "PP-T4", "PP-T4-shared", "SPS-PT"}
    assert (tmp_path / "accuracy_vs_rate.png").stat().st_size > 1000
    details = (tmp_path / "details.md").read_text()
    assert "| SPS-50 | +10.0 | [+10.0, +10.0] | [+10.0, +10.0] | 14 | 1 | 1 / 1 | 14 | 0 |" in details
    assert "| No-FM | -30.0 | [-30.0, -30.0] | [-30.0, -30.0] | 14 | 1 | 1 / 1 | 0 | 14 |" in details


def test_tables_pool_training_seeds_into_one_method_and_mark_thin_columns(tmp_path):
    """SPS-50 and DA: 3 checkpoints each on 20 layouts; SPS-30: 1 checkpoint on 10 layouts (marked).
    The gain over DA is the paired interval over scenarios, layouts and seeds; obstacle passes and
    margins sit beside the scores."""
    rng = np.random.default_rng(0)
    difficulty = rng.uniform(0.2, 0.8, (len(SCENARIO_NAMES), 20))  # shared by every method: pairing cancels it
    rows = []
    for i, scenario in enumerate(SCENARIO_NAMES):
        for layout in range(100, 120):
            base = difficulty[i, layout - 100]
            for seed in range(3):
                rows.append(_row("DA", scenario, base, layout, seed, [_obstacle(True, 0.3), _obstacle(False, -0.2)]))
                rows.append(_row("SPS-50", scenario, min(1.0, base + 0.05 + 0.01 * seed), layout, seed + 10,
                                 [_obstacle(True, 0.4)] * 3 + [_obstacle(False, -0.1)]))
            if layout < 110:
                rows.append(_row("SPS-30", scenario, base, layout, 0))
    reports = method_reports(rows)
    assert (reports["SPS-50"].layouts, reports["SPS-50"].seeds) == (20, 3) and not reports["SPS-50"].indicative
    assert (reports["SPS-30"].layouts, reports["SPS-30"].seeds) == (10, 1) and reports["SPS-30"].indicative
    gain = reports["SPS-50"].gain
    assert (gain.scenarios, gain.layouts, gain.seeds_a, gain.seeds_b) == (14, 20, 3, 3)
    assert 0.05 - 1e-9 <= gain.low < gain.mean < gain.high <= 0.07 + 1e-9  # the shared difficulty cancels out
    assert reports["SPS-50"].obstacles["pass_rate"] == 0.75 and reports["DA"].obstacles["pass_rate"] == 0.5
    write_tables(rows, tmp_path, "sps-driving eval ...")
    table1 = (tmp_path / "table1.md").read_text()
    assert "| Scenario | DA | SPS-50 |" in table1
    assert "Layouts x training seeds | 20 x 3 | 20 x 3 |" in table1
    assert f"Gain over DA, points [paired 95% interval] | +0.0 | {100 * gain.mean:+.1f} [{100 * gain.low:+.1f}, " in table1
    assert "| Obstacles passed (OOD) | 0.500 | 0.750 |" in table1
    assert "| Margin m, median / 5th percentile (OOD) | 0.05 / -0.20 | 0.40 / -0.10 |" in table1
    table2 = (tmp_path / "table2.md").read_text()
    assert "| Scenario | DA | SPS-50 | SPS-30 ‡ |" in table2 and "10 x 1" in table2
    details = (tmp_path / "details.md").read_text()
    assert "| Rural Summer Dry Day Car | " in details and "| 20 x 3 | " in details and "| 180/240 | +0.40 / -0.10 |" in details
    # Each checkpoint of a multi-seed method on its own row; one of a single checkpoint is not repeated there.
    per_seed = seed_scores(rows)
    assert set(per_seed) == {"DA", "SPS-50"} and list(per_seed["SPS-50"]) == [10, 11, 12]
    for seed in range(3):
        expected = np.minimum(1.0, difficulty[1:] + 0.05 + 0.01 * seed).mean()
        in_distribution, ood = per_seed["SPS-50"][seed + 10]
        assert ood.mean == pytest.approx(expected) and ood.cells == 14 * 20 and ood.low < ood.mean < ood.high
        assert in_distribution.mean == pytest.approx(np.minimum(1.0, difficulty[0] + 0.05 + 0.01 * seed).mean())
        assert f"| SPS-50 | {seed + 10} | {in_distribution.mean:.3f} [" in details
        assert f"| {ood.mean:.3f} [{ood.low:.3f}, {ood.high:.3f}] | 280 |" in details
    assert "| SPS-30 | 0 |" not in details
    # The same rows in another order give the same tables.
    again = tmp_path / "again"
    again.mkdir()
    write_tables(rows[::-1], again, "sps-driving eval ...")
    for name in ("table1.md", "table2.md", "details.md"):
        assert (again / name).read_text() == (tmp_path / name).read_text()


def test_the_tables_command_merges_runs_keeps_the_chosen_layouts_and_renders_again_from_its_own_rows(tmp_path, capsys):
    """Each method and seed in its own eval folder, as long runs are; --first-seed/--episodes keep a
    layout range every column drove; the written results.jsonl renders the same tables again."""
    runs = {}
    for method, score, layouts in (("DA", 0.6, range(100, 120)), ("SPS-50", 0.8, range(100, 110))):
        runs[method] = tmp_path / method
        runs[method].mkdir()
        rows = [_row(method, s, score, layout) for s in SCENARIO_NAMES for layout in layouts]
        (runs[method] / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "table"
    assert main(["tables", str(runs["DA"]), str(runs["SPS-50"] / "results.jsonl"), "--out", str(out),
                 "--first-seed", "100", "--episodes", "10"]) == 0
    merged = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(merged) == 2 * 15 * 10 and {r["seed"] for r in merged} == set(range(100, 110))
    table1 = (out / "table1.md").read_text()
    assert "| Scenario | DA ‡ | SPS-50 ‡ |" in table1 and "Layouts x training seeds | 10 x 1 | 10 x 1 |" in table1
    assert "--first-seed 100 --episodes 10`" in table1 and "| +20.0 [+20.0, +20.0] |" in table1
    again = tmp_path / "again"
    assert main(["tables", str(out), "--out", str(again)]) == 0
    for name in ("table1.csv", "table2.csv", "details.md"):
        assert (again / name).read_text() == (out / name).read_text()
    assert main(["tables", str(out), "--out", str(again), "--first-seed", "200", "--episodes", "5"]) == 2
    assert "no episodes" in capsys.readouterr().err
    assert main(["tables", str(out), "--out", str(again), "--first-seed", "100"]) == 2
    assert main(["tables", str(tmp_path / "nothing"), "--out", str(again)]) == 2
    assert "no results at" in capsys.readouterr().err


def test_method_names_and_training_seeds():
    assert training_seed({"selection": {"variant": "sps", "rate": 0.5, "seed": 2}}) == 2 and training_seed({}) is None
    assert method_name({"selection": {"variant": "sps", "rate": 1.0}}) == "DA"
    assert method_name({"selection": {"variant": "sps", "rate": 0.5}}) == "SPS-50"
    assert method_name({"selection": {"variant": "mspps", "rate": 0.3}}) == "MSPPS-30"
    assert method_name({"backbone": "pixels", "selection": {"variant": "sps", "rate": 1.0}}) == "No-FM"
    assert method_name({"extractor": {"falloff": "none"}, "selection": {"variant": "sps", "rate": 1.0}}) == "I-ViT"
    # token dropping: a column of its own beside the dense policy of the same rate
    assert method_name({"extractor": {"tokens": "kept"}, "selection": {"variant": "sps", "rate": 0.5}}) == "SPS-50-TD"
    assert method_name({"extractor": {"tokens": "all"}, "selection": {"variant": "sps", "rate": 0.5}}) == "SPS-50"


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


def test_int8_is_an_eval_option_that_names_its_method_and_runs_the_int8_graph(tmp_path):
    """`eval --precision int8`: the same policy's episode through onnxruntime's int8 graph, as a
    method of its own (-int8), beside the fp32 one in the same folder."""
    from sps_driving.sim.episodes import PolicyDriver

    tiny_dinov2_policy(tmp_path / "policy")
    out = tmp_path / "eval"
    common = ["eval", "--policy", str(tmp_path / "policy"), "--episodes", "1", "--episode-s", "0.5", "--workers", "1",
              "--out", str(out), "--scenarios", SCENARIO_NAMES[0], "--no-failure-strips"]
    assert main(common) == 0 and main(common + ["--precision", "int8"]) == 0
    assert sorted(row["method"] for row in read_rows(out)) == ["SPS-50", "SPS-50-int8"]
    driver = PolicyDriver(str(tmp_path / "policy"), precision="int8")
    assert driver.extraction.facts["backend"] == "onnxruntime" and driver.extraction.facts["precision"] == "int8"
    with pytest.raises(SystemExit, match="--precision are for the in-process run"):
        main(common + ["--precision", "int8", "--graph"])


def test_a_token_dropping_policy_has_no_dense_grid_for_dagger(tmp_path):
    from sps_driving.sim.episodes import PolicyDriver

    policy = tiny_dinov2_policy(tmp_path / "policy")
    config = json.loads((Path(policy) / "config.json").read_text())
    config["extractor"] = {"backbone": "dinov2_vits14", "input_size": [224, 224], "tokens": "kept"}
    (Path(policy) / "config.json").write_text(json.dumps(config))
    assert PolicyDriver(str(policy)).extractor.drops_tokens
    with pytest.raises(ValueError, match="drops tokens.*extract --keep-rate"):
        PolicyDriver(str(policy), all_patches=True)


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


def test_results_name_policies_without_machine_paths_and_read_older_absolute_ones(tmp_path, monkeypatch):
    from sps_driving.core.resources import SHIPPED_POLICY, SOURCE_ROOT, portable_path, recorded_path, shipped_policy
    from sps_driving.sim.results import read_results

    assert portable_path(shipped_policy()) == SHIPPED_POLICY == "models/spps30pt_dinov2"
    assert portable_path(SOURCE_ROOT / "runs" / "q" / "sps50") == "runs/q/sps50"
    assert portable_path(tmp_path / "runs" / "sps30") == "sps30"
    assert recorded_path(SHIPPED_POLICY) == shipped_policy()
    assert recorded_path("/data/old_machine/runs/q/da") == Path("/data/old_machine/runs/q/da")
    (tmp_path / "runs" / "sps30").mkdir(parents=True)
    with monkeypatch.context() as working:  # a campaign's pinned code runs from the repository root
        working.chdir(tmp_path)
        assert portable_path(tmp_path / "runs" / "sps30") == "runs/sps30"
        assert recorded_path("runs/sps30") == tmp_path / "runs" / "sps30"
        assert recorded_path(SHIPPED_POLICY) == shipped_policy()
    committed = sorted((SOURCE_ROOT / "docs" / "results").rglob("results.jsonl"))
    assert len(committed) > 2
    for path in committed:
        rows = read_results(path)
        assert rows and all(not Path(row["policy"]).is_absolute() for row in rows), path
    checkpoints = [path for folder in ("models", "docs/results") for path in (SOURCE_ROOT / folder).rglob("config.json")]
    assert checkpoints
    for path in checkpoints:
        caches = json.loads(path.read_text()).get("training", {}).get("cache", [])
        assert not any(Path(cache).is_absolute() for cache in ([caches] if isinstance(caches, str) else caches)), path
