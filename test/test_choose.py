"""`sps-driving choose`: the registered selection rule on screen results (tiny random checkpoints,
results rows written as eval writes them)."""

from __future__ import annotations

import json

import pytest
from test_ensemble import head

from sps_driving.cli import main
from sps_driving.core.policies.checkpoint import load_policy
from sps_driving.core.resources import portable_path
from sps_driving.sim.choose import Candidate, choose
from sps_driving.sim.scenarios import ID_SCENARIO, OOD_SCENARIO_NAMES
from sps_driving.sim.statistics import Estimate

LAYOUTS = (100, 101)


def rows(method: str, training_seed: int, policy, id_score: float, ood_score: float) -> list[dict]:
    """A screen's rows: every scenario on LAYOUTS, one score in distribution and one out, the
    policy named as eval names it."""
    return [{"method": method, "training_seed": training_seed, "policy": portable_path(policy), "scenario": scenario, "seed": layout,
             "score": id_score if scenario == ID_SCENARIO.name else ood_score, "episode_s": 20.0, "width": 448,
             "height": 280} for scenario in (ID_SCENARIO.name, *OOD_SCENARIO_NAMES) for layout in LAYOUTS]


def write_screen(folder, screen_rows) -> str:
    folder.mkdir(parents=True)
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in screen_rows))
    return str(folder)


def candidate(name: str, id_score: float, ood: float, policy: str | None = None, members=()) -> Candidate:
    def estimate(mean):
        return Estimate(mean, mean, mean, 1, 1, 1, 1)
    return Candidate(name, 0, policy or name, estimate(id_score), estimate(ood), tuple(members))


def test_the_rule_takes_the_best_eligible_and_breaks_ties_by_ensemble_then_latency():
    single = [candidate("A", 1.0, 0.70, "a"), candidate("B", 0.90, 0.90, "b"), candidate("C", 0.96, 0.60, "c")]
    chosen = choose(single, id_min=0.95, tie_points=1.0, latency_ms={})
    assert chosen.eligible == ["A seed 0", "C seed 0"] and chosen.chosen == "A seed 0"  # B is out: ID 0.90
    assert chosen.policy == "a"
    assert choose([candidate("A", 0.9, 0.7)], 0.95, 1.0, {}).chosen is None
    # within a point: an ensemble beats the checkpoints it is made of ...
    ensemble = candidate("ENS", 1.0, 0.695, "ens", members=("a", "x"))
    assert choose(single + [ensemble], 0.95, 1.0, {}).chosen == "ENS"
    # ... but not another method's checkpoint: the latency decides, and without it nobody is chosen
    other = [candidate("A", 1.0, 0.70, "a"), candidate("D", 1.0, 0.705, "d")]
    unmeasured = choose(other, 0.95, 1.0, {})
    assert unmeasured.chosen is None and sorted(unmeasured.measure) == ["a", "d"]
    assert choose(other, 0.95, 1.0, {"a": 80.0, "d": 95.0}).chosen == "A seed 0"
    assert choose(other, 0.95, 0.4, {}).chosen == "D seed 0"  # 0.5 points apart: no tie at a 0.4-point margin


def test_choose_makes_the_best_methods_ensembles_and_chooses_among_every_candidate(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # as a campaign runs: results and checkpoints named from the repository root
    checkpoints = {(method, seed): head(tmp_path, seed + offset) for method, offset in (("M1", 0), ("M2", 10), ("M3", 20))
                   for seed in (0, 1)}
    ood = {"M1": 0.5, "M2": 0.8, "M3": 0.6}
    screens = [write_screen(tmp_path / "screen" / f"{m}_{s}", rows(m, s, path, 1.0, ood[m] + 0.005 * s))
               for (m, s), path in checkpoints.items()]
    ens = [tmp_path / "ens_best", tmp_path / "ens_second"]
    assert main(["choose", "ensembles", *screens, "--methods", "M1", "M2", "M3", "--out", *map(str, ens),
                 "--json", str(tmp_path / "ensembles.json")]) == 0
    made = json.loads((tmp_path / "ensembles.json").read_text())
    assert [r["method"] for r in made["ranking"]] == ["M2", "M3", "M1"]
    members = load_policy(ens[0]).config["members"]
    assert [m["checkpoint"] for m in members] == [checkpoints["M2", 0].name, checkpoints["M2", 1].name]  # relative to tmp_path
    assert [e["method"] for e in made["ensembles"]] == ["M2", "M3"]
    command = ["choose", "ensembles", *screens, "--methods", "M1", "M2", "M3"]
    assert main([*command, "--out", *map(str, ens)]) == 0  # a rerun keeps what it made
    assert main([*command, "--out", str(ens[1]), str(tmp_path / "other")]) == 2  # M2's ensemble is not M3's
    assert "exists" in capsys.readouterr().err

    # the ensemble of M2 drives within a point of its best seed: it is chosen over its own checkpoints
    screens.append(write_screen(tmp_path / "screen" / "ens_best", rows("ENS-best", 0, ens[0], 1.0, 0.803)))
    screens.append(write_screen(tmp_path / "screen" / "ens_second", rows("ENS-second", 0, ens[1], 0.9, 0.99)))
    rule = ["choose", "policy", *screens, "--id-min", "0.95", "--tie-points", "1.0", "--out", "chosen"]
    assert main([*rule, "--json", str(tmp_path / "choice.json")]) == 0
    choice = json.loads((tmp_path / "choice.json").read_text())["choice"]
    assert choice["chosen"] == "ENS-best" and choice["tied"] == ["M2 seed 1", "ENS-best", "M2 seed 0"]
    assert "ENS-second" not in choice["eligible"]  # the best OOD average, but 0.90 in distribution
    assert "Chosen: **ENS-best**" in capsys.readouterr().out
    assert load_policy(tmp_path / "chosen").config == load_policy(ens[0]).config  # for the confirmation run
    assert main(rule) == 0  # a rerun keeps the copy
    # a tie between methods waits for their latency: exit 3, nothing copied
    assert main([*rule[:-1], "undecided", "--tie-points", "30"]) == 3
    assert not (tmp_path / "undecided").exists() and "chosen none yet" in capsys.readouterr().err


def test_a_candidate_that_missed_a_scenario_or_a_missing_policy_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    policy = head(tmp_path, 0)
    partial = [r for r in rows("M1", 0, policy, 1.0, 0.5) if r["scenario"] != OOD_SCENARIO_NAMES[3]]
    assert main(["choose", "policy", write_screen(tmp_path / "a", partial), "--id-min", "0.95", "--tie-points", "1"]) == 2
    assert f"did not drive {OOD_SCENARIO_NAMES[3]}" in capsys.readouterr().err
    gone = rows("M1", 0, tmp_path / "gone", 1.0, 0.5)
    assert main(["choose", "policy", write_screen(tmp_path / "b", gone), "--id-min", "0.95", "--tie-points", "1"]) == 2
    assert "no policy config" in capsys.readouterr().err
    one_seed = write_screen(tmp_path / "c", rows("M1", 0, policy, 1.0, 0.5))
    assert main(["choose", "ensembles", one_seed, "--methods", "M1", "--out", str(tmp_path / "e")]) == 2
    assert "an ensemble needs at least two" in capsys.readouterr().err


@pytest.mark.parametrize("pair", ["a", "a=fast", "=3"])
def test_latencies_are_policy_equals_milliseconds(tmp_path, capsys, monkeypatch, pair):
    monkeypatch.chdir(tmp_path)
    screen = write_screen(tmp_path / "s", rows("M1", 0, head(tmp_path, 0), 1.0, 0.5))
    assert main(["choose", "policy", screen, "--id-min", "0.95", "--tie-points", "1", "--latency-ms", pair]) == 2
    assert "POLICY=MILLISECONDS" in capsys.readouterr().err


def test_the_shipping_test_holds_all_four_conditions_or_says_which_fails(tmp_path, capsys):
    def confirmation(method, id_score, ood_scores, passed):
        """Rows on layouts 120-123: OOD scores per layout, and one obstacle per OOD cell, passed or not."""
        rows = []
        for scenario in (ID_SCENARIO.name, *OOD_SCENARIO_NAMES):
            for layout, ood in zip(range(120, 124), ood_scores):
                rows.append({"method": method, "training_seed": 0, "policy": method, "scenario": scenario, "seed": layout,
                             "score": id_score if scenario == ID_SCENARIO.name else ood, "episode_s": 20.0, "width": 448,
                             "height": 280, "obstacles": [] if scenario == ID_SCENARIO.name else
                             [{"passed": bool(passed), "margin_m": 1.0 if passed else -0.5}]})
        return write_screen(tmp_path / method, rows)

    folders = [confirmation("chosen", 1.0, (0.8, 0.7, 0.9, 0.75), True), confirmation("SPS-50", 1.0, (0.4, 0.3, 0.5, 0.35), True),
               confirmation("worse-id", 0.9, (0.8, 0.7, 0.9, 0.75), True), confirmation("hits", 1.0, (0.8, 0.7, 0.9, 0.75), False)]
    ship = ["choose", "ship", *folders, "--shipped", "SPS-50", "--id-min", "0.95", "--json", str(tmp_path / "ship.json")]
    assert main([*ship, "--chosen", "chosen", "--latency-ms", "95", "90"]) == 0
    assert json.loads((tmp_path / "ship.json").read_text())["verdict"] == "ships"
    assert "chosen ships" in capsys.readouterr().out
    assert main([*ship, "--chosen", "chosen"]) == 3  # the latency is not measured yet
    assert json.loads((tmp_path / "ship.json").read_text())["verdict"] == "undecided"
    for chosen, latency, fails in (("chosen", ("100", "90"), "latency"), ("worse-id", ("90", "90"), "in distribution"),
                                   ("hits", ("90", "90"), "obstacles")):
        assert main([*ship, "--chosen", chosen, "--latency-ms", *latency]) == 0
        record = json.loads((tmp_path / "ship.json").read_text())
        assert record["verdict"] == "does not ship"
        assert [c["asks"] for c in record["conditions"] if c["holds"] is False] == [
            next(c["asks"] for c in record["conditions"] if fails in c["asks"])]
    # the OOD difference's lower bound: the shipped policy against itself does not ship
    assert main([*ship, "--chosen", "SPS-50", "--latency-ms", "90", "90"]) == 0
    assert json.loads((tmp_path / "ship.json").read_text())["conditions"][0]["holds"] is False
