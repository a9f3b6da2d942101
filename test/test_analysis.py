"""Redundancy analysis on synthetic descriptor matrices of known rank, spectrum and coherence."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sps_driving.analysis.correlation import CorrelationSummary, patch_correlation
from sps_driving.analysis.lemma import (
    LemmaSweep,
    covariance_scale_factor,
    decompose,
    embedding_distortion,
    projector_distance,
    row_coherence,
    sample_sizes,
    subspace_distance,
)
from sps_driving.analysis.pca import (
    CurveAverage,
    RunningCovariance,
    components_to_reach,
    curve_from_covariance,
    explained_variance_curve,
    top_norm_rows,
    top_patch_count,
)
from sps_driving.analysis.redundancy import AnalysisSettings, RedundancyAnalysis
from sps_driving.analysis.similarity import cosine_similarity_map, overlay, overlay_grid
from sps_driving.core.grid import PatchGrid


def orthonormal(rng, rows, cols):
    q, _ = np.linalg.qr(rng.standard_normal((rows, cols)))
    return q


def with_spectrum(rng, n, d, singular_values):
    """An [n, d] matrix with zero column means and the given singular values."""
    left = rng.standard_normal((n, len(singular_values)))
    left = np.linalg.qr(left - left.mean(axis=0))[0]  # centred columns stay centred
    return left @ np.diag(singular_values) @ orthonormal(rng, d, len(singular_values)).T


def hadamard(order):
    h = np.ones((1, 1))
    while h.shape[0] < order:
        h = np.block([[h, h], [h, -h]])
    return h


# ---------------------------------------------------------------- PCA (eq. 3)


def test_explained_variance_reaches_one_exactly_at_the_rank():
    rng = np.random.default_rng(0)
    rank = 6
    x = rng.standard_normal((64, rank)) @ rng.standard_normal((rank, 40)) + 3.0  # offset: centring matters
    curve = explained_variance_curve(x)
    assert curve.shape == (40,)
    assert curve[rank - 1] == pytest.approx(1.0, abs=1e-9)
    assert curve[rank - 2] < 1.0 - 1e-3
    assert np.all(np.diff(curve) >= -1e-12)
    assert components_to_reach(curve, 1.0) == rank


def test_components_to_ninety_percent_for_a_known_spectrum():
    rng = np.random.default_rng(1)
    # Eigenvalues (squared singular values) 40, 30, 20, 6, 4: E = .4, .7, .9, .96, 1.
    x = with_spectrum(rng, 50, 16, np.sqrt([40.0, 30.0, 20.0, 6.0, 4.0]))
    curve = explained_variance_curve(x)
    np.testing.assert_allclose(curve[:5], [0.4, 0.7, 0.9, 0.96, 1.0], atol=1e-9)
    assert components_to_reach(curve, 0.9) == 3
    assert components_to_reach(curve, 0.91) == 4
    with pytest.raises(ValueError):
        components_to_reach(curve, 0.0)


def test_frame_without_variance_has_no_curve():
    assert explained_variance_curve(np.ones((8, 4))) is None
    with pytest.raises(ValueError, match="non-finite"):
        explained_variance_curve(np.full((8, 4), np.nan))


def test_top_norm_rows_keeps_the_strongest_patches_in_grid_order():
    x = np.zeros((6, 2))
    x[:, 0] = [1.0, 5.0, 2.0, 9.0, 0.5, 3.0]
    kept = top_norm_rows(x, 3)
    np.testing.assert_array_equal(kept[:, 0], [5.0, 9.0, 3.0])
    assert top_patch_count(256, 128) == 128
    assert top_patch_count(100, 128) == 50


def test_running_covariance_matches_the_covariance_of_all_rows():
    rng = np.random.default_rng(2)
    chunks = [(rng.standard_normal((30, 8)) * 4 + 100).astype(np.float16) for _ in range(5)]
    running = RunningCovariance()
    for chunk in chunks:
        running.add(chunk)
    expected = np.cov(np.concatenate(chunks).astype(np.float64), rowvar=False)
    np.testing.assert_allclose(running.covariance(), expected, rtol=1e-9, atol=1e-9)
    curve = curve_from_covariance(running.covariance())
    assert curve[-1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="dim"):
        running.add(np.zeros((2, 3)))


def test_curve_average_is_the_mean_of_curves():
    average = CurveAverage()
    average.add(np.array([0.5, 1.0]))
    average.add(np.array([0.7, 1.0]))
    np.testing.assert_allclose(average.mean(), [0.6, 1.0])
    with pytest.raises(ValueError):
        CurveAverage().mean()


# ---------------------------------------------------------------- patch correlation


def test_patch_correlation_matches_numpy_and_handles_constant_patches():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((10, 32))
    x[4] = 0.0  # a dropped patch
    x[7] = 2.5 * x[2] + 1.0  # a patch repeating another
    corr = patch_correlation(x)
    keep = [i for i in range(10) if i != 4]
    np.testing.assert_allclose(corr[np.ix_(keep, keep)], np.corrcoef(x[keep]), atol=1e-12)
    assert corr[2, 7] == pytest.approx(1.0)
    assert np.all(corr[4, np.arange(10) != 4] == 0.0) and corr[4, 4] == 1.0
    summary = CorrelationSummary(0.99)
    summary.add(corr)
    stats = summary.summary()
    assert stats["strong_fraction_mean"] == pytest.approx(2 / 90)


# ---------------------------------------------------------------- lemma (section 3.5, appendix A.4)


def test_projector_distance_is_the_sine_of_the_principal_angle():
    angle = 0.3
    a = np.array([[1.0], [0.0], [0.0]])
    b = np.array([[np.cos(angle)], [np.sin(angle)], [0.0]])
    assert projector_distance(a, b) == pytest.approx(np.sin(angle))
    assert projector_distance(a, a) == pytest.approx(0.0, abs=1e-12)
    assert projector_distance(a, np.eye(3)[:, :2]) == 1.0
    # Cross-check against the D x D projectors.
    rng = np.random.default_rng(4)
    p, q = orthonormal(rng, 7, 3), orthonormal(rng, 7, 3)
    assert projector_distance(p, q) == pytest.approx(np.linalg.norm(p @ p.T - q @ q.T, 2))


def test_coherence_of_spread_and_spiky_matrices():
    n, rank = 64, 4
    # Hadamard columns (not the all-ones one) are centred, orthogonal and equally spread over rows.
    spread = hadamard(n)[:, 1 : rank + 1] @ orthonormal(np.random.default_rng(5), 12, rank).T
    assert row_coherence(decompose(spread, rank)) == pytest.approx(1.0)
    # Each direction lives in two patches (+e_k and -e_k): mu = N / (2r), the most a centred matrix allows.
    spiky = np.zeros((n, 12))
    for k in range(rank):
        spiky[2 * k, k], spiky[2 * k + 1, k] = 1.0, -1.0
    assert row_coherence(decompose(spiky, rank)) == pytest.approx(n / (2 * rank))
    # Half of the rows: the spread matrix keeps its subspace exactly, the spiky one usually loses it.
    rng = np.random.default_rng(6)
    draws = [rng.choice(n, n // 2, replace=False) for _ in range(50)]
    spread_parts, spiky_parts = decompose(spread, rank), decompose(spiky, rank)
    assert max(subspace_distance(spread_parts, i) for i in draws) < 1e-9
    assert np.mean([subspace_distance(spiky_parts, i) for i in draws]) > 0.5


def test_subspace_distance_falls_as_more_rows_are_sampled():
    rng = np.random.default_rng(7)
    n, d, rank = 256, 48, 8
    x = with_spectrum(rng, n, d, np.linspace(10.0, 4.0, rank)) + 0.4 * rng.standard_normal((n, d))
    sweep = LemmaSweep.empty(sample_sizes(n, [0.1, 0.3, 0.6, 1.0]), n)
    sweep.add_frame(x, rank, draws=10, rng=rng)
    rows = sweep.summary()["samples"]
    means = [row["distance_mean"] for row in rows]
    assert all(a > b for a, b in zip(means, means[1:])), means
    assert means[-1] == pytest.approx(0.0, abs=1e-9)  # m = N: the same rows
    assert all(row["distance_p95"] >= row["distance_mean"] - 1e-12 for row in rows)
    distortions = [row["distortion_mean"] for row in rows]
    assert distortions[0] > distortions[-2] and distortions[-1] == pytest.approx(0.0, abs=1e-9)


def test_sampled_gram_matrix_is_unbiased_up_to_m_over_n():
    """Eq. 8, E[(S F)^T (S F)] = m/N F^T F, and eq. 13 for the sampled covariance, by Monte Carlo."""
    rng = np.random.default_rng(8)
    n, m, draws = 16, 6, 20000
    x = decompose(rng.standard_normal((n, 5)) @ np.diag([3.0, 2.0, 1.0, 0.5, 0.2]), 5).centred
    gram_sum = np.zeros((5, 5))
    for _ in range(draws):
        rows = x[rng.choice(n, m, replace=False)]
        gram_sum += rows.T @ rows
    mean_gram = gram_sum / draws
    full = x.T @ x
    scale = np.linalg.norm(full)
    assert np.linalg.norm(mean_gram - m / n * full) / scale < 0.01
    assert np.linalg.norm(mean_gram - (m - 1) / n * full) / scale > 0.05  # a wrong scale is detectable
    # Eq. 13: the unbiased covariance of the sampled rows is alpha times the full one.
    mean_cov = mean_gram / (m - 1)
    full_cov = full / (n - 1)
    np.testing.assert_allclose(mean_cov, covariance_scale_factor(m, n) * full_cov, atol=0.01 * np.abs(full_cov).max())


def test_covariance_scale_factor_and_sample_sizes():
    assert covariance_scale_factor(128, 256) == pytest.approx(255 / 254)
    assert covariance_scale_factor(256, 256) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        covariance_scale_factor(1, 256)
    assert sample_sizes(256, [0.5, 0.1, 0.5, 1.0]) == [26, 128, 256]
    with pytest.raises(ValueError):
        sample_sizes(256, [0.0])


def test_embedding_distortion_is_zero_for_all_rows():
    rng = np.random.default_rng(9)
    parts = decompose(rng.standard_normal((40, 10)), 4)
    assert embedding_distortion(parts, np.arange(40)) == pytest.approx(0.0, abs=1e-12)
    assert embedding_distortion(parts, rng.choice(40, 8, replace=False)) > 0.0


# ---------------------------------------------------------------- similarity overlays


def test_similarity_map_and_overlays():
    grid = PatchGrid(3, 4)
    rng = np.random.default_rng(10)
    x = rng.standard_normal((grid.n, 16))
    x[5] = -x[2]
    sim = cosine_similarity_map(x, grid, 2)
    assert sim.shape == (3, 4)
    assert sim[0, 2] == pytest.approx(1.0)
    assert sim[1, 1] == pytest.approx(-1.0)  # patch 5
    image = rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)
    blended = overlay(image, sim, 0.5)
    assert blended.shape == image.shape and blended.dtype == np.uint8
    np.testing.assert_array_equal(overlay(image, sim, 0.0), image)
    # Normalized per map (appendix A.2): the most similar patch is red, the least blue, at any scale.
    heat = overlay(np.zeros_like(image), 0.4 + 0.1 * (sim + 1.0), 1.0)
    seed_pixel, opposite_pixel = heat[10, 50], heat[30, 30]  # centres of patches 2 and 5
    assert seed_pixel[0] > 100 and seed_pixel[2] < 50 and opposite_pixel[2] > 100 and opposite_pixel[0] < 50
    flat = overlay(np.zeros_like(image), np.full((3, 4), 0.7), 1.0)  # a constant map is all low
    assert np.all(flat == flat[0, 0]) and flat[0, 0, 2] > 100 and flat[0, 0, 0] < 50
    mosaic = overlay_grid(image, x, grid, cell_width=40, opacity=0.5)
    assert mosaic.shape == (3 * 30, 4 * 40, 3)
    assert not np.array_equal(mosaic[:30, :40], mosaic[:30, 40:80])  # each seed its own map
    with pytest.raises(ValueError):
        cosine_similarity_map(x, grid, grid.n)


# ---------------------------------------------------------------- the streamed analysis


def test_redundancy_analysis_writes_figures_and_summary(tmp_path):
    rng = np.random.default_rng(11)
    grid = PatchGrid(8, 8)
    settings = AnalysisSettings(top_patches=16, lemma_frame_stride=2, lemma_max_frames=2, lemma_draws=3)
    analysis = RedundancyAnalysis(settings, grid)
    basis = orthonormal(rng, 24, 5).T
    for _ in range(5):
        weights = rng.standard_normal((grid.n, 5)) * [8.0, 4.0, 2.0, 1.0, 0.5]
        analysis.add_frame((weights @ basis + 0.01 * rng.standard_normal((grid.n, 24))).astype(np.float16),
                           image_rgb=rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
    analysis.add_frame(np.ones((grid.n, 24)))  # no variance: counted, not averaged
    broken = np.ones((grid.n, 24))
    broken[3, 4] = np.nan
    assert analysis.add_frame(broken) is False  # dropped and counted, not a crash
    summary = analysis.write(tmp_path)
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["frames"] == 6 and summary["frames_without_variance"] == 1
    assert summary["frames_dropped_nonfinite"] == 1
    # Eigenvalues 64, 16, 4, 1, .25: 90% needs 2 components (94%).
    assert summary["components_90_all"] == 2
    assert 1 <= summary["components_90_top"] <= 5
    assert summary["top_patches"] == 16
    assert summary["lemma"]["frames"] == 2
    for name in summary["figures"]:
        assert (tmp_path / name).stat().st_size > 1000
    assert "similarity_grid.png" in summary["figures"] and "explained_variance.png" in summary["figures"]
    with pytest.raises(ValueError, match="expected"):
        analysis.add_frame(np.zeros((grid.n + 1, 24)))


def test_settings_load_from_the_shipped_yaml_and_reject_unknown_keys(tmp_path):
    from sps_driving.core.resources import config_path

    settings = AnalysisSettings.from_yaml(config_path("analysis.yaml"))
    assert settings.explained_variance_level == 0.9 and settings.top_patches == 128
    bad = tmp_path / "bad.yaml"
    bad.write_text("top_patch: 3\n")
    with pytest.raises(ValueError, match="top_patch"):
        AnalysisSettings.from_yaml(bad)
    bad.write_text("lemma: {draws: 0}\n")
    with pytest.raises(ValueError, match="lemma_draws"):
        AnalysisSettings.from_yaml(bad)
    with pytest.raises(ValueError, match="explained_variance_level"):
        AnalysisSettings(explained_variance_level=1.5)
    with pytest.raises(ValueError, match="overlay seeds"):
        AnalysisSettings(overlay_seeds=((1.5, 0.5),))


# ---------------------------------------------------------------- `sps-driving analyze` on a feature cache


def write_cache(directory, frames, grid, dim, rng, backbone="dinov2_vits14"):
    from sps_driving.train.cache import FeatureCacheWriter

    meta = {"backbone": backbone, "grid": {"rows": grid.rows, "cols": grid.cols}, "descriptor_dim": dim}
    basis = orthonormal(rng, dim, 4).T
    with FeatureCacheWriter(directory, meta, shard_size=4) as writer:
        for i in range(frames):
            weights = rng.standard_normal((grid.n, 4)) * [6.0, 3.0, 1.0, 0.5]
            writer.add(weights @ basis + 0.02 * rng.standard_normal((grid.n, dim)), 0.0, 0.1, i * 33_000_000, "drive")


def test_analyze_command_on_a_feature_cache(tmp_path, capsys):
    import cv2

    from sps_driving.cli import main

    rng = np.random.default_rng(12)
    grid = PatchGrid(6, 8)
    write_cache(tmp_path / "cache", 10, grid, 32, rng)
    image = tmp_path / "frame.png"
    cv2.imwrite(str(image), rng.integers(0, 256, (60, 80, 3), dtype=np.uint8))
    out = tmp_path / "analysis"
    assert main(["analyze", str(tmp_path / "cache"), "--out", str(out), "--stride", "2",
                 "--overlay-image", str(image), "--rank", "3"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backbone"] == "dinov2_vits14" and summary["frames"] == 5
    assert summary["grid"] == [6, 8] and summary["dim"] == 32
    assert summary["components_90_all"] == 2  # eigenvalues 36, 9, 1, .25: 2 components hold 97%
    assert summary["top_patches"] == 24  # half of a 48-patch grid
    assert summary["lemma"]["rank_mean"] == 3.0
    assert (out / "similarity_grid.png").is_file() and (out / "explained_variance.png").is_file()
    assert "90% variance with 2 components" in capsys.readouterr().out
    # Several inputs are one stream; inputs of different grids or backbones are refused.
    write_cache(tmp_path / "cache2", 3, grid, 32, rng)
    assert main(["analyze", str(tmp_path / "cache"), str(tmp_path / "cache2"), "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["frames"] == 13
    write_cache(tmp_path / "other", 3, PatchGrid(4, 4), 32, rng)
    assert main(["analyze", str(tmp_path / "cache"), str(tmp_path / "other"), "--out", str(out)]) == 2
    assert "analyse them separately" in capsys.readouterr().err
    # A missing input is a clear error, not a traceback.
    assert main(["analyze", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert main(["analyze", str(tmp_path), "--out", str(out)]) == 2  # a folder that is no cache


def test_analyze_command_on_a_rosbag2_with_the_embedded_dinov2(tmp_path, capsys):
    """Real rosbag2 camera frames through the embedded DINOv2 at a small input size (4 x 6 patches)."""
    import dataclasses

    import yaml

    from sps_driving.cli import main
    from sps_driving.core import topics
    from sps_driving.ros import bagio, msgs

    rng = np.random.default_rng(13)
    bag = tmp_path / "drive"
    with bagio.BagWriter(bag) as writer:
        for i in range(4):
            image = np.zeros((120, 180, 3), dtype=np.uint8)
            image[:60] = (120, 160, 230)  # sky
            image[60:] = (90, 90, 90)  # road
            image[60:, 80 + 5 * i : 100 + 5 * i] = 255  # a lane marking that moves
            image[20:50, 20 * i : 20 * i + 30] = rng.integers(0, 256, 3)  # a coloured object
            writer.write(topics.IMAGE, msgs.image_fields(image, i * 33_000_000, "camera"), i * 33_000_000)
        broken = bagio.to_bag(msgs.image_fields(image, 4 * 33_000_000, "camera"))
        writer.write(topics.IMAGE, dataclasses.replace(broken, encoding="yuv422"), 4 * 33_000_000)
    config = tmp_path / "extractor.yaml"
    config.write_text(yaml.safe_dump({"input_size": [56, 84]}))
    out = tmp_path / "analysis"
    assert main(["analyze", str(bag), "--out", str(out), "--extractor-config", str(config)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backbone"] == "dinov2_vits14" and summary["frames"] == 4
    assert summary["grid"] == [4, 6] and summary["dim"] == 384
    assert 1 <= summary["components_90_all"] <= 23 and 1 <= summary["components_90_top"] <= 11  # 24, 12 patches
    assert (out / "similarity_grid.png").is_file()  # a bag carries its frames
    assert "dropped frame" in capsys.readouterr().err
