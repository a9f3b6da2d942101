"""`sps-driving finetune --checkpoint models/X --cache CACHE --out models/Y`: a short fine-tune of
a trained policy with language-guided latent augmentation (SPS section 4.4).

The concept table and the fine-tune length are in config/concepts.yaml. Text is embedded once by
the text tower of the backbone the cache was extracted with (the cache records its extractor
config; --model-path points it at local weights), so concepts and patches share one space.
Training goes through the trainer with the checkpoint's own selection settings (variant, rate,
seed), the augmentation applied to every training batch. A vision-only backbone is refused.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm import tqdm

from sps_driving.core.text_augment import ConceptTable, LatentTextAugmenter, NoTextTowerError, build_text_augmenter

CONCEPTS_NAME = "concepts.yaml"
# Backbones (the `backbone` key of an extractor config) with a text tower in the descriptor space.
TEXT_BACKBONES = ("blip2",)


@dataclass(frozen=True)
class FinetuneSettings:
    """The `finetune:` section of config/concepts.yaml (units there)."""

    epochs: int = 5
    lr: float = 1e-4
    early_stop_patience: int = 5

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.early_stop_patience < 1 or not self.lr > 0:
            raise ValueError(f"finetune needs epochs >= 1, early_stop_patience >= 1 and lr > 0, got {self}")

    @classmethod
    def from_yaml(cls, path: str | Path) -> FinetuneSettings:
        section = (yaml.safe_load(Path(path).read_text()) or {}).get("finetune") or {}
        unknown = set(section) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown finetune settings in {path}: {sorted(unknown)}")
        return cls(**section)


def recorded_backbone(extractor_config: dict | None, name: str | None) -> str:
    """The loader's `backbone` key of a recorded extractor config; a config without one (the
    default extractor, recorded by name only) is identified by the recorded backbone name."""
    return str((extractor_config or {}).get("backbone") or name)


def refuse_vision_only(cache, policy_config: dict) -> str | None:
    """A message when the cache's or the checkpoint's backbone has no text tower, else None."""
    for what, backbone in (
        (f"feature cache {cache.directory}", recorded_backbone(cache.meta.get("extractor"), cache.backbone)),
        ("checkpoint", recorded_backbone(policy_config.get("extractor"), policy_config.get("backbone"))),
    ):
        if backbone not in TEXT_BACKBONES:
            return (
                f"the {what} uses backbone {backbone!r}, which has no text tower: language-guided augmentation "
                f"replaces patches by text embeddings in the descriptor space, which needs a vision-language "
                f"backbone ({', '.join(TEXT_BACKBONES)}). Extract a cache with `sps-driving extract --backbone blip2 "
                f"--model-path models/<blip2 folder>` and train a policy on it first."
            )
    return None


def match_report(augmenter: LatentTextAugmenter, cache, batch_size: int) -> dict[str, dict[str, float]]:
    """Per source concept: patches matched at the threshold per frame, and frames with any match."""
    concepts = list(augmenter.table.concepts)
    patches = np.zeros(len(concepts))
    frames = np.zeros(len(concepts))
    for start in tqdm(range(0, len(cache), batch_size), desc="match concepts", unit="batch"):
        indices = range(start, min(start + batch_size, len(cache)))
        best, source = augmenter.match(torch.from_numpy(cache.descriptors(indices)))
        matched = best >= augmenter.table.threshold
        for k in range(len(concepts)):
            hits = matched & (source == k)
            patches[k] += float(hits.sum())
            frames[k] += float(hits.any(dim=1).sum())
    total = max(len(cache), 1)
    return {c: {"patches_per_frame": patches[k] / total, "frame_fraction": frames[k] / total} for k, c in enumerate(concepts)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, type=Path, help="trained policy directory to start from")
    parser.add_argument("--cache", required=True, type=Path, help="feature cache of a vision-language backbone (BLIP-2)")
    parser.add_argument("--out", required=True, type=Path, help="directory for the fine-tuned policy")
    parser.add_argument("--concepts", type=Path, default=None, help=f"concept table (default: the shipped {CONCEPTS_NAME})")
    parser.add_argument("--train-config", type=Path, default=None, help="YAML with a `train:` section (default: the shipped one)")
    parser.add_argument("--model-path", help="local folder of the backbone's weights (overrides the cache's record)")
    parser.add_argument("--device", help="auto, cpu, cuda (training and text embedding)")
    parser.add_argument("--epochs", type=int, help="fine-tune epochs (overrides the concept table's finetune section)")
    parser.add_argument("--report-matches", action="store_true",
                        help="only print how many patches each concept matches at the threshold, then stop")


def _print_matches(augmenter: LatentTextAugmenter, cache, table: ConceptTable, cache_path) -> None:
    """How often each concept matches the cache's patches at the table's threshold (`match_report`)."""
    report = match_report(augmenter, cache, batch_size=64)
    print(f"threshold {table.threshold} (cosine) over {len(cache)} frames of {cache_path}:")
    for concept, stats in report.items():
        print(f"  {concept:>16}: {stats['patches_per_frame']:7.2f} patches/frame, "
              f"in {stats['frame_fraction']:6.1%} of frames")


def _finetune_config(args: argparse.Namespace, policy_config: dict, settings: FinetuneSettings):
    """The training settings of the fine-tuning: the train config's, with the policy's own selection
    and the fine-tuning's epochs, learning rate and patience over them."""
    from sps_driving.train.trainer import TRAIN_CONFIG, TrainConfig

    selection = policy_config["selection"]
    return TrainConfig.from_yaml(
        args.train_config or TRAIN_CONFIG,
        cache=str(args.cache),
        out=str(args.out),
        variant=selection["variant"],
        rate=selection["rate"],
        seed=selection["seed"],
        keep_probability=selection.get("keep_probability"),
        epochs=args.epochs or settings.epochs,
        lr=settings.lr,
        early_stop_patience=settings.early_stop_patience,
        device=args.device,
    )


def run(args: argparse.Namespace) -> int:
    from sps_driving.core.policies.checkpoint import read_policy_config
    from sps_driving.core.resources import config_path
    from sps_driving.export.extractors import extractor_for_policy
    from sps_driving.train.cache import FeatureCache
    from sps_driving.train.trainer import train

    concepts_path = args.concepts or config_path(CONCEPTS_NAME)
    try:
        table = ConceptTable.from_yaml(concepts_path)
        settings = FinetuneSettings.from_yaml(concepts_path)
        cache = FeatureCache(args.cache)
        policy_config = read_policy_config(args.checkpoint)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    refusal = refuse_vision_only(cache, policy_config)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2

    try:
        extractor = extractor_for_policy(policy_config, {"model_path": args.model_path, "device": args.device}).extractor
        augmenter = build_text_augmenter(extractor, table)
    except NoTextTowerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as error:
        print(f"error: cannot embed the concepts with the policy's backbone: {error}", file=sys.stderr)
        return 2
    if augmenter.dim != cache.descriptor_dim:
        print(f"error: the text tower gives {augmenter.dim}-d embeddings, the cache holds {cache.descriptor_dim}-d "
              "descriptors: use the extractor config (descriptor head) the cache was made with", file=sys.stderr)
        return 2

    if args.report_matches:
        _print_matches(augmenter, cache, table, args.cache)
        return 0

    summary = train(_finetune_config(args, policy_config, settings), descriptor_transform=augmenter,
                    init_checkpoint=args.checkpoint)
    print(f"fine-tuned {args.checkpoint} with language-guided augmentation ({len(table.concepts)} concepts, "
          f"threshold {table.threshold}) for {summary['epochs_run']} epochs; best validation loss "
          f"{summary['best_validation_loss']:.6f} at epoch {summary['best_epoch']}; checkpoint {args.out}")
    return 0
