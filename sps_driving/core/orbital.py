"""Patch state families (PMTT, "A Patch is More Than a Token"): dense orbital views of every
patch and the bounded analytic Manifold fitted to them.

A patch's canonical state is its token in the frame as the backbone sees it. Its orbital states
are its tokens, read at its own grid slot, when the backbone's input is shifted by a few whole
pixels: the image point at the patch's centre moves by the offset and, the offset being less than
half a patch, stays inside the same patch, so the patch keeps its index and its identity.

Offsets (`orbital_offsets`, (dy, dx) px of the backbone input, down and right positive) come in
two disjoint sets of 16: visible (what a Manifold is fitted to) and hidden (what it must
predict). For a P px patch, R = ceil(P / 2) - 1 is the largest shift that keeps the centre
strictly inside its patch and r = round(R / 2):

- visible: the 8 compass directions at Chebyshev radii r and R (P = 14: r = 3, R = 6 px);
- hidden: the 8 directions halfway between them (22.5 degrees off) at Euclidean radii r - 1/2
  and R - 1/2, rounded to whole px (P = 14: the knight moves (1, 2) and (2, 5)).

So every hidden view lies between visible ones in angle and within their radii: predicting it is
interpolation over the orbit, never extrapolation beyond it.

Manifold (`fit_manifold`): per patch, the mean m of its visible states, the top-r principal
directions B (orthonormal [D, r]) of their deviations, and the spread s_k (standard deviation,
over the visible states, of their coefficients on direction k). A state's Manifold prediction
is m + B clip(B^T (x - m), -c s, c s): the affine span, bounded at `cap` c times the visible
spread. It is analytic (an SVD per patch, nothing trained) and reads visible states only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ORBIT_DIRECTIONS = 8  # compass directions per ring; two rings per set -> 16 visible, 16 hidden
FAMILIES = ("masked", "raw")  # masked descriptors (SPS eqs. 1-2) | the ViT's own final tokens


def orbital_offsets(patch_px: int) -> tuple[np.ndarray, np.ndarray]:
    """(visible, hidden): int64 [16, 2] (dy, dx) px shifts of the backbone input for square patches
    of `patch_px` px (the module docstring's rule); ValueError for a patch too small for them."""
    outer = math.ceil(patch_px / 2) - 1
    inner = round(outer / 2)
    if inner < 1 or outer <= inner:
        raise ValueError(f"{patch_px} px patches are too small for orbital views")
    compass = np.array([(-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 1), (1, -1), (1, 0), (1, 1)], dtype=np.int64)
    visible = np.concatenate([inner * compass, outer * compass])
    angles = np.radians(22.5 + 45.0 * np.arange(ORBIT_DIRECTIONS))
    between = np.stack([np.sin(angles), np.cos(angles)], axis=1)
    hidden = np.concatenate([np.round(radius * between) for radius in (inner - 0.5, outer - 0.5)]).astype(np.int64)
    views = np.concatenate([visible, hidden])
    if len({tuple(v) for v in views}) != len(views) or not np.abs(views).max(axis=1).all():
        raise ValueError(f"{patch_px} px patches are too small for 32 distinct orbital views")
    return visible, hidden


def anchor_patches(grid_shape: tuple[int, int], patch_px: int, offset) -> np.ndarray:
    """int64 [N]: the patch (row-major index) that holds each patch's centre point after the
    backbone input is shifted by `offset` (dy, dx) px; the identity when the offset keeps every
    anchor in its own patch."""
    rows, cols = grid_shape
    r, c = np.divmod(np.arange(rows * cols), cols)
    # Pixel-edge coordinates: patch (r, c) covers [P c, P (c + 1)), its centre is at P c + P / 2.
    y = np.floor((patch_px * r + patch_px / 2 + offset[0]) / patch_px).astype(np.int64)
    x = np.floor((patch_px * c + patch_px / 2 + offset[1]) / patch_px).astype(np.int64)
    inside = (y >= 0) & (y < rows) & (x >= 0) & (x < cols)
    return np.where(inside, y * cols + x, -1)


def shift_pixels(pixels, dy: int, dx: int):
    """The backbone input [..., H, W] (numpy or torch) with its content moved by (dy, dx) whole px,
    down and right positive: out[..., y, x] = pixels[..., y - dy, x - dx]; the rows and columns
    the shift exposes repeat the nearest edge (no invented content, no interpolation)."""
    height, width = pixels.shape[-2:]
    rows = np.clip(np.arange(height) - int(dy), 0, height - 1)
    cols = np.clip(np.arange(width) - int(dx), 0, width - 1)
    if not isinstance(pixels, np.ndarray):  # a torch tensor: index with tensors on its device
        import torch

        rows, cols = (torch.from_numpy(v).to(pixels.device) for v in (rows, cols))
    return pixels[..., rows, :][..., cols]


class OrbitalReader:
    """Every patch's states under a list of input shifts, from a torch DINOv2 extractor
    (sps_driving.core.backbones.dinov2.DinoV2Extractor): the frame is preprocessed once, each
    view shifts the backbone input and is encoded, and patch j's state is read at slot j.

    families: "masked" (the extractor's masked descriptors; not for falloff none) and/or "raw"
    (the ViT's own final tokens). views_per_pass views share one batched pass up to the masked
    layer; the unshifted view gets a pass of its own, exactly encode()'s, so its states are the
    extractor's own descriptors bit for bit.
    """

    def __init__(self, extractor, offsets, families=FAMILIES, views_per_pass: int = 8):
        if not hasattr(extractor, "encode_pixels"):
            raise ValueError(
                f"orbital states shift the backbone's input by whole pixels, which the torch DINOv2 extractor "
                f"does; got {getattr(extractor, 'name', type(extractor).__name__)} ({type(extractor).__name__})")
        self.extractor = extractor
        self.offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        self.families = tuple(families)
        unknown = set(self.families) - set(FAMILIES)
        if unknown or not self.families:
            raise ValueError(f"state families must be some of {FAMILIES}, got {list(families)}")
        if "masked" in self.families and extractor.unmasked:
            raise ValueError("falloff none has no masked descriptors: read the raw family only")
        self.patch_px = extractor.input_size[0] // extractor.grid.rows
        grid_shape = (extractor.grid.rows, extractor.grid.cols)
        for offset in self.offsets:
            if not np.array_equal(anchor_patches(grid_shape, self.patch_px, offset), np.arange(extractor.grid.n)):
                raise ValueError(f"offset {tuple(offset)} px moves patch centres out of their "
                                 f"{self.patch_px} px patches: orbital offsets stay below half a patch")
        self.views_per_pass = max(1, int(views_per_pass))

    def _passes(self) -> list[np.ndarray]:
        """The offsets in order, in chunks of views_per_pass, the unshifted view alone."""
        passes, chunk = [], []
        for offset in self.offsets:
            if not offset.any():
                passes += [np.array(chunk, np.int64).reshape(-1, 2), offset[None]]
                chunk = []
                continue
            chunk.append(offset)
            if len(chunk) == self.views_per_pass:
                passes.append(np.array(chunk))
                chunk = []
        return [p for p in [*passes, np.array(chunk, np.int64).reshape(-1, 2)] if len(p)]

    def read(self, image_rgb: np.ndarray) -> dict[str, np.ndarray]:
        """{family: float32 [views, N, D]}: row v holds every patch's state under offsets[v]."""
        import torch

        from sps_driving.core.backbones.dinov2 import DinoV2State

        extractor = self.extractor
        pixels = extractor.preprocess(image_rgb)
        every_patch = np.arange(extractor.grid.n, dtype=np.int64)
        out = {family: [] for family in self.families}
        for chunk in self._passes():
            state = extractor.encode_pixels(torch.cat([shift_pixels(pixels, dy, dx) for dy, dx in chunk]))
            if "masked" in out:
                out["masked"] += [extractor.descriptors(DinoV2State(state.hidden[v:v + 1]), every_patch)
                                  for v in range(len(chunk))]
            if "raw" in out:
                out["raw"] += list(extractor.raw_tokens(state))
        return {family: np.stack(states).astype(np.float32) for family, states in out.items()}


def visible_reader(extractor, config: dict | None) -> OrbitalReader:
    """An OrbitalReader of the visible views, in the family of the extractor's own descriptors
    (what a feature cache stores): on `extractor` when it runs on torch, else on a torch twin
    loaded from its resolved extraction `config` (an exported runtime computes the same
    descriptors, but takes frames, not shifted inputs)."""
    if not hasattr(extractor, "encode_pixels"):
        from sps_driving.core.backbones.loader import load_extractor

        if not config or config.get("backbone") != "dinov2_vits14":
            raise ValueError(f"orbital states need the DINOv2 backbone, not {getattr(extractor, 'name', extractor)}")
        extractor = load_extractor({**config, "backend": "torch", "precision": "fp32"})
    visible, _ = orbital_offsets(extractor.input_size[0] // extractor.grid.rows)
    return OrbitalReader(extractor, visible, ("raw",) if extractor.unmasked else ("masked",))


# ---- the Manifold --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Principal:
    """Per anchor, the principal structure of its visible states [A, V, D]: mean [A, D],
    directions [A, K, D] (orthonormal rows, strongest first, K = min(V, D)) and the variance of
    the visible states along each [A, K] (the eigenvalues of their covariance, 1/V normalized)."""

    mean: np.ndarray
    directions: np.ndarray
    variances: np.ndarray


def principal(visible: np.ndarray) -> Principal:
    """The principal structure of visible states [A, V, D] (float64). With V <= D it comes from
    each anchor's V x V Gram matrix (its eigenvectors give the directions as X^T u / sqrt(eig)),
    many times faster than an SVD of every [V, D] matrix; directions of a zero variance are 0."""
    visible = np.asarray(visible, dtype=np.float64)
    if visible.ndim != 3 or visible.shape[1] < 2:
        raise ValueError(f"visible states must be [anchors, views >= 2, D], got {visible.shape}")
    mean = visible.mean(axis=1)
    centred = visible - mean[:, None]
    if centred.shape[1] > centred.shape[2]:
        _, singular, directions = np.linalg.svd(centred, full_matrices=False)
        return Principal(mean, directions, singular**2 / visible.shape[1])
    eigenvalues, vectors = np.linalg.eigh(centred @ centred.transpose(0, 2, 1))
    eigenvalues, vectors = eigenvalues[:, ::-1], vectors[:, :, ::-1]  # strongest first
    # Below this the Gram matrix's rounding decides the direction: treated as no variance.
    kept = eigenvalues > eigenvalues[:, :1] * 1e-12
    scale = np.where(kept, 1.0 / np.sqrt(np.where(kept, eigenvalues, 1.0)), 0.0)
    directions = np.einsum("avk,avd->akd", vectors, centred) * scale[..., None]
    return Principal(mean, directions, np.where(kept, eigenvalues, 0.0) / visible.shape[1])


@dataclass(frozen=True)
class Manifold:
    """Per anchor: mean [A, D], basis [A, D, r] (orthonormal columns), spread [A, r] (standard
    deviation of the visible states' coefficients on each column) and the cap (multiple of the
    spread a coefficient may reach)."""

    mean: np.ndarray
    basis: np.ndarray
    spread: np.ndarray
    cap: float

    @property
    def rank(self) -> int:
        return self.basis.shape[-1]

    def coefficients(self, states: np.ndarray) -> np.ndarray:
        """[A, K, r]: the coordinates of states [A, K, D] on the basis, around the mean."""
        return np.einsum("akd,adr->akr", np.asarray(states, dtype=np.float64) - self.mean[:, None], self.basis)

    def bound(self, coefficients: np.ndarray) -> np.ndarray:
        """Coefficients [A, K, r] clipped to +-cap x spread."""
        limit = cap_limit(self.cap, self.spread)[:, None]
        return np.clip(coefficients, -limit, limit)

    def point(self, coefficients: np.ndarray) -> np.ndarray:
        """[A, K, D]: the states mean + basis @ coefficients (no bound applied)."""
        return self.mean[:, None] + np.einsum("adr,akr->akd", self.basis, coefficients)

    def predict(self, states: np.ndarray) -> np.ndarray:
        """[A, K, D]: each state's nearest point of the bounded Manifold along its basis (the
        bounded projection; PMTT's Manifold prediction of a state)."""
        return self.point(self.bound(self.coefficients(states)))


def cap_limit(cap: float, spread: np.ndarray) -> np.ndarray:
    """cap x spread, 0 where the spread is 0 (also for an unbounded cap: no variance, no room)."""
    spread = np.asarray(spread, dtype=np.float64)
    return np.multiply(cap, spread, out=np.zeros_like(spread), where=spread > 0)


def manifold_on(visible: np.ndarray, basis: np.ndarray, cap: float) -> Manifold:
    """The bounded Manifold of visible states [A, V, D] along a given basis [A, D, r] (orthonormal
    columns): their own mean, and the spread of their own coefficients on it. The controls'
    geometry (random, donor, shared) goes through here, so only the directions differ."""
    if not (cap > 0):
        raise ValueError(f"the Manifold cap must be positive (a multiple of the visible spread), got {cap}")
    visible = np.asarray(visible, dtype=np.float64)
    mean = visible.mean(axis=1)
    spread = np.einsum("avd,adr->avr", visible - mean[:, None], basis).std(axis=1)
    return Manifold(mean, basis, spread, float(cap))


def fit_manifold(visible: np.ndarray, rank: int, cap: float, structure: Principal | None = None) -> Manifold:
    """The bounded Manifold of visible states [A, V, D]: mean, top-`rank` principal directions,
    coefficients capped at `cap` times their visible spread (`structure`: principal(visible),
    when already computed)."""
    structure = structure or principal(visible)
    if not 1 <= rank <= structure.directions.shape[1]:
        raise ValueError(f"the Manifold rank must be in [1, {structure.directions.shape[1]}], got {rank}")
    if not (cap > 0):
        raise ValueError(f"the Manifold cap must be positive (a multiple of the visible spread), got {cap}")
    return Manifold(structure.mean, structure.directions[:, :rank].transpose(0, 2, 1),
                    np.sqrt(structure.variances[:, :rank]), float(cap))


def effective_rank(variances: np.ndarray) -> np.ndarray:
    """exp of the Shannon entropy (nats) of the normalized spectrum (Roy and Vetterli's effective
    rank) over the last axis: k equal variances give exactly k; NaN where all are 0."""
    variances = np.clip(np.asarray(variances, dtype=np.float64), 0.0, None)
    total = variances.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = variances / total
        entropy = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(axis=-1)
    return np.where(total[..., 0] > 0, np.exp(entropy), np.nan)


def top_energy(variances: np.ndarray, k: int = 4) -> np.ndarray:
    """The fraction of the total variance in the k largest (over the last axis, sorted descending)."""
    variances = np.clip(np.asarray(variances, dtype=np.float64), 0.0, None)
    total = variances.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, variances[..., :k].sum(axis=-1) / total, np.nan)


def resample(manifold: Manifold, draws: np.ndarray) -> np.ndarray:
    """[A, D] one state per anchor drawn from its bounded Manifold: coefficients spread x draws
    ([A, r], standard normal draws), clipped at the cap."""
    coefficients = manifold.bound((manifold.spread * draws)[:, None])
    return manifold.point(coefficients)[:, 0]
