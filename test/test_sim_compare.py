"""`sps-driving compare`: any two methods of eval results files, paired cell by cell."""

import json

import numpy as np
import pytest

from sps_driving.cli import main
from sps_driving.sim.compare import compare
from sps_driving.sim.results import merge_results
from sps_driving.sim.scenarios import ID_SCENARIO, OOD_SCENARIO_NAMES


def row(method, scenario, seed, score, training_seed=0, width=448):
    return {"method": method, "training_seed": training_seed, "scenario": scenario, "seed": seed, "score": score,
            "episode_s": 20.0, "width": width, "height": 280}


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_constant_gap_in_every_cell_is_the_difference_with_a_zero_width_interval(tmp_path, capsys):
    rng = np.random.default_rng(0)
    rows = []
    for scenario in (ID_SCENARIO.name, *OOD_SCENARIO_NAMES[:3]):
        for seed, base in zip(range(100, 105), rng.uniform(0.2, 0.8, 5)):
            rows += [row("B", scenario, seed, base), row("A", scenario, seed, base + 0.1)]
    entries = compare(rows, "A", "B", per_scenario=True)
    assert [e["group"] for e in entries] == ["in distribution", "OOD", *OOD_SCENARIO_NAMES[:3]]
    ood = entries[1]["difference"]
    assert (ood.mean, ood.low, ood.high) == pytest.approx((0.1, 0.1, 0.1))
    assert (ood.scenarios, ood.layouts, ood.cells, ood.wins, ood.losses) == (3, 5, 15, 15, 0)
    assert entries[1]["a"].mean == pytest.approx(entries[1]["b"].mean + 0.1)
    # B against A is the mirror image, and the command prints it in points
    assert main(["compare", str(write(tmp_path / "r.jsonl", rows)), "--a", "B", "--b", "A"]) == 0
    assert "-10.0 [-10.0, -10.0]" in capsys.readouterr().out


def test_a_random_gap_gives_an_interval_that_holds_the_mean_and_counts_wins(tmp_path):
    rng = np.random.default_rng(1)
    rows = []
    for scenario in OOD_SCENARIO_NAMES:
        for seed in range(100, 110):
            base = rng.uniform(0, 1)
            rows += [row("B", scenario, seed, base), row("A", scenario, seed, base + rng.normal(0.05, 0.1))]
    (ood,) = [e["difference"] for e in compare(rows, "A", "B") if e["group"] == "OOD"]
    assert ood.low < ood.mean < ood.high
    assert ood.wins + ood.losses == len(OOD_SCENARIO_NAMES) * 10
    assert not any(e["group"] == "in distribution" for e in compare(rows, "A", "B"))


def test_files_and_folders_merge_and_the_later_copy_of_an_episode_wins(tmp_path):
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir(), second.mkdir()
    write(first / "results.jsonl", [row("A", ID_SCENARIO.name, 100, 0.2), row("B", ID_SCENARIO.name, 100, 0.5)])
    write(second / "results.jsonl", [row("A", ID_SCENARIO.name, 100, 0.9)])
    rows = merge_results([str(first), str(second / "results.jsonl")])
    assert sorted((r["method"], r["score"]) for r in rows) == [("A", 0.9), ("B", 0.5)]
    (entry,) = compare(rows, "A", "B")
    assert entry["difference"].mean == pytest.approx(0.4)


def test_runs_of_one_name_under_the_ood_rule_or_a_cruise_scale_stay_apart(tmp_path):
    """`eval --name X` with and without `--ood-rule` or `--cruise-scale`: the same cells, three
    conditions; merged, no run's rows replace another's, and each is named as eval names it itself."""
    def driven(score, rule=False, scale=1.0):
        return {**row("X", ID_SCENARIO.name, 100, score), "ood": {"rule": rule, "cruise_scale": scale, "slow_by": "speed_cap"}}

    runs = [write(tmp_path / f"{name}.jsonl", [r]) for name, r in
            (("off", driven(0.9)), ("on", driven(0.6, rule=True)), ("slow", driven(0.8, scale=0.51)))]
    rows = merge_results([str(path) for path in runs])
    assert sorted((r["method"], r["score"]) for r in rows) == [("X", 0.9), ("X+OOD-cap", 0.6), ("X-slow0.51-cap", 0.8)]
    (entry,) = compare(rows, "X+OOD-cap", "X")
    assert entry["difference"].mean == pytest.approx(-0.3)
    # One condition alone keeps the name it was given.
    assert [r["method"] for r in merge_results([str(runs[1])])] == ["X"]


def test_unknown_methods_missing_files_and_unshared_cells_are_clear_errors(tmp_path, capsys):
    rows = [row("A", ID_SCENARIO.name, 100, 1.0), row("B", ID_SCENARIO.name, 200, 1.0)]
    path = write(tmp_path / "r.jsonl", rows)
    assert main(["compare", str(path), "--a", "A", "--b", "C"]) == 2
    assert "no episodes of 'C'" in capsys.readouterr().err
    assert main(["compare", str(path), "--a", "A", "--b", "B"]) == 2
    assert "share no (scenario, layout) cell" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "missing"), "--a", "A", "--b", "B"]) == 2
    assert "no results at" in capsys.readouterr().err


def test_the_json_record_holds_each_estimate(tmp_path):
    rows = [row(m, ID_SCENARIO.name, s, 0.5 + (m == "A") * 0.01 * s) for m in "AB" for s in range(3)]
    out = tmp_path / "cmp.json"
    assert main(["compare", str(write(tmp_path / "r.jsonl", rows)), "--a", "A", "--b", "B", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["a"] == "A" and record["groups"][0]["difference"]["mean"] == pytest.approx(0.01)


def test_the_seeds_an_effect_needs_follow_from_the_checkpoints_spread(tmp_path, capsys):
    # A's three checkpoints average 0.5, 0.6 and 0.7 out of distribution (SD 0.1); B's 0.4 and 0.4 (SD 0).
    rows = [row("A", scenario, layout, 0.5 + 0.1 * seed, training_seed=seed) for seed in range(3)
            for scenario in (ID_SCENARIO.name, *OOD_SCENARIO_NAMES) for layout in (100, 101)]
    rows += [row("B", scenario, layout, 0.4, training_seed=seed) for seed in range(2)
             for scenario in (ID_SCENARIO.name, *OOD_SCENARIO_NAMES) for layout in (100, 101)]
    out = tmp_path / "cmp.json"
    path = write(tmp_path / "r.jsonl", rows)
    assert main(["compare", str(path), "--a", "A", "--b", "B", "--effect-points", "6.2", "--json", str(out)]) == 0
    seeds = json.loads(out.read_text())["seeds_to_decide"]
    assert seeds["seed_sd"] == pytest.approx({"A": 0.1, "B": 0.0})
    assert seeds["seeds_per_method"] == 10  # ceil(1.96^2 x 0.01 / 0.062^2) = ceil(9.99)
    assert "about 10 training seeds per method" in capsys.readouterr().out
    one_seed = [r for r in rows if r["training_seed"] == 0]
    assert main(["compare", str(write(tmp_path / "one.jsonl", one_seed)), "--a", "A", "--b", "B", "--effect-points", "6.2"]) == 2
    assert "a seed spread needs at least two" in capsys.readouterr().err
