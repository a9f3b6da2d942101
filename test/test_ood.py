"""The OOD score (sps_driving.core.ood), its calibration files, the rule that acts on it
(sps_driving.core.monitor.OodRule), its episode log and the report's AUROC."""

import json
import math

import numpy as np
import pytest
from ood_samples import DIM, K, calibrated_checkpoint, calibration_of, fitted, training_frames
from samples import tiny_policy

from sps_driving.analysis.ood_report import (
    auroc,
    combine,
    frame_labels,
    frame_scores,
    outcome_known,
    rank_correlation,
    score_variants,
)
from sps_driving.core.monitor import OodRule, OodRuleConfig
from sps_driving.core.ood import (
    META_FILE,
    METHODS,
    PEAK_METHOD,
    PROBE_METHODS,
    TENSORS_FILE,
    CalibrationError,
    PatchCoreset,
    load_calibration,
    load_ood_config,
)
from sps_driving.core.policies.checkpoint import WEIGHTS_FILE, read_policy_config
from sps_driving.sim.ood_log import OodEpisodeLog, ood_settings
from sps_driving.sim.scenarios import ID_SCENARIO, OOD_SCENARIO_NAMES


@pytest.fixture(scope="module")
def scorer_and_frames():
    rng = np.random.default_rng(0)
    frames = training_frames(rng)
    return fitted(rng, frames), frames, rng


@pytest.mark.parametrize("method", METHODS + (PEAK_METHOD,))
def test_training_frames_score_low_and_noise_or_shuffled_frames_high(scorer_and_frames, method):
    scorer, frames, _ = scorer_and_frames
    rng = np.random.default_rng(1)
    # A frame made of training descriptors: patches drawn from several training frames.
    mixed = frames[rng.integers(len(frames), size=K), rng.integers(K, size=K)]
    noise = rng.standard_normal((K, DIM)).astype(np.float32) * frames.std()
    shuffled = np.stack([rng.permutation(p) for p in frames[0]])  # each patch's channels shuffled
    low = scorer.score(mixed, method)
    assert low < 1.5
    assert scorer.score(noise, method) > 3 * low
    assert scorer.score(shuffled, method) > 2 * low


def test_one_novel_patch_raises_the_peak_and_hardly_the_mean(scorer_and_frames):
    """An animal on the road covers a few patches: the peak sees them, the mean over the kept patches
    dilutes them."""
    scorer, frames, _ = scorer_and_frames
    frame = frames[0].copy()
    frame[3] = frames.std() * np.random.default_rng(4).standard_normal(DIM)
    before, after = scorer.scores(frames[0]), scorer.scores(frame)
    assert after[PEAK_METHOD] > 2.5 * before[PEAK_METHOD]
    assert after["patch_coreset"] < 1.3 * before["patch_coreset"]


def test_a_frame_of_the_wrong_width_is_refused(scorer_and_frames):
    scorer, _, _ = scorer_and_frames
    with pytest.raises(ValueError, match="descriptors"):
        scorer.score(np.zeros((K, DIM + 1), np.float32), "patch_coreset")
    with pytest.raises(ValueError, match="k >= 1"):
        scorer.score(np.zeros((0, DIM), np.float32), "pooled_mahalanobis")


def test_the_coreset_covers_its_patches_better_than_random_centres():
    rng = np.random.default_rng(2)
    patches = training_frames(rng, 50).reshape(-1, DIM)
    coreset = PatchCoreset.fit(patches, 16, rng)
    random = PatchCoreset(patches[rng.choice(len(patches), 16, replace=False)])
    assert coreset.distances(patches).max() < random.distances(patches).max()


def test_calibration_round_trips_and_a_missing_or_mismatched_one_is_a_clear_error(tmp_path, scorer_and_frames):
    scorer, frames, _ = scorer_and_frames
    ckpt, config = calibrated_checkpoint(tmp_path / "policy", scorer)
    loaded = load_calibration(ckpt, config, ckpt / WEIGHTS_FILE)
    assert loaded.scores(frames[5]) == pytest.approx(scorer.scores(frames[5]), rel=1e-5)

    other = tiny_policy(tmp_path / "other", dim=DIM, seed=1)
    with pytest.raises(CalibrationError, match="no OOD calibration.*ood calibrate"):
        load_calibration(other, read_policy_config(other), other / WEIGHTS_FILE)
    for name in (META_FILE, TENSORS_FILE):
        (other / name).write_bytes((ckpt / name).read_bytes())
    with pytest.raises(CalibrationError, match="belongs to another policy"):
        load_calibration(other, read_policy_config(other), other / WEIGHTS_FILE)
    wider = dict(config, descriptor_dim=DIM * 2)
    with pytest.raises(CalibrationError, match="other descriptors"):
        load_calibration(ckpt, wider)
    meta = json.loads((ckpt / META_FILE).read_text())
    # Made before the peak existed: it loads without it, and asking for it is a clear error.
    (ckpt / META_FILE).write_text(json.dumps(dict(meta, scales={m: meta["scales"][m] for m in METHODS})))
    assert load_calibration(ckpt, config).methods == METHODS
    with pytest.raises(CalibrationError, match="patch_peak is not in the calibration.*calibrate again"):
        load_calibration(ckpt, config, method=PEAK_METHOD)
    (ckpt / META_FILE).write_text(json.dumps(dict(meta, scales={"patch_coreset": 1.0})))
    with pytest.raises(CalibrationError, match="positive scale"):
        load_calibration(ckpt, config)
    (ckpt / TENSORS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(CalibrationError, match="cannot be read"):
        load_calibration(ckpt, config)


def lane_drives(directory, drives=3, frames=150, seed=0):
    """A feature cache of `drives` drives whose descriptors carry the car's lane pose (the lateral
    offset in the left and right column bands, the heading error in the middle ones, under noise),
    and each drive as a real rosbag2 bag that records that pose on /lane/pose at the frames' stamps."""
    from sps_driving.core import topics
    from sps_driving.ros import msgs
    from sps_driving.ros.bagio import BagWriter
    from sps_driving.train.cache import FeatureCacheWriter

    rng = np.random.default_rng(seed)
    cols = np.arange(64) % 8
    bags = [directory / f"drive_{d}" for d in range(drives)]
    meta = {"backbone": "dinov2_vits14", "grid": {"rows": 8, "cols": 8}, "descriptor_dim": DIM, "inputs": [str(b) for b in bags]}
    with FeatureCacheWriter(directory / "cache", meta, shard_size=64) as cache:
        for d, bag_path in enumerate(bags):
            with BagWriter(bag_path, "sqlite3") as bag:
                for i in range(frames):
                    stamp = 1_700_000_000_000_000_000 + d * 10**12 + i * 100_000_000
                    lateral, heading = rng.uniform(-1.2, 1.2), rng.uniform(-0.1, 0.1)
                    cache.add(pose_frame(rng, cols, lateral, heading), 0.0, 0.0, stamp, bag_path.name)
                    bag.write(topics.LANE_POSE, msgs.lane_pose_fields(lateral, heading, stamp), stamp)
    return directory / "cache", bags


def pose_frame(rng, cols, lateral, heading):
    x = 0.3 * rng.standard_normal((len(cols), DIM)).astype(np.float32)
    x[cols < 2, 0] += 2.0 * lateral
    x[cols >= 6, 1] -= 2.0 * lateral
    x[(cols >= 3) & (cols < 5), 2] += 20.0 * heading
    return x


def test_calibrate_fits_a_lane_pose_probe_on_drives_that_record_the_lane_pose(tmp_path):
    """`ood calibrate`'s fit on a cache whose drives record the lane pose: the probe reads the lateral
    offset back from the policy's kept patches, so a frame near the lane's edge scores high on
    lane_offset and a centred one low, and the calibration saves and loads with it. Without the
    drives it calibrates the novelty scores alone and records why."""
    from sps_driving.analysis.ood import calibrate
    from sps_driving.core.policies.checkpoint import load_policy

    cache, bags = lane_drives(tmp_path)
    ckpt = tiny_policy(tmp_path / "policy", dim=DIM)
    settings = dict(load_ood_config()["calibration"], holdout_sources=1, coreset_size=64, coreset_sample_patches=5000,
                    probe_ridge=1.0)
    scorer = calibrate(ckpt, [str(cache)], settings, "test")
    assert scorer.methods == METHODS + (PEAK_METHOD,) + PROBE_METHODS
    assert scorer.meta["probe"]["holdout_r2"]["lateral_offset_m"] > 0.9
    assert scorer.meta["probe"]["holdout_mean_abs_error"]["lateral_offset_m"] < 0.15

    rng, cols = np.random.default_rng(5), np.arange(64) % 8
    indices = load_policy(ckpt).selector.select(123)
    centred = pose_frame(rng, cols, 0.0, 0.0)[indices]
    edge = pose_frame(rng, cols, 1.6, 0.0)[indices]
    assert scorer.score(centred, "lane_offset", indices) < 0.3 < 1.0 < scorer.score(edge, "lane_offset", indices)
    assert scorer.score(edge, "lane_lookahead", indices) > 3 * scorer.score(centred, "lane_lookahead", indices)
    with pytest.raises(ValueError, match="indices"):
        scorer.score(edge, "lane_offset")

    scorer.save(ckpt)
    config = read_policy_config(ckpt)
    loaded = load_calibration(ckpt, config, ckpt / WEIGHTS_FILE)
    assert loaded.scores(edge, indices) == pytest.approx(scorer.scores(edge, indices), rel=1e-6)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(ckpt / TENSORS_FILE))
    save_file({**tensors, "probe_weights": tensors["probe_weights"][1:]}, str(ckpt / TENSORS_FILE))
    with pytest.raises(CalibrationError, match="probe_weights"):
        load_calibration(ckpt, config)

    bags[0].rename(tmp_path / "moved")
    novelty_only = calibrate(ckpt, [str(cache)], settings, "test")
    assert novelty_only.methods == METHODS + (PEAK_METHOD,) and "probe" not in novelty_only.meta
    assert novelty_only.meta["made"]["lane_pose_probe"].startswith("none: drive drive_0 of cache source drive_0 is not here")
    with pytest.raises(ValueError, match="no \\['lane_offset'\\]"):
        novelty_only.score(edge, "lane_offset", indices)
    novelty_only.save(ckpt)
    with pytest.raises(CalibrationError, match="lane_offset is not in the calibration"):
        load_calibration(ckpt, config, method="lane_offset")
    with pytest.raises(ValueError, match="probe_bands"):
        calibrate(ckpt, [str(cache)], dict(settings, probe_bands=9), "test")


def test_the_shipped_settings_and_rule_load():
    config = load_ood_config()
    assert config["score"]["method"] in METHODS
    rule = OodRuleConfig.from_config(config["rule"])
    assert rule.slow_threshold <= rule.handover_threshold and rule.cruise_scale < 1
    assert rule == OodRuleConfig(), "the rule's defaults in code have drifted from config/ood.yaml"


RULE = OodRuleConfig(slow_threshold=2.0, cruise_scale=0.5, slow_hold_s=1.0, handover_threshold=4.0, handover_after_s=0.5,
                     handover_clear_threshold=2.0, handover_clear_s=1.0, handover_timeout_s=3.0, max_score_age_s=0.5)


def drive(rule, scores, dt=0.1, start=0.0):
    statuses = []
    for i, score in enumerate(scores):
        t = start + i * dt
        rule.on_score(score, t)
        statuses.append(rule.step(t))
    return statuses


def test_the_rule_slows_above_the_first_threshold_and_holds_it():
    rule = OodRule(RULE)
    s = drive(rule, [1.0, 2.5, 1.0] + [1.0] * 12)
    assert [x.cruise_scale for x in s[:3]] == [1.0, 0.5, 0.5]
    assert s[11].slowed and not s[12].slowed  # held for slow_hold_s = 1 s after 0.1 s
    assert not any(x.handover_requested for x in s)


def test_the_rule_requests_a_handover_with_hysteresis_and_stops_when_unanswered():
    rule = OodRule(RULE)
    s = drive(rule, [5.0] * 5)
    assert not any(x.handover_requested for x in s)  # 0.4 s above: not yet
    s = drive(rule, [5.0, 3.0, 3.0], start=0.5)
    assert s[0].new_handover and s[0].handover_requested and rule.handovers == 1
    assert s[2].handover_requested  # 3.0 is inside the band: the request holds
    s = drive(rule, [1.0] * 9, start=0.8)
    assert all(x.handover_requested for x in s)  # below the clear threshold for less than 1 s
    assert drive(rule, [1.0], start=1.8)[0].handover_requested is False
    assert rule.handovers == 1

    rule = OodRule(RULE)
    s = drive(rule, [5.0] * 40)
    requested = [x for x in s if x.handover_requested]
    assert sum(x.new_handover for x in s) == 1
    assert not requested[0].stop_requested and s[-1].stop_requested  # 3 s after the request


def test_a_stale_or_invalid_score_slows_nothing_and_keeps_a_request():
    rule = OodRule(RULE)
    assert rule.step(0.0).stale and rule.step(0.0).cruise_scale == 1.0
    drive(rule, [5.0] * 10)
    assert not rule.on_score(math.nan, 1.0) and not rule.on_score(-1.0, 1.0) and rule.invalid_scores == 2
    later = rule.step(5.0)
    assert later.stale and not later.slowed and later.handover_requested
    rule.clear()
    assert not rule.step(5.1).handover_requested


def test_rule_settings_are_checked():
    with pytest.raises(ValueError, match="hysteresis"):
        OodRuleConfig(handover_threshold=2.0, handover_clear_threshold=3.0)
    with pytest.raises(ValueError, match="cruise_scale"):
        OodRuleConfig(cruise_scale=0.0)
    with pytest.raises(ValueError, match="unknown"):
        OodRuleConfig.from_config({"slow_thresold": 1.0})


def test_the_episode_log_acts_from_the_next_frame_and_records_the_handover():
    settings = ood_settings({k: getattr(RULE, k) for k in RULE.__dataclass_fields__}, "patch_coreset")
    log = OodEpisodeLog(settings)
    for i, score in enumerate([1.0, 2.5, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]):
        assert log.cruise_scale == (1.0 if i < 2 else 0.5)
        log.frame(0.1 * i, {"pooled_mahalanobis": 0.0, "patch_coreset": score}, 0.01 * i, 0.1 * i, -0.01)
    assert log.handed_over and log.handover_s == pytest.approx(0.7)
    log.failure(0.75)
    row = log.as_dict()
    assert row["frames"] == 8 and row["slowed_frames"] == 6 and row["failure_times_s"] == [0.75]
    assert row["steering_rad"] == pytest.approx([0.01 * i for i in range(8)])
    assert row["lane_offset_m"] == pytest.approx([0.1 * i for i in range(8)]) and row["heading_error_rad"] == [-0.01] * 8
    with pytest.raises(ValueError, match="apart"):
        ood_settings(settings["rule"], "patch_coreset", cruise_scale=0.5)


def test_auroc_and_failure_labels():
    assert auroc(np.array([0.1, 0.2, 0.8, 0.9]), np.array([0, 0, 1, 1])) == 1.0
    assert auroc(np.array([0.9, 0.8, 0.2, 0.1]), np.array([0, 0, 1, 1])) == 0.0
    assert auroc(np.array([0.5, 0.5, 0.5, 0.5]), np.array([0, 1, 0, 1])) == 0.5
    assert math.isnan(auroc(np.array([0.1, 0.2]), np.array([0, 0])))
    # Tied scores share their mean rank; a scenario without the score leaves the correlation unknown.
    assert rank_correlation([1.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]) == pytest.approx(0.9 ** 0.5)
    assert math.isnan(rank_correlation([1.0, math.nan, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]))
    rng = np.random.default_rng(3)
    scores, labels = rng.standard_normal(300), rng.random(300) < 0.3
    pairs = np.mean([(a > b) + 0.5 * (a == b) for a in scores[labels] for b in scores[~labels]])
    assert auroc(scores, labels) == pytest.approx(pairs)
    row = {"ood": {"time_s": [0.0, 1.0, 2.0, 3.0, 4.0], "failure_times_s": [3.5],
                   "scores": {"patch_coreset": [1.0, 2.0, 3.0, 4.0, 5.0]}}}
    assert frame_labels(row, 2.0).tolist() == [False, False, True, True, False]
    # Past 3.5 s no failure came before the end: the frame at 4.0 s (end 5.0 s) cannot tell, at 3.0 s it can.
    assert outcome_known({**row, "duration_s": 5.0}, 2.0).tolist() == [True, True, True, True, False]
    assert outcome_known({**row, "duration_s": 6.0}, 2.0).tolist() == [True] * 5
    assert frame_scores(row, "patch_coreset", causal_window=2).tolist() == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert [label for label, _, _ in score_variants([{**row, "ood": {**row["ood"], "frames": 5}}])] == [
        "patch_coreset", "patch_coreset (10-frame mean)"]


def test_the_report_scores_the_policys_behaviour_from_the_logged_steering():
    row = {"ood": {"frames": 4, "time_s": [0.0, 0.1, 0.2, 0.4], "failure_times_s": [], "scores": {"patch_coreset": [1.0] * 4},
                   "steering_rad": [0.0, -0.02, 0.03, 0.03]}}
    assert frame_scores(row, "steering_magnitude").tolist() == pytest.approx([0.0, 0.02, 0.03, 0.03])
    assert frame_scores(row, "steering_rate").tolist() == pytest.approx([0.0, 0.2, 0.5, 0.0])
    assert [m for _, m, window in score_variants([row]) if window == 1] == ["patch_coreset", "steering_magnitude", "steering_rate"]


def test_the_report_bounds_a_lane_score_by_the_cars_true_lane_pose_where_rows_log_it():
    row = {"ood": {"frames": 3, "time_s": [0.0, 0.1, 0.2], "failure_times_s": [], "scores": {}, "steering_rad": [0.0] * 3,
                   "lane_offset_m": [0.5, -1.0, None], "heading_error_rad": [0.0, 0.05, 0.0]}}
    assert frame_scores(row, "true_lane_offset")[:2].tolist() == pytest.approx([0.5, 1.0])
    assert frame_scores(row, "true_lane_lookahead")[:2].tolist() == pytest.approx([0.5, abs(-1.0 + 10.0 * math.tan(0.05))])
    assert math.isnan(frame_scores(row, "true_lane_offset")[2])
    assert np.isnan(frame_scores(row, "lane_offset")).all()  # not logged in this episode
    assert "true_lane_lookahead" in [m for _, m, _ in score_variants([row])]


def logged_row(scenario, seed, scores, steering, failures=(), duration_s=None):
    """An eval row of a rule-off episode whose frames are 1 s apart, logging `scores`."""
    frames = len(steering)
    return {"method": "P", "training_seed": 0, "scenario": scenario, "seed": seed, "episode_s": float(frames),
            "width": 448, "height": 280, "duration_s": duration_s or float(frames), "score": 1.0 - 0.1 * len(failures),
            "interventions": len(failures), "distance_m": 10.0 * frames, "mean_speed_mps": 10.0,
            "ood": {"frames": frames, "time_s": [float(t) for t in range(frames)], "failure_times_s": list(failures),
                    "steering_rad": list(steering), "scores": dict(scores), "rule": False, "cruise_scale": 1.0,
                    "slowed_frames": 0, "handover_s": None, "method": "patch_coreset"}}


def test_runs_that_drove_a_cell_alike_are_read_with_the_scores_each_logged(tmp_path):
    from sps_driving.sim.results import merge_results

    ood = OOD_SCENARIO_NAMES[0]
    first, second, other = (tmp_path / name for name in ("first", "second", "other"))
    for folder, scores, steering in ((first, {"patch_coreset": [1.0, 2.0]}, [0.1, 0.2]),
                                     (second, {"lane_lookahead": [0.5, 0.7]}, [0.1, 0.2]),
                                     (other, {"lane_offset": [0.3, 0.3]}, [0.1, -0.2])):
        folder.mkdir()
        (folder / "results.jsonl").write_text(json.dumps(logged_row(ood, 100, scores, steering)) + "\n")
    (row,) = merge_results([str(first), str(second)])
    assert row["ood"]["scores"] == {"patch_coreset": [1.0, 2.0], "lane_lookahead": [0.5, 0.7]}
    # Another drive of the same cell (it steered otherwise) replaces the row and takes none of its scores.
    (row,) = merge_results([str(first), str(second), str(other)])
    assert row["ood"]["scores"] == {"lane_offset": [0.3, 0.3]}


def test_a_combination_is_the_mean_of_its_parts_each_scaled_in_distribution(tmp_path):
    from sps_driving.cli import main

    rows = [logged_row(ID_SCENARIO.name, 100, {"patch_coreset": [2.0] * 5}, [0.5] * 5),
            logged_row(OOD_SCENARIO_NAMES[0], 100, {"patch_coreset": [4.0, 2.0, 2.8, 0.0, 2.0]}, [0.5, -1.0, 0.7, 0.0, 0.0],
                       failures=[1.5])]
    combine(rows, "patch_coreset+steering_magnitude")
    # Scales 2.0 and 0.5 rad (their in-distribution 99th percentiles): each part reads 1 where it reads as in distribution.
    assert rows[1]["ood"]["scores"]["patch_coreset+steering_magnitude"] == pytest.approx([1.5, 1.5, 1.4, 0.0, 0.5])
    with pytest.raises(ValueError, match="lane_lookahead.*patch_coreset, steering_magnitude"):
        combine(rows, "patch_coreset+lane_lookahead")
    with pytest.raises(ValueError, match="none are here"):
        combine(rows[1:], "patch_coreset+steering_rate")
    path = tmp_path / "run"
    path.mkdir()
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "report"
    assert main(["ood", "report", str(path), "--combine", "patch_coreset+steering_magnitude", "--out", str(out)]) == 0
    summary = json.loads((out / "ood_report.json").read_text())["prediction"]["summary"]
    # The two frames before the failure (0 and 1 s) against the two after it whose outcome is known: each part
    # ranks one of them below the frame at 2 s, their mean ranks both above it.
    assert summary["patch_coreset"]["median_auroc"] == summary["steering_magnitude"]["median_auroc"] == 0.75
    assert summary["patch_coreset+steering_magnitude"]["median_auroc"] == 1.0
    against = summary["patch_coreset+steering_magnitude"]["against_parts"]
    assert {part: (e["mean_points"], e["higher"], e["lower"]) for part, e in against.items()} == {
        "patch_coreset": (25.0, 1, 0), "steering_magnitude": (25.0, 1, 0)}
    assert "patch_coreset+steering_magnitude (10-frame mean)" in summary
    with pytest.raises(SystemExit, match="cannot combine 'patch_coreset'"):
        main(["ood", "report", str(path), "--combine", "patch_coreset", "--out", str(out)])


def test_eval_with_the_rule_ends_an_episode_at_a_requested_handover_counted_apart(tmp_path):
    import yaml
    from samples import tiny_dinov2_policy

    from sps_driving.cli import main

    ckpt = tiny_dinov2_policy(tmp_path / "policy", state_inputs=("speed_mps", "target_speed_mps"))
    common = ["eval", "--policy", str(ckpt), "--episodes", "1", "--episode-s", "2.0", "--workers", "1", "--no-failure-strips",
              "--scenarios", "urban-summer-dry-night-animal"]
    with pytest.raises(SystemExit, match="no OOD calibration"):
        main(common + ["--ood-rule", "--out", str(tmp_path / "bare")])
    calibration_of(ckpt, scale=1e-6)  # every frame far above any threshold
    config = load_ood_config()
    config["rule"].update(handover_after_s=0.5)
    (tmp_path / "ood.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "eval"
    for extra in ([], ["--ood-rule", "--ood-config", str(tmp_path / "ood.yaml")], ["--cruise-scale", "0.5"]):
        assert main(common + extra + ["--out", str(out)]) == 0
    rows = {r["method"]: r for r in (json.loads(line) for line in (out / "results.jsonl").read_text().splitlines())}
    assert set(rows) == {"SPS-50", "SPS-50+OOD-cap", "SPS-50-slow0.5-cap"}  # slowed by the speed cap, as in the graph
    off, on, slow = rows["SPS-50"], rows["SPS-50+OOD-cap"], rows["SPS-50-slow0.5-cap"]
    assert off["ood"]["frames"] == 20 and not off["handover"] and off["ood"]["handover_s"] is None
    assert all(v > 100 for v in off["ood"]["scores"][config["score"]["method"]])
    # Slowed from the second frame, the handover 0.5 s after the first score: the episode ends there.
    assert on["handover"] and on["ood"]["handover_s"] == pytest.approx(0.5)
    assert on["ood"]["frames"] == 6 and on["ood"]["slowed_frames"] == 5
    assert on["success_s"] <= 0.5 + 1e-9 and on["score"] == pytest.approx(on["success_s"] / 2.0)
    assert on["distance_m"] < off["distance_m"] and on["interventions"] <= off["interventions"]
    assert slow["ood"]["slowed_frames"] == 20 and slow["ood"]["cruise_scale"] == 0.5 and not slow["handover"]


def test_a_slow_down_by_speed_cap_slows_the_car_whatever_the_policy_commands(tmp_path):
    from samples import tiny_dinov2_policy

    from sps_driving.cli import main
    from sps_driving.core import host

    ckpt = tiny_dinov2_policy(tmp_path / "policy", state_inputs=("speed_mps", "target_speed_mps"))
    common = ["eval", "--policy", str(ckpt), "--episodes", "1", "--episode-s", "3.0", "--workers", "1", "--no-failure-strips",
              "--scenarios", "rural-summer-dry-day-car", "--out", str(tmp_path / "eval")]
    with pytest.raises(SystemExit, match="slow-by speed_cap is how"):
        main(common + ["--slow-by", "speed_cap"])
    calibration_of(ckpt)
    for extra in ([], ["--cruise-scale", "0.3"]):
        assert main(common + extra) == 0
    rows = {r["method"]: r for r in (json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").read_text().splitlines())}
    off, capped = rows["SPS-50"], rows["SPS-50-slow0.3-cap"]
    assert capped["ood"]["slow_by"] == "speed_cap" and capped["ood"]["slowed_frames"] == capped["ood"]["frames"] == 30
    assert capped["host"] == host.describe() and "; ATen " in capped["host"]  # the kind of CPU it drove on
    assert f"Host (sps_driving.core.host): {host.describe()}" in (tmp_path / "eval" / "table1.md").read_text()
    # The random policy's own throttle is the same in both; the cap brakes the car from the episode's
    # start speed towards 0.3 of its target.
    assert capped["mean_speed_mps"] < off["mean_speed_mps"] - 1.0


def test_replay_reports_the_score_distribution_and_the_frames_above_each_threshold():
    from types import SimpleNamespace

    from sps_driving.core import topics
    from sps_driving.tools.replay import Record, format_ood_score, ood_score_report

    rule = load_ood_config()["rule"]
    values = [0.9] * 90 + [rule["slow_threshold"] + 0.05] * 6 + [rule["handover_threshold"] + 0.5] * 4

    def record(i, value):
        header = SimpleNamespace(stamp=SimpleNamespace(sec=100 + i, nanosec=0))
        return Record(topics.OOD_SCORE, 0, SimpleNamespace(header=header, name=["patch_coreset"], position=[value]))

    records = [record(i, v) for i, v in enumerate(values)] + [Record(topics.POLICY_COMMAND, 0, None)]
    report = ood_score_report(records)
    assert report["frames"] == 100 and report["p50"] == pytest.approx(0.9) and report["max"] == pytest.approx(values[-1])
    assert report["above"]["slow_threshold"]["frames"] == 10 and report["above"]["handover_threshold"]["frames"] == 4
    assert report["above"]["handover_threshold"]["first_stamps_ns"][0] == 196 * 10**9
    assert "above handover_threshold" in format_ood_score(report)
    assert ood_score_report([]) is None and "none" in format_ood_score(None)


def test_an_ensembles_evaluation_logs_its_heads_disagreement_and_the_report_ranks_failures_by_it(tmp_path):
    from samples import tiny_policy

    from sps_driving.cli import main
    from sps_driving.core.ood import HEAD_DISAGREEMENT

    heads = [tiny_policy(tmp_path / f"seed{seed}", 16, 16, 384, seed=seed) for seed in (0, 1)]
    assert main(["ensemble", "--out", str(tmp_path / "ens"), *map(str, heads)]) == 0
    assert main(["ensemble", "--out", str(tmp_path / "same"), str(heads[0]), str(heads[0])]) == 0
    out = tmp_path / "eval"
    for name in ("ens", "same"):
        assert main(["eval", "--policy", str(tmp_path / name), "--name", name, "--episodes", "1", "--episode-s", "2.0",
                     "--workers", "1", "--no-failure-strips", "--scenarios", "urban-summer-dry-night-animal",
                     "--out", str(out)]) == 0
    rows = {r["method"]: r for r in (json.loads(line) for line in (out / "results.jsonl").read_text().splitlines())}
    logged = rows["ens"]["ood"]["scores"]
    assert list(logged) == [HEAD_DISAGREEMENT]  # no calibration in an ensemble's folder: the heads' spread alone
    assert len(logged[HEAD_DISAGREEMENT]) == 20 and max(logged[HEAD_DISAGREEMENT]) > 0
    assert set(rows["same"]["ood"]["scores"][HEAD_DISAGREEMENT]) == {0.0}  # one checkpoint twice agrees with itself
    assert main(["ood", "report", str(out), "--method", "ens", "--out", str(tmp_path / "report")]) == 0
    report = json.loads((tmp_path / "report" / "ood_report.json").read_text())
    # The heads' spread, the policy's behaviour and the bound from the car's true lane pose.
    scores = (HEAD_DISAGREEMENT, "steering_magnitude", "steering_rate", "true_lane_offset", "true_lane_lookahead")
    assert set(report["prediction"]["summary"]) == {*scores, *(f"{name} (10-frame mean)" for name in scores)}
    # The rule's calibrated score was not logged: no alarms to time or replay, and the report says so.
    assert report["lead_time"] is None and report["replayed_rule"] is None
    assert "patch_coreset) is not logged in these rows" in (tmp_path / "report" / "ood_report.md").read_text()


def test_the_selection_disagreement_is_the_steering_spread_over_other_draws_of_the_frame(tmp_path):
    from samples import tiny_policy

    from sps_driving.core.ood import SelectionDisagreement
    from sps_driving.core.policies.checkpoint import load_policy
    from sps_driving.core.selection import PatchSelector, SelectionConfig

    policy = load_policy(tiny_policy(tmp_path / "sps", 16, 16, 384, rate=0.5, seed=3))
    every_patch = np.random.default_rng(0).normal(size=(256, 384)).astype(np.float32)
    spread = SelectionDisagreement(policy, draws=4)
    steering = [policy.predict(every_patch[i], i)[0]
                for i in (PatchSelector(SelectionConfig("sps", 0.5, seed), policy.grid).select(7) for seed in (4, 5, 6, 7))]
    assert spread(every_patch, 7, None) == pytest.approx(np.std(steering), abs=1e-6) and np.std(steering) > 0
    dense = load_policy(tiny_policy(tmp_path / "da", 16, 16, 384, rate=1.0))
    assert SelectionDisagreement(dense, draws=4)(every_patch, 7, None) == 0.0  # every draw keeps every patch
    with pytest.raises(ValueError, match="at least 2"):
        SelectionDisagreement(policy, draws=1)
    with pytest.raises(ValueError, match="at least 2"):
        ood_settings(None, "patch_coreset", selection_draws=1)


def test_eval_logs_the_selection_disagreement_without_changing_the_drive(tmp_path):
    from samples import tiny_dinov2_policy

    from sps_driving.cli import main
    from sps_driving.core.ood import SELECTION_DISAGREEMENT

    ckpt = tiny_dinov2_policy(tmp_path / "policy")
    common = ["eval", "--policy", str(ckpt), "--episodes", "1", "--episode-s", "2.0", "--workers", "1", "--no-failure-strips",
              "--scenarios", "rural-summer-dry-night-unseencar"]
    assert main(common + ["--out", str(tmp_path / "plain")]) == 0
    assert main(common + ["--selection-draws", "4", "--out", str(tmp_path / "draws")]) == 0
    plain, draws = (json.loads((tmp_path / name / "results.jsonl").read_text()) for name in ("plain", "draws"))
    assert "ood" not in plain and list(draws["ood"]["scores"]) == [SELECTION_DISAGREEMENT]
    assert len(draws["ood"]["scores"][SELECTION_DISAGREEMENT]) == 20 and max(draws["ood"]["scores"][SELECTION_DISAGREEMENT]) > 0
    assert draws["distance_m"] == pytest.approx(plain["distance_m"], rel=1e-6)  # scored beside the drive, not in it
    with pytest.raises(SystemExit, match="in process"):
        main(common + ["--selection-draws", "4", "--graph", "--out", str(tmp_path / "graph")])
