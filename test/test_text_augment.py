"""Language-guided latent augmentation: substitution logic on synthetic embeddings with known cosines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sps_driving.core.resources import config_path
from sps_driving.core.text_augment import ConceptTable, LatentTextAugmenter, NoTextTowerError, build_text_augmenter

DIM = 16
TREE, TRUCK = 0, 1  # source concepts: basis directions e0, e1
HOUSE, HEDGE, BUS = 2, 3, 4  # alternatives: e2, e3, e4 (scaled, to see the norm handling)


def table(**overrides) -> ConceptTable:
    settings = dict(
        concepts={"tree": ("house", "hedge"), "truck": ("bus",)},
        threshold=0.5,
        frame_probability=1.0,
        max_patches_per_frame=64,
        keep_patch_norm=True,
    )
    settings.update(overrides)
    return ConceptTable(**settings)


def augmenter(**overrides) -> LatentTextAugmenter:
    eye = np.eye(DIM, dtype=np.float32)
    return LatentTextAugmenter(eye[[TREE, TRUCK]], 3.0 * eye[[HOUSE, HEDGE, BUS]], [[0, 1], [2]], table(**overrides))


def patch(cosine: float, direction: int, rng, norm: float = 2.0) -> np.ndarray:
    """A descriptor with the given cosine to basis direction `direction`, orthogonal part random in e5..."""
    rest = np.zeros(DIM)
    rest[5:] = rng.standard_normal(DIM - 5)
    rest /= np.linalg.norm(rest)
    unit = np.zeros(DIM)
    unit[direction] = cosine
    return norm * (unit + np.sqrt(1.0 - cosine**2) * rest)


def frame_with_cosines(tree_cosines, truck_cosines, rng, n=24):
    """One [n, D] frame: listed cosines to tree, then to truck, then unrelated patches, last one all-zero."""
    rows = [patch(c, TREE, rng) for c in tree_cosines] + [patch(c, TRUCK, rng) for c in truck_cosines]
    while len(rows) < n - 1:
        rows.append(patch(0.0, TREE, rng))
    rows.append(np.zeros(DIM))
    return np.stack(rows)


def test_exactly_the_patches_above_threshold_are_replaced_and_the_rest_untouched():
    rng = np.random.default_rng(0)
    tree, truck = [0.9, 0.49, 0.51, 0.2], [0.7, 0.3]
    grids = torch.tensor(np.stack([frame_with_cosines(tree, truck, rng) for _ in range(3)]), dtype=torch.float16)
    out = augmenter()(grids, torch.Generator().manual_seed(0))
    assert out.shape == grids.shape and out.dtype == grids.dtype
    changed = (out != grids).any(dim=-1)
    expected = torch.zeros_like(changed)
    expected[:, [0, 2, 4]] = True  # tree 0.9, tree 0.51, truck 0.7
    assert torch.equal(changed, expected)
    # Untouched patches, the all-zero (dropped) one included, are bit-identical.
    assert torch.equal(out[~expected], grids[~expected])
    # A truck patch becomes the bus direction with the patch's own norm; a tree patch becomes house or hedge.
    bus = out[:, 4].float()
    assert torch.allclose(bus[:, BUS], torch.full((3,), 2.0), atol=1e-2)
    assert torch.allclose(bus.norm(dim=-1), grids[:, 4].float().norm(dim=-1), atol=1e-2)
    tree_patch = out[:, 0].float()
    assert torch.all((tree_patch[:, HOUSE] > 1.9) ^ (tree_patch[:, HEDGE] > 1.9))


def test_every_patch_of_a_concept_gets_the_same_alternative_within_a_frame():
    rng = np.random.default_rng(1)
    grids = torch.tensor(np.stack([frame_with_cosines([0.8, 0.9, 0.95], [], rng) for _ in range(200)]), dtype=torch.float32)
    out = augmenter()(grids, torch.Generator().manual_seed(1))
    became_house = out[:, :3, HOUSE] > 1.0
    assert torch.all(became_house == became_house[:, :1])  # coherent within each frame
    assert 0.35 < became_house[:, 0].float().mean() < 0.65  # both alternatives drawn across frames


def test_without_keep_patch_norm_the_text_embedding_is_used_as_is():
    rng = np.random.default_rng(2)
    grids = torch.tensor(frame_with_cosines([], [0.9], rng)[None], dtype=torch.float32)
    out = augmenter(keep_patch_norm=False)(grids)
    expected = torch.zeros(DIM)
    expected[BUS] = 3.0
    assert torch.equal(out[0, 0], expected)


def test_per_frame_cap_keeps_the_most_similar_patches():
    rng = np.random.default_rng(3)
    cosines = [0.55, 0.95, 0.6, 0.9, 0.65, 0.85, 0.7]
    grids = torch.tensor(frame_with_cosines(cosines, [], rng)[None], dtype=torch.float32)
    replace, _ = augmenter(max_patches_per_frame=3).plan(grids)
    assert replace[0].nonzero().flatten().tolist() == [1, 3, 5]
    assert not augmenter(max_patches_per_frame=0).plan(grids)[0].any()


def test_frame_probability_is_honoured_and_replayable():
    rng = np.random.default_rng(4)
    frame = frame_with_cosines([0.9], [], rng)
    grids = torch.tensor(np.repeat(frame[None], 4000, axis=0), dtype=torch.float32)
    never = augmenter(frame_probability=0.0)
    assert torch.equal(never(grids, torch.Generator().manual_seed(0)), grids)
    sometimes = augmenter(frame_probability=0.3)
    replace, _ = sometimes.plan(grids, torch.Generator().manual_seed(5))
    assert abs(replace[:, 0].float().mean().item() - 0.3) < 0.03
    again, _ = sometimes.plan(grids, torch.Generator().manual_seed(5))
    assert torch.equal(replace, again)


def test_bad_input_is_refused():
    aug = augmenter()
    with pytest.raises(ValueError, match="grids"):
        aug(torch.zeros(2, 5, DIM + 1))
    with pytest.raises(ValueError, match="grids"):
        aug(torch.zeros(5, DIM))
    with pytest.raises(ValueError, match="all zeros"):
        LatentTextAugmenter(np.zeros((1, DIM)), np.eye(DIM)[:1], [[0]], table())
    with pytest.raises(ValueError, match="alternatives"):
        LatentTextAugmenter(np.eye(DIM)[:1], np.eye(DIM)[:1], [[1]], table())
    with pytest.raises(ValueError, match="threshold"):
        table(threshold=0.0)
    with pytest.raises(ValueError, match="alternative"):
        table(concepts={"tree": ()})


def test_the_shipped_concept_table_loads(tmp_path):
    shipped = ConceptTable.from_yaml(config_path("concepts.yaml"))
    assert shipped.concepts["tree"][0] == "house" and "bus" in shipped.concepts["truck"]
    assert 0.0 < shipped.threshold <= 1.0 and shipped.max_patches_per_frame > 0
    assert shipped.prompt("tree") == "a photo of a tree"
    bad = tmp_path / "bad.yaml"
    bad.write_text("threshhold: 0.3\nconcepts: {tree: [house]}\n")
    with pytest.raises(ValueError, match="threshhold"):
        ConceptTable.from_yaml(bad)


def test_a_backbone_without_text_tower_is_refused():
    class VisionOnly:
        name = "dinov2_vits14"
        dim = DIM

    with pytest.raises(NoTextTowerError, match="dinov2_vits14.*no text tower"):
        build_text_augmenter(VisionOnly(), table())


# ---------------------------------------------------------------- with a tiny random BLIP-2 (real classes, tiny dims)


@pytest.fixture(scope="module")
def tiny_blip2(tmp_path_factory):
    from transformers import BertTokenizer

    from sps_driving.core.backbones.blip2 import Blip2Extractor, tiny_blip2_config

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "photo", "of", "tree", "house", "hedge", "truck", "bus"]
    vocab = tmp_path_factory.mktemp("tokenizer") / "vocab.txt"
    vocab.write_text("\n".join(words) + "\n")
    return Blip2Extractor.from_hf_config(tiny_blip2_config(), {"dim": 16}, tokenizer=BertTokenizer(str(vocab)))


def test_tiny_blip2_text_embeddings_drive_the_substitution(tiny_blip2):
    concepts = table(concepts={"tree": ("house", "hedge"), "truck": ("bus",)}, threshold=0.6,
                     keep_patch_norm=False, prompt_template="a photo of a {}")
    aug = build_text_augmenter(tiny_blip2, concepts)
    texts = tiny_blip2.text_descriptors(["a photo of a tree", "a photo of a truck", "a photo of a house",
                                         "a photo of a hedge", "a photo of a bus"])
    rng = np.random.default_rng(6)
    image = rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)
    patches = tiny_blip2.descriptors(tiny_blip2.encode(image), np.arange(tiny_blip2.grid.n))
    # Random weights put image and text far apart; blend text into some patches for a range of cosines.
    grids = np.repeat(patches[None], 2, axis=0)
    weights = np.linspace(0.0, 3.0, 8)
    grids[:, :8] += weights[:, None] * texts[0]
    grids[:, 8:12] += np.array([0.5, 1.0, 2.0, 4.0])[:, None] * texts[1]
    grids[1, 12] = 0.0  # a dropped patch
    units = grids / np.maximum(np.linalg.norm(grids, axis=-1, keepdims=True), 1e-12)
    cosines = units @ (texts[:2] / np.linalg.norm(texts[:2], axis=1, keepdims=True)).T
    expected = cosines.max(axis=-1) >= 0.6
    assert 0 < expected[0].sum() < 12  # the threshold splits the blended patches

    grids_t = torch.tensor(grids)
    out = aug(grids_t, torch.Generator().manual_seed(0)).numpy()
    changed = np.any(out != grids, axis=-1)
    np.testing.assert_array_equal(changed, expected)
    np.testing.assert_array_equal(out[~expected], grids[~expected])
    for frame, patch_index in zip(*np.nonzero(expected)):
        replacement = out[frame, patch_index]
        if cosines[frame, patch_index].argmax() == 1:  # truck -> bus
            np.testing.assert_allclose(replacement, texts[4], rtol=1e-5, atol=1e-6)
        else:  # tree -> house or hedge
            assert np.allclose(replacement, texts[2], atol=1e-6) or np.allclose(replacement, texts[3], atol=1e-6)


# ---------------------------------------------------------------- `sps-driving finetune`


def tiny_cache(directory, extractor_config, frames, grid_side, dim, rng, blend=None, backbone="blip2"):
    """A real feature cache; `blend` [D] (a text embedding) is mixed into the first patches of each frame."""
    from sps_driving.train.cache import FeatureCacheWriter

    meta = {"backbone": backbone, "extractor": extractor_config, "grid": {"rows": grid_side, "cols": grid_side},
            "descriptor_dim": dim}
    with FeatureCacheWriter(directory, meta) as writer:
        for i in range(frames):
            descriptors = rng.standard_normal((grid_side**2, dim)).astype(np.float32) * 0.1
            if blend is not None:
                descriptors[:3] += blend
            writer.add(descriptors, 0.05 * np.sin(i), 0.2, i * 33_000_000, f"drive{i % 3}")


def train_base(cache, out):
    from sps_driving.train.trainer import TrainConfig, train

    train(TrainConfig.from_yaml(cache=str(cache), out=str(out), epochs=1, batch_size=4, width=16, depth=1, heads=2, device="cpu",
                                state_inputs=[]))  # its cache has no speeds


def test_finetune_refuses_a_vision_only_backbone(tmp_path, capsys):
    from sps_driving.cli import main

    rng = np.random.default_rng(7)
    # As `sps-driving extract` records the default extractor: by name only.
    tiny_cache(tmp_path / "cache", {"name": "dinov2_vits14"}, 6, 4, 8, rng, backbone="dinov2_vits14")
    train_base(tmp_path / "cache", tmp_path / "base")
    code = main(["finetune", "--checkpoint", str(tmp_path / "base"), "--cache", str(tmp_path / "cache"),
                 "--out", str(tmp_path / "tuned")])
    assert code == 2
    assert "'dinov2_vits14', which has no text tower" in capsys.readouterr().err
    assert not (tmp_path / "tuned").exists()
    # A DINOv2 checkpoint is refused even next to a BLIP-2 cache.
    tiny_cache(tmp_path / "blip2_cache", {"backbone": "blip2", "model_path": "models/blip2"}, 6, 4, 8, rng)
    code = main(["finetune", "--checkpoint", str(tmp_path / "base"), "--cache", str(tmp_path / "blip2_cache"),
                 "--out", str(tmp_path / "tuned")])
    assert code == 2 and "checkpoint uses backbone 'dinov2_vits14'" in capsys.readouterr().err


def test_finetune_with_a_tiny_blip2_saved_locally(tmp_path, tiny_blip2, capsys):
    import json

    from sps_driving.cli import main

    model_dir = tmp_path / "blip2"
    tiny_blip2.model.save_pretrained(str(model_dir))
    tiny_blip2.tokenizer.save_pretrained(str(model_dir))
    extractor_config = {"backbone": "blip2", "model_path": str(model_dir), "dim": 16, "device": "cpu"}
    tree = tiny_blip2.text_descriptors(["a photo of a tree"])[0]
    rng = np.random.default_rng(8)
    tiny_cache(tmp_path / "cache", extractor_config, 9, tiny_blip2.grid.rows, 16, rng, blend=2.0 * tree)
    train_base(tmp_path / "cache", tmp_path / "base")
    concepts = tmp_path / "concepts.yaml"
    concepts.write_text(
        "threshold: 0.8\nframe_probability: 1.0\nmax_patches_per_frame: 8\nkeep_patch_norm: true\n"
        "prompt_template: 'a photo of a {}'\nconcepts: {tree: [house, hedge]}\n"
        "finetune: {epochs: 1, lr: 1.0e-4, early_stop_patience: 1}\n"
    )
    common = ["--checkpoint", str(tmp_path / "base"), "--cache", str(tmp_path / "cache"), "--concepts", str(concepts)]
    assert main(["finetune", *common, "--out", str(tmp_path / "unused"), "--report-matches"]) == 0
    report = capsys.readouterr().out
    assert "tree:    3.00 patches/frame, in 100.0% of frames" in report
    assert main(["finetune", *common, "--out", str(tmp_path / "tuned")]) == 0
    tuned = json.loads((tmp_path / "tuned" / "config.json").read_text())
    assert tuned["training"]["init_checkpoint"] == str((tmp_path / "base").resolve())
    assert tuned["selection"]["variant"] == "sps" and tuned["backbone"] == "blip2"
