"""Patch state families (PMTT): orbital offsets and shifts, the state reader (a tiny random DINOv2
of the real architecture: 2 layers, 64 channels, `sps_driving.core.backbones.dinov2.random_dinov2`), the
Manifold and its coverage on synthetic families c + U z + noise of known rank, the streamed
analysis and its command (the embedded DINOv2 at a 56x84 input), the appearance measurement,
orbital states in feature caches, and Manifold augmentation in training."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest
import torch
import yaml

from sps_driving.analysis.appearance import appearance_errors
from sps_driving.analysis.orbital import Family, OrbitalAnalysis, OrbitalSettings, coverage, family_errors
from sps_driving.cli import main
from sps_driving.core.backbones import resolve_config
from sps_driving.core.grid import PatchGrid
from sps_driving.core.orbital import (
    OrbitalReader,
    anchor_patches,
    effective_rank,
    fit_manifold,
    orbital_offsets,
    principal,
    resample,
    shift_pixels,
    top_energy,
    visible_reader,
)
from sps_driving.core.resources import config_path
from sps_driving.train.cache import FeatureCache, FeatureCacheWriter
from sps_driving.train.orbital_augment import OrbitalAugmenter
from sps_driving.train.trainer import TrainConfig, train

INPUT = (56, 84)  # 4 x 6 patches of 14 px
SETTINGS = OrbitalSettings(rank=2, cap=2.0, max_rank=6)


def tiny_dinov2(**config):
    from sps_driving.core.backbones.dinov2 import random_dinov2

    return random_dinov2("tiny", resolve_config({"input_size": list(INPUT), "backend": "torch", **config}))


def noise_frame(seed=0, shape=(60, 90)):
    return (np.random.default_rng(seed).random((*shape, 3)) * 255).astype(np.uint8)


def frame_folder(folder, steering):
    """An image folder of extract: noise_frame(i) as i.png, labelled steering[i] and throttle 0.2."""
    folder.mkdir()
    rows = ["filename,steering,throttle"]
    for i, value in enumerate(steering):
        cv2.imwrite(str(folder / f"{i}.png"), cv2.cvtColor(noise_frame(i), cv2.COLOR_RGB2BGR))
        rows.append(f"{i}.png,{value},0.2")
    (folder / "labels.csv").write_text("\n".join(rows) + "\n")
    return folder


# ---------------------------------------------------------------- offsets and shifts


@pytest.mark.parametrize("patch", [14, 16])
def test_offsets_keep_every_anchor_in_its_patch_and_visible_and_hidden_are_disjoint(patch):
    visible, hidden = orbital_offsets(patch)
    assert visible.shape == hidden.shape == (16, 2)
    assert not {tuple(v) for v in visible} & {tuple(h) for h in hidden}
    assert len({tuple(v) for v in np.concatenate([visible, hidden])}) == 32
    assert np.abs(np.concatenate([visible, hidden])).max(axis=1).min() >= 1, "no view repeats the canonical one"
    assert np.abs(np.concatenate([visible, hidden])).max() < patch / 2
    grid = (12, 24)
    for offset in np.concatenate([visible, hidden]):
        assert np.array_equal(anchor_patches(grid, patch, offset), np.arange(12 * 24))
    # half a patch takes the centres into the neighbouring patches: the check can fail
    assert not np.array_equal(anchor_patches(grid, patch, (patch // 2, 0)), np.arange(12 * 24))
    # hidden views lie between visible ones: never beyond the visible radius
    assert np.linalg.norm(hidden, axis=1).max() <= np.linalg.norm(visible, axis=1).max()
    with pytest.raises(ValueError, match="too small"):
        orbital_offsets(8)


def test_an_image_shift_moves_a_single_bright_pixel_by_exactly_the_offset():
    visible, hidden = orbital_offsets(14)
    for dy, dx in [(0, 0), *np.concatenate([visible, hidden])]:
        image = np.zeros((2, 3, 40, 50), np.float32)
        image[:, :, 17, 23] = 1.0
        for shifted in (shift_pixels(image, dy, dx), shift_pixels(torch.from_numpy(image), dy, dx).numpy()):
            assert shifted.shape == image.shape
            assert np.argwhere(shifted[0, 0] == 1.0).tolist() == [[17 + dy, 23 + dx]]
            assert shifted.sum() == image.sum()
    ramp = np.arange(10.0)[None].repeat(4, 0)
    assert shift_pixels(ramp, 0, 3)[0].tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6], "the edge column repeats"


def test_the_zero_shift_view_equals_the_canonical_descriptors_exactly():
    extractor = tiny_dinov2()
    visible, hidden = orbital_offsets(14)
    offsets = np.concatenate([visible[:5], [[0, 0]], hidden[:4]])
    reader = OrbitalReader(extractor, offsets, views_per_pass=3)
    frame = noise_frame()
    states = reader.read(frame)
    every = np.arange(extractor.grid.n)
    assert states["masked"].shape == states["raw"].shape == (10, 24, 64)
    assert np.array_equal(states["masked"][5], extractor.descriptors(extractor.encode(frame), every))
    assert not np.allclose(states["masked"][0], states["masked"][5]), "a shifted view is another state"
    # raw: the same weights without a mask give the ViT's own tokens (falloff none's descriptors)
    unmasked = tiny_dinov2(falloff="none")
    assert np.array_equal(states["raw"][5], unmasked.descriptors(unmasked.encode(frame), every))
    # a shifted view is the unshifted pass on shifted pixels
    pixels = shift_pixels(extractor.preprocess(frame), *offsets[2])
    with torch.inference_mode():
        alone = extractor.encoder.descriptors(extractor.encode_pixels(pixels).hidden, every).numpy()
    np.testing.assert_allclose(states["masked"][2], alone, atol=1e-5)


def test_the_reader_refuses_what_would_not_keep_patch_identity():
    extractor = tiny_dinov2()
    with pytest.raises(ValueError, match="out of their 14 px patches"):
        OrbitalReader(extractor, [[0, 7]])
    with pytest.raises(ValueError, match="no masked descriptors"):
        OrbitalReader(tiny_dinov2(falloff="none"), [[0, 1]], ("masked",))
    from sps_driving.core.backbones.pixels import PixelExtractor

    with pytest.raises(ValueError, match="torch DINOv2"):
        OrbitalReader(PixelExtractor(INPUT), [[0, 1]])
    with pytest.raises(ValueError, match="DINOv2 backbone"):
        visible_reader(PixelExtractor(INPUT), resolve_config({"backbone": "pixels"}))


# ---------------------------------------------------------------- the Manifold on synthetic families


def synthetic_family(rng, anchors=40, dim=64, rank=2, noise=0.02, scale=1.0):
    """c + U z + noise: z is the view's offset (px / 6), U random orthonormal [dim, rank] per anchor."""
    visible, hidden = orbital_offsets(14)
    basis = np.linalg.qr(rng.standard_normal((anchors, dim, rank)))[0]
    canonical = rng.standard_normal((anchors, dim))

    def states(offsets):
        z = offsets[:, :rank] / 6.0 * scale
        return canonical[:, None] + np.einsum("adr,kr->akd", basis, z) + noise * rng.standard_normal((anchors, len(offsets), dim))

    return Family(canonical, states(visible), states(hidden)), basis


def test_on_known_families_the_subspace_is_found_and_manifold_covers_more_than_observed_and_the_controls():
    family, basis = synthetic_family(np.random.default_rng(0))
    manifold = fit_manifold(family.visible, 2, 2.0)
    cosines = np.linalg.svd(np.einsum("adr,ads->ars", basis, manifold.basis), compute_uv=False)
    # noise 0.02 per channel against an orbit spread of ~0.7 tilts the fit by ~0.06 rad; a random plane is ~80 degrees off
    assert np.degrees(np.arccos(np.clip(cosines.min(axis=1), -1, 1))).max() < 6.0, "largest principal angle"
    errors = family_errors(family, SETTINGS, np.random.default_rng(1))
    cov = {name: coverage(errors[name], errors["center"]) for name in ("observed", "manifold", "random", "donor", "shared", "full")}
    # the noise off the true plane is all that no predictor can remove: Manifold comes within 1 point of that ceiling
    deviations = family.hidden - family.canonical[:, None]
    off_plane = deviations - np.einsum("adr,ahr->ahd", basis, np.einsum("adr,ahd->ahr", basis, deviations))
    ceiling = coverage((off_plane**2).sum(axis=(1, 2)), errors["center"])
    assert ceiling - 0.01 < cov["manifold"] <= ceiling + 1e-9 and cov["manifold"] > 0.93
    assert cov["manifold"] > cov["observed"] + 0.1
    assert cov["random"] < 0.2 and cov["donor"] < 0.2 and cov["shared"] < 0.3, cov
    assert np.all(errors["manifold"] < errors["observed"])
    # the sweeps pass through the Manifold's own error: at its rank, and at its cap
    np.testing.assert_allclose(errors["rank"][:, 2], errors["manifold"], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(errors["cap"][:, list(SETTINGS.caps).index(2.0)], errors["manifold"], rtol=1e-9, atol=1e-9)
    assert errors["rank"][:, 1].sum() > errors["rank"][:, 2].sum(), "one direction misses the second one"


def test_shared_geometry_covers_when_every_patch_moves_alike_and_donors_then_too():
    family, _ = synthetic_family(np.random.default_rng(2))
    shared_basis = np.linalg.qr(np.random.default_rng(3).standard_normal((64, 2)))[0]
    visible, hidden = orbital_offsets(14)
    shared = Family(family.canonical, family.canonical[:, None] + (visible[:, :2] / 6.0) @ shared_basis.T,
                    family.canonical[:, None] + (hidden[:, :2] / 6.0) @ shared_basis.T)
    errors = family_errors(shared, SETTINGS, np.random.default_rng(4))
    assert coverage(errors["shared"], errors["center"]) > 0.97 and coverage(errors["donor"], errors["center"]) > 0.97


def test_the_cap_bounds_extrapolation():
    family, _ = synthetic_family(np.random.default_rng(5))
    far = Family(family.canonical, family.visible, family.canonical[:, None] + 10 * (family.hidden - family.canonical[:, None]))
    manifold = fit_manifold(far.visible, 2, 2.0)
    z = manifold.coefficients(manifold.predict(far.hidden))
    assert np.all(np.abs(z) <= 2.0 * manifold.spread[:, None] + 1e-9)
    errors = family_errors(far, SETTINGS, np.random.default_rng(6))
    assert errors["clipped"].sum() > 0
    assert errors["cap"][:, -1].sum() < errors["manifold"].sum(), "unbounded reaches further than capped"


def test_the_fit_never_reads_hidden_states():
    family, _ = synthetic_family(np.random.default_rng(7))
    blind = Family(family.canonical, family.visible, np.full_like(family.hidden, np.nan))
    seen, unseen = (family_errors(f, SETTINGS, np.random.default_rng(8))["fits"] for f in (family, blind))
    for name in seen:
        for part in ("mean", "basis", "spread"):
            assert np.isfinite(getattr(unseen[name], part)).all()
            assert np.array_equal(getattr(unseen[name], part), getattr(seen[name], part)), (name, part)
    assert np.isnan(family_errors(blind, SETTINGS, np.random.default_rng(8))["full"]).all(), "Full-32 reads H (the check bites)"


def test_effective_rank_and_top_energy_of_known_spectra_are_exact():
    assert effective_rank(np.array([1.0, 1.0, 1.0, 1.0, 0.0])) == pytest.approx(4.0, abs=1e-12)
    assert effective_rank(np.array([4.0, 2.0, 1.0, 1.0])) == pytest.approx(2 ** 1.75, abs=1e-12)
    assert effective_rank(np.array([3.0, 0.0])) == pytest.approx(1.0, abs=1e-12)
    assert np.isnan(effective_rank(np.zeros(3)))
    assert top_energy(np.array([4.0, 2.0, 1.0, 1.0, 0.0, 0.0]), 2) == pytest.approx(0.75)
    # through the visible states' spectrum: variances 4, 2, 1, 1 along orthonormal directions
    rng = np.random.default_rng(9)
    directions = np.linalg.qr(rng.standard_normal((32, 4)))[0]
    coordinates = rng.standard_normal((16, 4))
    columns = np.linalg.qr(coordinates - coordinates.mean(axis=0))[0]  # centred orthonormal columns: variance 1/16
    visible = (columns * np.sqrt(16 * np.array([4.0, 2.0, 1.0, 1.0]))) @ directions.T + 5.0
    structure = principal(visible[None])
    np.testing.assert_allclose(structure.variances[0, :4], [4.0, 2.0, 1.0, 1.0], rtol=1e-9)
    assert effective_rank(structure.variances)[0] == pytest.approx(2 ** 1.75, rel=1e-9)


def test_the_analysis_streams_frames_and_writes_figures_and_summary(tmp_path):
    grid = PatchGrid(3, 4)
    analysis = OrbitalAnalysis(SETTINGS, grid, 14, families=("masked",))
    rng = np.random.default_rng(10)
    for _ in range(3):
        family, _ = synthetic_family(rng, anchors=grid.n, dim=16)
        views = np.concatenate([family.canonical[:, None], family.visible, family.hidden], axis=1).transpose(1, 0, 2)
        analysis.add_frame({"masked": views})
    with pytest.raises(ValueError, match="expected"):
        analysis.add_frame({"masked": views[:5]})
    summary = analysis.write(tmp_path / "out", {"inputs": ["synthetic"]})
    on_disk = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert on_disk == summary and summary["frames"] == 3 and summary["inputs"] == ["synthetic"]
    result = summary["families"]["masked"]
    assert result["anchors"] == 36 and result["coverage"]["manifold"] > 0.95
    assert result["wins"]["manifold_over_observed"] == 1.0
    assert result["coverage_by_rank"][2] == pytest.approx(result["coverage"]["manifold"], abs=1e-6)
    assert 1.5 < result["effective_rank"] < 2.5 and result["top4_energy"] > 0.99
    assert len(summary["offsets_px"]["visible"]) == len(summary["offsets_px"]["hidden"]) == 16
    for name in summary["figures"]:
        assert cv2.imread(str(tmp_path / "out" / name)) is not None, name


def test_analyze_orbital_command_on_a_rosbag2_with_the_embedded_dinov2(tmp_path, capsys):
    from sps_driving.core import topics
    from sps_driving.ros import bagio, msgs

    bag = tmp_path / "drive"
    with bagio.BagWriter(bag) as writer:
        for i in range(3):
            writer.write(topics.IMAGE, msgs.image_fields(noise_frame(i), 10**9 + i, "camera"), 10**9 + i)
    config = tmp_path / "extraction.yaml"
    config.write_text(yaml.safe_dump({"input_size": list(INPUT), "backend": "torch"}))
    settings = tmp_path / "analysis.yaml"
    settings.write_text(yaml.safe_dump({"orbital": {"rank": 2, "max_rank": 4, "caps": [1.0, 2.0]}}))
    out = tmp_path / "orbital"
    assert main(["analyze", str(bag), "--orbital", "--out", str(out), "--extractor-config", str(config),
                 "--config", str(settings), "--max-frames", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["frames"] == 2 and summary["grid"] == [4, 6] and summary["settings"]["rank"] == 2
    assert set(summary["families"]) == {"masked", "raw"}
    for result in summary["families"].values():
        assert result["anchors"] == 48 and -1.0 < result["coverage"]["manifold"] <= 1.0
    assert "masked: 48 anchors" in capsys.readouterr().out
    # a feature cache holds no frames to shift
    assert main(["analyze", str(tmp_path), "--orbital", "--out", str(out)]) == 2
    assert "give bags (a rosbag2 folder" in capsys.readouterr().err


# ---------------------------------------------------------------- the appearance shift


def test_appearance_coverage_of_shifts_inside_and_outside_the_manifold():
    rng = np.random.default_rng(11)
    family, basis = synthetic_family(rng, noise=0.0)
    fits = family_errors(family, SETTINGS, rng)["fits"]
    inside = family.canonical + np.einsum("adr,r->ad", basis, [0.5, -0.4])
    outside_direction = rng.standard_normal(family.canonical.shape)
    outside_direction -= np.einsum("adr,ar->ad", basis, np.einsum("adr,ad->ar", basis, outside_direction))
    outside = family.canonical + 0.5 * outside_direction / np.linalg.norm(outside_direction, axis=1, keepdims=True)
    for shifted, low, high in ((inside, 0.97, 1.0), (outside, -0.05, 0.05)):
        errors = appearance_errors(family, fits, shifted)
        assert low <= coverage(errors["manifold"], errors["center"]) <= high
    errors = appearance_errors(family, fits, family.canonical + 3 * (family.hidden[:, 0] - family.canonical))
    np.testing.assert_allclose(errors["center"], 9 * ((family.hidden[:, 0] - family.canonical) ** 2).sum(axis=1))
    assert errors["orbit"].shape == (40,) and np.all(errors["orbit"] > 0)


def test_an_episode_may_render_with_another_scenarios_scenery_draws():
    from dataclasses import replace

    from sps_driving.sim.config import load_sim_config, set_render_width
    from sps_driving.sim.render import get_renderer
    from sps_driving.sim.scenarios import get_scenario
    from sps_driving.sim.world import World, make_episode

    config = load_sim_config()
    set_render_width(config, 96)
    episode = make_episode(config, get_scenario("rural-summer-dry-day-car"), 3)
    renderer = get_renderer(config)
    own = renderer.render(World(config, episode))
    assert np.array_equal(renderer.render(World(config, replace(episode, scenery=episode.scenario.name))), own)
    assert not np.array_equal(renderer.render(World(config, replace(episode, scenery="rural-fall-dry-day-car"))), own)


def test_analyze_orbital_appearance_renders_and_reports(tmp_path, capsys):
    sim = yaml.safe_load(config_path("sim.yaml").read_text())
    sim["camera"].update(render_width=96, render_height=60)
    (tmp_path / "sim.yaml").write_text(yaml.safe_dump(sim))
    (tmp_path / "extraction.yaml").write_text(yaml.safe_dump({"input_size": list(INPUT), "backend": "torch"}))
    (tmp_path / "analysis.yaml").write_text(yaml.safe_dump({"orbital": {"rank": 2, "appearance": {"steps": [0, 3]}}}))
    out = tmp_path / "appearance"
    assert main(["analyze", "--orbital", "--appearance", "rural-summer-dry-night-car", "--episodes", "1", "--out", str(out),
                 "--sim-config", str(tmp_path / "sim.yaml"), "--extractor-config", str(tmp_path / "extraction.yaml"),
                 "--config", str(tmp_path / "analysis.yaml")]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layouts"] == [0] and summary["steps"] == [0, 3]
    assert set(summary["shifts"]) == {"rural-summer-dry-night-car (own)", "rural-summer-dry-night-car (same)"}
    night = summary["shifts"]["rural-summer-dry-night-car (same)"]["masked"]
    assert night["anchors"] == 48 and night["shift_over_orbit"] > 0
    assert summary["base_orbit"]["masked"]["anchors"] == 48
    assert (out / "appearance_coverage.png").is_file()
    assert "rural-summer-dry-night-car (same): masked Manifold covers" in capsys.readouterr().out
    assert main(["analyze", "--appearance", "--out", str(out)]) == 2, "--appearance needs --orbital"


# ---------------------------------------------------------------- caches and augmentation


ROWS, COLS, D, V = 3, 4, 8, 16


def orbital_cache(directory, every=2, sources=("a", "b", "c", "d"), frames=12, seed=0, orbital=True):
    """Frames whose steering follows their descriptors; every `every`-th frame's visible states are
    its descriptors plus a rank-2 orbit per patch (known directions, kept in the returned dict)."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=D)
    meta = {"backbone": "test-random", "grid": {"rows": ROWS, "cols": COLS}, "descriptor_dim": D}
    if orbital:
        meta["orbital"] = {"offsets_px": orbital_offsets(14)[0].tolist(), "family": "masked", "every": every}
    written = {}
    with FeatureCacheWriter(directory, meta, shard_size=10) as writer:
        for s, source in enumerate(sources):
            for i in range(frames):
                descriptors = rng.normal(size=(ROWS * COLS, D))
                states = None
                if orbital and writer.frames % every == 0:
                    basis = np.linalg.qr(rng.normal(size=(ROWS * COLS, D, 2)))[0]
                    z = rng.normal(size=(V, 2))
                    states = descriptors[None] + np.einsum("ndr,vr->vnd", basis, z)
                    written[writer.frames] = states
                steering = 0.3 * np.tanh(descriptors.mean(0) @ weights)
                writer.add(descriptors, steering, 0.1, 10**18 + (s * 1000 + i) * 33_333_333, source, orbital=states)
    return directory, written


def test_a_cache_stores_orbital_states_for_some_frames(tmp_path):
    directory, written = orbital_cache(tmp_path / "cache", every=3)
    cache = FeatureCache(directory)
    assert cache.orbital_frames.tolist() == sorted(written) == list(range(0, 48, 3))
    assert cache.orbital_meta["frames"] == 16 and cache.orbital_meta["family"] == "masked"
    assert cache.has_orbital([0, 1, 3]).tolist() == [True, False, True]
    np.testing.assert_allclose(cache.orbital_states([3, 45]), np.stack([written[3], written[45]]), atol=1e-2)  # float16
    with pytest.raises(KeyError, match="no orbital states"):
        cache.orbital_states([1])
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["orbital"]["offsets_px"] == orbital_offsets(14)[0].tolist()
    plain = FeatureCacheWriter(tmp_path / "plain", {"backbone": "x", "grid": {"rows": 1, "cols": 2}, "descriptor_dim": 3})
    with pytest.raises(ValueError, match="without orbital states"):
        plain.add(np.zeros((2, 3)), 0.0, 0.0, 0, "s", orbital=np.zeros((16, 2, 3)))
    with pytest.raises(ValueError, match="orbital states must be"):
        FeatureCacheWriter(tmp_path / "c2", {**meta, "grid": {"rows": 1, "cols": 2}, "descriptor_dim": 3}).add(
            np.zeros((2, 3)), 0.0, 0.0, 0, "s", orbital=np.zeros((15, 2, 3)))
    # several caches read as one keep each frame's states
    other, written_other = orbital_cache(tmp_path / "other", every=5, sources=("e",), seed=1)
    both = FeatureCache([directory, other])
    assert both.orbital_frames.tolist() == list(range(0, 48, 3)) + [48 + k for k in sorted(written_other)]
    np.testing.assert_allclose(both.orbital_states([48 + 5])[0], written_other[5], atol=1e-2)


def test_extract_stores_the_visible_states_of_every_kth_frame(tmp_path):
    from sps_driving.train.extract import extract

    folder = frame_folder(tmp_path / "frames", [0.01] * 5)
    extractor = tiny_dinov2()
    extract([folder], tmp_path / "cache", extractor, {"backbone": extractor.name}, orbital_every=2)
    cache = FeatureCache(tmp_path / "cache")
    assert cache.orbital_frames.tolist() == [0, 2, 4] and cache.orbital_meta["every"] == 2
    expected = OrbitalReader(extractor, orbital_offsets(14)[0], ("masked",)).read(noise_frame(2))["masked"]
    np.testing.assert_allclose(cache.orbital_states([2])[0], expected.astype(np.float16), atol=1e-6)
    from sps_driving.core.backbones.pixels import PixelExtractor

    with pytest.raises(ValueError, match="DINOv2"):
        extract([folder], tmp_path / "pixels", PixelExtractor(INPUT), resolve_config({"backbone": "pixels"}), orbital_every=2)


def test_each_unit_of_an_extraction_carries_its_own_orbital_states_and_resumes(tmp_path, monkeypatch):
    """Units of 3 camera frames (shard_size 3) and K = 2: rows 0 and 2 of each unit's shard. A run
    cut short after its first unit resumes to the cache an uninterrupted run writes; a rerun with
    another K is not resumed into it."""
    import sps_driving.train.extract as extract_module
    from sps_driving.train.extract import ExtractSettings, extract

    folder = frame_folder(tmp_path / "frames", [0.01 * i for i in range(7)])
    extractor, settings = tiny_dinov2(), ExtractSettings(shard_size=3)
    record = {"backbone": extractor.name}
    extract([folder], tmp_path / "whole", extractor, record, settings, orbital_every=2)
    whole = FeatureCache(tmp_path / "whole")
    assert [s["frames"] for s in whole.meta["shards"]] == [3, 3, 1]
    assert whole.orbital_frames.tolist() == [0, 2, 3, 5, 6] and whole.orbital_meta["frames"] == 5
    for frame in (0, 5):
        expected = OrbitalReader(extractor, orbital_offsets(14)[0], ("masked",)).read(noise_frame(frame))["masked"]
        np.testing.assert_allclose(whole.orbital_states([frame])[0], expected.astype(np.float16), atol=1e-6)

    add_frame, calls = extract_module._add_frame, []

    def cut_short(*args):
        calls.append(1)
        if len(calls) == 4:  # the second unit's first frame
            raise KeyboardInterrupt
        return add_frame(*args)

    monkeypatch.setattr(extract_module, "_add_frame", cut_short)
    with pytest.raises(KeyboardInterrupt):
        extract([folder], tmp_path / "cache", extractor, record, settings, orbital_every=2)
    monkeypatch.setattr(extract_module, "_add_frame", add_frame)
    assert not (tmp_path / "cache" / "meta.json").exists()
    with pytest.raises(ValueError, match="unfinished feature cache of other settings"):
        extract([folder], tmp_path / "cache", extractor, record, settings, orbital_every=3)
    extract([folder], tmp_path / "cache", extractor, record, settings, orbital_every=2)
    resumed = FeatureCache(tmp_path / "cache")
    assert resumed.orbital_frames.tolist() == whole.orbital_frames.tolist() and resumed.orbital_meta == whole.orbital_meta
    np.testing.assert_array_equal(resumed.orbital_states(resumed.orbital_frames), whole.orbital_states(whole.orbital_frames))
    np.testing.assert_array_equal(resumed.descriptors(range(7)), whole.descriptors(range(7)))


def test_augmented_states_lie_in_the_fitted_span_within_the_cap(tmp_path):
    directory, written = orbital_cache(tmp_path / "cache", every=2)
    cache = FeatureCache(directory)
    frames = np.arange(len(cache))
    augmenter = OrbitalAugmenter(cache, frames, fraction=0.5, rank=2, cap=1.5)
    grids = torch.from_numpy(cache.descriptors(frames))
    generator = torch.Generator().manual_seed(0)
    out = augmenter(grids, torch.from_numpy(frames), generator)
    changed = (out != grids).any(dim=2).numpy()
    assert not changed[1::2].any(), "frames without orbital states are untouched"
    assert 0.3 < changed[0::2].mean() < 0.7, "about half of the patches of frames with states"
    for frame, patch in zip(*np.nonzero(changed)):
        manifold = fit_manifold(cache.orbital_states([frame])[0][:, patch][None], 2, 1.5)
        deviation = out[frame, patch].double().numpy() - manifold.mean[0]
        z = manifold.basis[0].T @ deviation
        assert np.linalg.norm(deviation - manifold.basis[0] @ z) < 1e-4 * max(1.0, np.linalg.norm(deviation)), "in the span"
        assert np.all(np.abs(z) <= 1.5 * manifold.spread[0] + 1e-4), "within the cap"
    # patches draw their own coefficients: no two resampled patches moved alike
    moved = (out - grids)[torch.from_numpy(changed)]
    cosines = torch.nn.functional.normalize(moved, dim=1) @ torch.nn.functional.normalize(moved, dim=1).T
    assert (cosines - torch.eye(len(moved))).abs().max() < 0.999
    # resample draws within the cap even for extreme normal draws
    manifold = fit_manifold(cache.orbital_states([0])[0].transpose(1, 0, 2), 2, 1.5)
    z = manifold.coefficients(resample(manifold, np.full((ROWS * COLS, 2), 50.0))[:, None])[:, 0]
    np.testing.assert_allclose(z, 1.5 * manifold.spread, rtol=1e-6)


def train_config(cache, out, **kwargs):
    settings = dict(architecture="mlp", width=16, reduce=2, dropout=0.0, batch_size=8, epochs=2, state_inputs=[], seed=0)
    return TrainConfig.from_yaml(cache=str(cache), out=str(out), **{**settings, **kwargs})


def test_validation_loss_is_bit_identical_with_augmentation_on(tmp_path):
    directory, _ = orbital_cache(tmp_path / "cache")
    # lr 0 keeps the weights: any difference in validation would come from the augmentation reaching it
    plain = train(train_config(directory, tmp_path / "plain", lr=0.0))
    augmented = train(train_config(directory, tmp_path / "augmented", lr=0.0, orbital_fraction=1.0))
    assert [h["validation_loss"] for h in augmented["history"]] == [h["validation_loss"] for h in plain["history"]]
    assert [h["train_loss"] for h in augmented["history"]] != [h["train_loss"] for h in plain["history"]], "it acted"
    record = json.loads((tmp_path / "augmented" / "config.json").read_text())["training"]["orbital_augmentation"]
    assert record["fraction"] == 1.0 and record["rank"] == 4 and record["training_frames_with_states"] == 18


def test_a_cache_without_orbital_states_gives_a_clear_error(tmp_path, capsys):
    directory, _ = orbital_cache(tmp_path / "cache", orbital=False)
    with pytest.raises(ValueError, match="holds no orbital states.*--orbital-every"):
        train(train_config(directory, tmp_path / "m", orbital_fraction=0.2))
    assert main(["train", "--cache", str(directory), "--out", str(tmp_path / "m2"), "--orbital-fraction", "0.2",
                 "--state-inputs"]) == 2
    assert "holds no orbital states" in capsys.readouterr().err
