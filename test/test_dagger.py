"""`sps-driving dagger` on tiny runs: the pixels backbone on a 3x5 grid, 1.5 s episodes at 64 px,
tiny MLPs trained for a few epochs. Rollouts, caches, bags, training and the development
evaluation are the real ones."""

import json
import os

import numpy as np
import pytest
import yaml

from sps_driving.cli import main
from sps_driving.core import topics
from sps_driving.core.resources import config_path, source_revision
from sps_driving.core.state import STATE_NAMES
from sps_driving.ros.bagio import read_messages
from sps_driving.sim import dagger
from sps_driving.train.cache import FeatureCache

EPISODE_S = 1.5
STEPS = 15  # at 10 Hz
OPTIONS = {"episode_s": EPISODE_S, "width": 64, "episodes_per_round": 2, "dev_episodes": 2, "dev_first_seed": 3,
           "workers": 1, "patience": 5, "rounds": 2}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """An initial cache of 3 expert drives (collect | extract) and tiny settings files."""
    root = tmp_path_factory.mktemp("dagger")
    (root / "pixels.yaml").write_text(yaml.safe_dump({"backbone": "pixels", "input_size": [42, 70], "pixel_pool": 7}))
    train = yaml.safe_load(config_path("train.yaml").read_text())
    train["train"].update(epochs=3, width=16, reduce=2, early_stop_patience=2, batch_size=16)
    (root / "train.yaml").write_text(yaml.safe_dump(train))
    assert main(["collect", "--out", str(root / "drives"), "--episodes", "3", "--seed", "0", "--episode-s", str(EPISODE_S),
                 "--width", "64"]) == 0
    bags = sorted(str(p) for p in (root / "drives").iterdir() if p.is_dir())
    assert main(["extract", "--out", str(root / "cache0"), "--extractor-config", str(root / "pixels.yaml"), *bags]) == 0
    return root


def args(setup, out, *flags, **options):
    """The dagger command line of the tiny runs: OPTIONS with `options` over them, then `flags`."""
    values = {"init_cache": setup / "cache0", "train_config": setup / "train.yaml", "backbone_config": setup / "pixels.yaml",
              **OPTIONS, **options}
    return ["dagger", "--out", str(out), *[x for k, v in values.items() for x in (f"--{k.replace('_', '-')}", str(v))], *flags]


@pytest.fixture(scope="module")
def two_rounds(setup):
    out = setup / "run"
    assert main(args(setup, out, "--keep-bags")) == 0
    return out


def bag_messages(bag, topic):
    return [m.msg for m in read_messages(bag, [topic])]


def test_two_rounds_collect_expert_labelled_caches_aggregate_train_and_record_provenance(setup, two_rounds):
    out = two_rounds
    init = FeatureCache(setup / "cache0")
    seeds = []
    for index, beta in ((0, 0.5), (1, 0.25)):
        cache = FeatureCache(out / f"round_{index:02d}" / f"cache_seed_{1000 + index}")
        assert len(cache) == 2 * STEPS and cache.sources == ["episode_00000", "episode_00001"]
        assert cache.meta["extractor"] == init.meta["extractor"] and cache.grid == init.grid
        assert cache.meta["counts"] == {s: {"written": STEPS} for s in cache.sources}
        assert cache.meta["dagger"]["beta"] == beta
        # Every frame's label is the reference command of its bag (the expert's clean command),
        # and the descriptors are every patch's.
        labels = [(m.position[0], m.position[1]) for s in cache.sources
                  for m in bag_messages(out / f"round_{index:02d}" / "bags" / s, topics.REFERENCE_COMMAND)]
        np.testing.assert_array_equal(cache.targets, np.asarray(labels, dtype=np.float32))
        assert cache.descriptors(range(len(cache))).shape == (2 * STEPS, 15, 12)
        rollouts = json.loads((out / f"round_{index:02d}" / "rollouts.json").read_text())
        assert 0.0 < rollouts["expert_share"] < 1.0 and rollouts["frames"] == 2 * STEPS
        seeds += rollouts["seeds"]
        # Round r trains on the initial cache and every round's so far.
        trained = json.loads((out / f"round_{index:02d}" / "policy" / "config.json").read_text())["training"]
        assert [os.path.basename(c) for c in trained["cache"]] == ["cache0"] + [f"cache_seed_{1000 + r}" for r in range(index + 1)]
        assert trained["cache_frames"] == len(init) + 2 * STEPS * (index + 1)
    assert len(set(seeds)) == 4 and min(seeds) >= 1_000_000  # fresh collection layouts, none an evaluation one

    record = json.loads((out / "dagger.json").read_text())
    provenance = json.loads((out / "policy" / "config.json").read_text())["dagger"]
    for p in (record, provenance):
        assert p["beta_schedule"] == {"beta0": 0.5, "decay": 0.5, "mixing": "step", "betas": [0.5, 0.25]}
        assert [r["seeds"] for r in p["rounds"]] == [seeds[:2], seeds[2:]]
        assert p["caches"] == ["cache0", "round_00/cache_seed_1000", "round_01/cache_seed_1001"]
        assert set(p["dev_scores"]) == {"initial", "round 0", "round 1"}
        assert [e["seed"] for e in p["rounds"][0]["dev"]["episodes"]] == [3, 4]
        assert p["commands"][0].startswith("sps-driving dagger --out")
        assert p.get("revision") == (None if source_revision() == "unknown" else source_revision())  # absent outside git
        assert p["stopped"] == "2 round(s) run" and p["initial"]["trained"]
    best = provenance["best"]
    assert best["dev"]["score"] == max(provenance["dev_scores"].values())
    best_weights = (out / best["policy"] / "policy.safetensors").read_bytes()
    assert (out / "policy" / "policy.safetensors").read_bytes() == best_weights


def test_the_round_cache_equals_extract_of_the_rounds_bags(setup, two_rounds, tmp_path):
    round_dir = two_rounds / "round_01"
    bags = sorted(str(p) for p in (round_dir / "bags").iterdir())
    assert main(["extract", "--out", str(tmp_path / "extracted"), "--extractor-config", str(setup / "pixels.yaml"), *bags]) == 0
    direct, extracted = FeatureCache(round_dir / "cache_seed_1001"), FeatureCache(tmp_path / "extracted")
    assert direct.sources == extracted.sources and len(direct) == len(extracted) == 2 * STEPS
    np.testing.assert_allclose(direct.descriptors(range(len(direct))), extracted.descriptors(range(len(extracted))),
                               rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(direct.targets, extracted.targets)
    np.testing.assert_array_equal(direct.stamps, extracted.stamps)
    states = direct.state_values(STATE_NAMES)
    assert np.isfinite(states).all() and (states > 0).all()  # the speed and the cruise target of every frame
    np.testing.assert_allclose(states, extracted.state_values(STATE_NAMES), rtol=1e-6)
    np.testing.assert_array_equal(direct.position_table(), extracted.position_table())
    same = ("backbone", "extractor", "grid", "descriptor_dim", "dtype", "frames", "sources", "counts", "inputs")
    assert {k: direct.meta[k] for k in same} == {k: extracted.meta[k] for k in same}


def test_rollout_labels_are_the_experts_commands_for_the_visited_states(setup, two_rounds, tmp_path):
    from sps_driving.sim.config import load_sim_config, set_render_width
    from sps_driving.sim.episodes import PolicyDriver, driving_state
    from sps_driving.sim.expert import Expert
    from sps_driving.sim.render import get_renderer
    from sps_driving.sim.scenarios import get_scenario
    from sps_driving.sim.world import World, make_episode

    config = load_sim_config()
    config["episode_s"] = EPISODE_S
    set_render_width(config, 64)
    scenario, seed = config["collect"]["scenario"], 1_234_567
    policy_dir = two_rounds / "round_00" / "policy"
    dense = PolicyDriver(str(policy_dir), backbone_config=str(setup / "pixels.yaml"), all_patches=True)
    selected = PolicyDriver(str(policy_dir), backbone_config=str(setup / "pixels.yaml"))
    steps = []

    def record(frame, applied):
        # The policy drives on its selection of the dense descriptors: as if it had computed only those.
        assert frame.descriptors.shape == (15, 12)
        assert selected(frame.image, frame.stamp_ns, driving_state(frame.world)) == pytest.approx(dense.last)
        steps.append((frame.label, applied))

    result = dagger.rollout_episode(config, scenario, seed, 0, dense, 0.5, "step", get_renderer(config), [record])
    assert result["frames"] == len(steps) == STEPS and 0 < result["expert_steps"] < STEPS
    assert sum(label == applied for label, applied in steps) == result["expert_steps"]
    # Replaying the applied commands, a fresh expert gives exactly the recorded labels.
    world, expert = World(config, make_episode(config, get_scenario(scenario), seed)), Expert(config)
    for label, applied in steps:
        assert expert.command(world) == label
        world.step(applied.steering, applied.throttle)

    shares = [dagger.rollout_episode(config, scenario, seed + k, 0, dense, 0.5, "episode", get_renderer(config), [])
              ["expert_steps"] for k in range(6)]
    assert set(shares) == {0, STEPS}  # per episode: the expert drives all of it or none


def test_beta_1_drives_exactly_as_collect_without_disturbance(setup, tmp_path):
    out = tmp_path / "expert_round"
    assert main(args(setup, out, "--keep-bags", rounds=1, beta0=1, seed=7)) == 0
    assert main(["collect", "--out", str(tmp_path / "collected"), "--episodes", "2", "--seed", "7", "--no-disturbance",
                 "--episode-s", str(EPISODE_S), "--width", "64"]) == 0
    assert json.loads((out / "round_00" / "rollouts.json").read_text())["expert_share"] == 1.0
    for episode in ("episode_00000", "episode_00001"):
        for topic in (topics.IMAGE, topics.REFERENCE_COMMAND, topics.VEHICLE_TWIST, topics.LANE_POSE, topics.OBSTACLE_RANGE):
            rolled = bag_messages(out / "round_00" / "bags" / episode, topic)
            collected = bag_messages(tmp_path / "collected" / episode, topic)
            assert len(rolled) == len(collected) == STEPS
            assert [repr(m) for m in rolled] == [repr(m) for m in collected], topic


def test_an_interrupted_run_redoes_only_its_unfinished_round(setup, two_rounds, tmp_path, monkeypatch):
    import sps_driving.train.trainer as trainer

    out = tmp_path / "run"
    calls = {"rollouts": [], "train": 0}
    rollout, train = dagger.rollout_episode, trainer.train

    def counted_rollout(config, scenario, seed, episode_index, *rest):
        calls["rollouts"].append(seed)
        if calls.get("interrupt") == len(calls["rollouts"]):
            raise KeyboardInterrupt  # killed in round 1's second rollout: its cache is left incomplete
        return rollout(config, scenario, seed, episode_index, *rest)

    def counted_train(*a, **k):
        calls["train"] += 1
        return train(*a, **k)

    monkeypatch.setattr(dagger, "rollout_episode", counted_rollout)
    monkeypatch.setattr(trainer, "train", counted_train)
    calls["interrupt"] = 4
    with pytest.raises(KeyboardInterrupt):
        main(args(setup, out))
    assert (out / "round_00" / "round.json").is_file() and not (out / "round_01" / "round.json").exists()
    assert not (out / "round_01" / "cache_seed_1001" / "meta.json").exists()
    assert calls["train"] == 2  # initial, round 0
    finished = {p: p.stat().st_mtime_ns for p in (out / "round_00").rglob("*") if p.is_file()}
    cut_short = calls["rollouts"][3]

    calls.update(interrupt=None, rollouts=[], train=0)
    assert main(args(setup, out)) == 0
    # Round 1's first episode is in its cache already: only the one cut short is rolled out again.
    assert calls["rollouts"] == [cut_short] and calls["train"] == 1
    assert {p: p.stat().st_mtime_ns for p in (out / "round_00").rglob("*") if p.is_file()} == finished
    resumed, whole = (FeatureCache(run / "round_01" / "cache_seed_1001") for run in (out, two_rounds))
    assert resumed.sources == whole.sources and resumed.meta["counts"] == whole.meta["counts"]
    np.testing.assert_array_equal(resumed.stamps, whole.stamps)
    np.testing.assert_array_equal(resumed.targets, whole.targets)
    np.testing.assert_array_equal(resumed.descriptors(range(len(whole))), whole.descriptors(range(len(whole))))
    assert len(json.loads((out / "dagger.json").read_text())["rounds"]) == 2

    calls.update(rollouts=[], train=0)
    assert main(args(setup, out)) == 0  # all done: nothing is redone
    assert calls == {"rollouts": [], "train": 0, "interrupt": None}


def test_a_run_moved_with_what_it_reads_resumes_without_redoing_anything(setup, two_rounds, tmp_path, monkeypatch):
    """A checkout at another path, or another machine: dagger.json names the initial cache
    relative to the run folder, so the moved run is the same run; another cache is still refused."""
    import shutil

    import sps_driving.train.trainer as trainer

    recorded = json.loads((two_rounds / "dagger.json").read_text())["settings"]
    assert recorded["init_cache"] == ["../cache0"] and recorded["backbone_config"] == "../pixels.yaml"
    moved = tmp_path / "elsewhere"
    shutil.copytree(setup, moved, symlinks=True, ignore=shutil.ignore_patterns("drives"))
    calls = []
    monkeypatch.setattr(dagger, "rollout_episode", lambda *a: calls.append("rollout"))
    monkeypatch.setattr(trainer, "train", lambda *a, **k: calls.append("train"))
    assert main(args(moved, moved / "run")) == 0
    assert calls == []
    shutil.copytree(moved / "cache0", moved / "cache1")
    assert main(args(moved, moved / "run", init_cache=moved / "cache1")) == 2


@pytest.mark.parametrize("flags, options, named", [
    ((), {"episodes_per_round": 3}, "--episodes-per-round (was 2, now 3)"),
    ((), {"beta0": 0.7}, "--beta0 (was 0.5, now 0.7)"),
    ((), {"mixing": "episode"}, "--mixing (was 'step', now 'episode')"),
    ((), {"dev_first_seed": 0}, "--dev-first-seed (was 3, now 0)"),
    (("--warm-start",), {}, "--warm-start (was False, now True)"),
    ((), {"width": 80}, "--sim-config, --episode-s or --width"),
])
def test_changed_arguments_are_refused_by_name(setup, two_rounds, capsys, flags, options, named):
    before = (two_rounds / "dagger.json").read_text()
    assert main(args(setup, two_rounds, *flags, **options)) == 2
    assert named in capsys.readouterr().err
    assert (two_rounds / "dagger.json").read_text() == before


def test_changed_training_settings_are_refused_and_seed_collisions_caught(setup, two_rounds, tmp_path, capsys):
    train = yaml.safe_load((setup / "train.yaml").read_text())
    train["train"]["epochs"] = 4
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(train))
    assert main(args(setup, two_rounds, train_config=tmp_path / "train.yaml")) == 2
    assert "training settings epochs" in capsys.readouterr().err
    # The initial cache was collected with seed 0: rounds on seeds 0.. would drive its layouts again.
    assert main(args(setup, tmp_path / "other", seed=0)) == 2
    assert "--seed 0" in capsys.readouterr().err and not (tmp_path / "other").exists()
    # A run continuing from an earlier run's round caches must not name a round cache as one of them.
    command = args(setup, tmp_path / "continued", seed=1001)
    command.insert(command.index("--init-cache") + 2, str(two_rounds / "round_01" / "cache_seed_1001"))
    assert main(command) == 2
    assert "cache_seed_1001" in capsys.readouterr().err and not (tmp_path / "continued" / "round_00").exists()


def test_with_dinov2_a_rollouts_cache_equals_extract_of_its_bag(tmp_path):
    """The real backbone (masked DINOv2 on torch, a 2x3 grid at 28x42 px): descriptors written
    during the rollout match those `extract` computes from the rollout's bag."""
    from samples import tiny_policy

    from sps_driving.ros.bagio import BagWriter
    from sps_driving.sim.collect import BagSink
    from sps_driving.sim.config import load_sim_config, set_render_width
    from sps_driving.sim.episodes import PolicyDriver
    from sps_driving.sim.render import get_renderer
    from sps_driving.train.cache import FeatureCacheWriter

    record = {"backbone": "dinov2_vits14", "input_size": [28, 42], "backend": "torch"}
    (tmp_path / "extraction.yaml").write_text(yaml.safe_dump(record))
    policy_dir = tiny_policy(tmp_path / "policy", rows=2, cols=3, dim=384)
    policy_config = json.loads((policy_dir / "config.json").read_text())
    (policy_dir / "config.json").write_text(json.dumps({**policy_config, "extractor": record}))
    config = load_sim_config()
    config["episode_s"] = 1.0
    set_render_width(config, 64)
    driver = PolicyDriver(str(policy_dir), backbone_config=str(tmp_path / "extraction.yaml"), all_patches=True)
    meta = {"backbone": "dinov2_vits14", "extractor": record, "grid": {"rows": 2, "cols": 3}, "descriptor_dim": 384}
    bag_dir = tmp_path / "bags" / "episode_00000"
    with FeatureCacheWriter(tmp_path / "direct", meta, driver.extractor.position_table()) as writer:
        with BagWriter(bag_dir) as bag:
            sink = dagger.CacheSink(writer, "episode_00000")
            dagger.rollout_episode(config, config["collect"]["scenario"], 2_000_000, 0, driver, 0.5, "step",
                                   get_renderer(config), [sink, BagSink(bag, config)])
    assert sink.counts == {"written": 10}
    assert main(["extract", "--out", str(tmp_path / "extracted"), "--extractor-config", str(tmp_path / "extraction.yaml"),
                 str(bag_dir)]) == 0
    direct, extracted = FeatureCache(tmp_path / "direct"), FeatureCache(tmp_path / "extracted")
    assert len(direct) == len(extracted) == 10
    assert dagger.descriptor_differences(direct.meta["extractor"], extracted.meta["extractor"]) == []
    np.testing.assert_allclose(direct.descriptors(range(10)), extracted.descriptors(range(10)), rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(direct.targets, extracted.targets)
    np.testing.assert_array_equal(direct.stamps, extracted.stamps)
