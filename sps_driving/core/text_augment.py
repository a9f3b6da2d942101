"""Language-guided latent augmentation (SPS section 4.4), on arrays and text embeddings only.

In a vision-language descriptor space (BLIP-2's), a patch that shows a "tree" lies close to
the text embedding of "a photo of a tree". For a training frame, the patches matching a source
concept above a cosine threshold are replaced by the text embedding of a plausible alternative
("house"), so the policy sees the same scene layout with different content. Every patch of one
source concept in a frame gets the same alternative, so the edited scene stays coherent.

The text embeddings are computed once, by the backbone's text tower
(`text_descriptors(texts) -> [T, D]`, same projection and normalization as image descriptors);
build_text_augmenter() does that from a concept table. Nothing here imports a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

# Norms at or below this count as an empty (dropped, all-zero) patch, which never matches.
_EMPTY_PATCH_NORM = 1e-8


class NoTextTowerError(ValueError):
    """The backbone cannot embed text, so concepts cannot be placed in its descriptor space."""


@dataclass(frozen=True)
class ConceptTable:
    """config/concepts.yaml: source concept -> alternatives, and how augmentation is applied."""

    concepts: dict[str, tuple[str, ...]]
    threshold: float
    frame_probability: float
    max_patches_per_frame: int
    keep_patch_norm: bool = True
    prompt_template: str = "{}"

    def __post_init__(self) -> None:
        if not self.concepts:
            raise ValueError("the concept table lists no concepts")
        for source, alternatives in self.concepts.items():
            if not alternatives or any(not isinstance(a, str) or not a.strip() for a in alternatives):
                raise ValueError(f"concept {source!r} needs at least one non-empty alternative, got {alternatives!r}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold is a cosine similarity in (0, 1], got {self.threshold}")
        if not 0.0 <= self.frame_probability <= 1.0:
            raise ValueError(f"frame_probability must be in [0, 1], got {self.frame_probability}")
        if self.max_patches_per_frame < 0:
            raise ValueError(f"max_patches_per_frame must not be negative, got {self.max_patches_per_frame}")
        if "{}" not in self.prompt_template:
            raise ValueError(f"prompt_template must contain {{}} for the concept, got {self.prompt_template!r}")

    @classmethod
    def from_yaml(cls, path: str | Path) -> ConceptTable:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        raw.pop("finetune", None)  # the fine-tune command's own section
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown settings in {path}: {sorted(unknown)}")
        concepts = raw.pop("concepts", None) or {}
        if not isinstance(concepts, dict):
            raise ValueError(f"'concepts' in {path} must map each source concept to a list of alternatives")
        table = {str(source): tuple(alts) if isinstance(alts, (list, tuple)) else (alts,) for source, alts in concepts.items()}
        return cls(concepts=table, **raw)

    def prompt(self, concept: str) -> str:
        return self.prompt_template.format(concept)

    @property
    def alternatives(self) -> list[str]:
        """Every alternative concept once, in table order."""
        return list(dict.fromkeys(a for alts in self.concepts.values() for a in alts))


class LatentTextAugmenter:
    """descriptor_transform(grids [B, N, D], generator) -> grids with concept patches substituted.

    Per frame: with probability frame_probability the frame is augmented; then each patch whose
    best cosine similarity to a source concept is >= threshold is a candidate, and at most
    max_patches_per_frame candidates (the most similar ones) are replaced by the embedding of
    the alternative drawn for their concept in this frame. Other patches, all-zero (dropped)
    patches included, pass through unchanged; the [B, N, D] layout and dtype are kept.
    """

    def __init__(
        self,
        source_embeddings: np.ndarray | torch.Tensor,
        alternative_embeddings: np.ndarray | torch.Tensor,
        alternatives_of: list[list[int]],
        table: ConceptTable,
    ) -> None:
        sources = torch.as_tensor(source_embeddings, dtype=torch.float32).cpu()
        alternatives = torch.as_tensor(alternative_embeddings, dtype=torch.float32).cpu()
        if sources.ndim != 2 or alternatives.ndim != 2 or sources.shape[1] != alternatives.shape[1]:
            raise ValueError(f"embeddings must be [S, D] and [A, D], got {tuple(sources.shape)}, {tuple(alternatives.shape)}")
        if len(alternatives_of) != sources.shape[0]:
            raise ValueError(f"{len(alternatives_of)} alternative lists for {sources.shape[0]} source concepts")
        if any(not choices or min(choices) < 0 or max(choices) >= alternatives.shape[0] for choices in alternatives_of):
            raise ValueError("every source concept needs alternatives indexing the alternative embeddings")
        if not (torch.isfinite(sources).all() and torch.isfinite(alternatives).all()):
            raise ValueError("text embeddings contain non-finite values")
        if (sources.norm(dim=1) <= _EMPTY_PATCH_NORM).any() or (alternatives.norm(dim=1) <= _EMPTY_PATCH_NORM).any():
            raise ValueError("a text embedding is all zeros")
        self.table = table
        self.dim = sources.shape[1]
        self._source_units = sources / sources.norm(dim=1, keepdim=True)
        self._alternatives = alternatives
        # Padded [S, max alternatives] table of alternative indices, and how many each source has.
        width = max(len(choices) for choices in alternatives_of)
        self._choice_table = torch.tensor([choices + [choices[0]] * (width - len(choices)) for choices in alternatives_of])
        self._choice_counts = torch.tensor([len(choices) for choices in alternatives_of])

    def match(self, grids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Best cosine similarity [B, N] of each patch to any source concept, and which one [B, N]
        (similarity 0 for all-zero patches)."""
        x = self._check(grids).float()
        # Dividing the [B, N, S] products rather than normalizing x saves two passes over the grids;
        # an all-zero patch has zero products, so its similarity is 0.
        norms = x.norm(dim=-1, keepdim=True).clamp_min(_EMPTY_PATCH_NORM)
        similarity = (x @ self._source_units.to(x.device).T) / norms
        return similarity.max(dim=-1)

    def plan(self, grids: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Which patches to replace (bool [B, N]) and by which alternative embedding (long [B, N])."""
        best, source = self.match(grids)
        batch, patches = best.shape
        frame_chosen = _uniform((batch,), generator) < self.table.frame_probability
        candidate = (best >= self.table.threshold) & frame_chosen.to(best.device)[:, None]
        cap = min(self.table.max_patches_per_frame, patches)
        replace = torch.zeros_like(candidate)
        if cap > 0:
            score = torch.where(candidate, best, torch.full_like(best, -torch.inf))
            top_score, top_index = score.topk(cap, dim=-1)
            replace.scatter_(1, top_index, torch.isfinite(top_score))
        # One alternative per (frame, source concept), drawn uniformly among that source's alternatives.
        draws = _uniform((batch, self._choice_counts.shape[0]), generator)
        choice = (draws * self._choice_counts).long().clamp_max(self._choice_counts - 1)
        per_frame = self._choice_table.gather(1, choice.T).T  # [B, S]
        alternative = per_frame.to(source.device).gather(1, source)
        return replace, alternative

    def __call__(self, grids: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        replace, alternative = self.plan(grids, generator)
        if not replace.any():
            return grids
        x = grids.float()
        replacement = self._alternatives.to(x.device)[alternative]
        if self.table.keep_patch_norm:
            replacement = replacement / replacement.norm(dim=-1, keepdim=True) * x.norm(dim=-1, keepdim=True)
        return torch.where(replace[..., None], replacement, x).to(grids.dtype)

    def _check(self, grids: torch.Tensor) -> torch.Tensor:
        if not isinstance(grids, torch.Tensor) or grids.ndim != 3 or grids.shape[-1] != self.dim:
            shape = tuple(grids.shape) if isinstance(grids, torch.Tensor) else type(grids).__name__
            raise ValueError(f"expected descriptor grids [B, N, {self.dim}], got {shape}")
        return grids


def build_text_augmenter(extractor, table: ConceptTable) -> LatentTextAugmenter:
    """Embed the table's concepts with the extractor's text tower and build the augmenter.

    Raises NoTextTowerError for a backbone without one (DINOv2 is vision-only).
    """
    embed = getattr(extractor, "text_descriptors", None)
    if embed is None:
        raise NoTextTowerError(
            f"backbone {getattr(extractor, 'name', type(extractor).__name__)!r} has no text tower, so it cannot "
            "place concepts in its descriptor space; language-guided augmentation needs a vision-language "
            "backbone (BLIP-2) and a feature cache and checkpoint made with it"
        )
    sources = list(table.concepts)
    alternatives = table.alternatives
    embeddings = np.asarray(embed([table.prompt(c) for c in sources + alternatives]), dtype=np.float32)
    expected = (len(sources) + len(alternatives), extractor.dim)
    if embeddings.shape != expected:
        raise ValueError(f"text tower returned {embeddings.shape} embeddings, expected {expected}")
    position = {name: i for i, name in enumerate(alternatives)}
    alternatives_of = [[position[a] for a in table.concepts[s]] for s in sources]
    return LatentTextAugmenter(embeddings[: len(sources)], embeddings[len(sources) :], alternatives_of, table)


def _uniform(shape: tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
    """U(0, 1) draws on the generator's device (CPU when none), so a seeded generator replays them."""
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(shape, generator=generator, device=device).cpu()
