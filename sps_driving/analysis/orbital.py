"""`sps-driving analyze --orbital BAG... --out DIR`: patch state families (PMTT) on driving frames.

Every patch of every analysed frame is an anchor. Its family (sps_driving.core.orbital): the
canonical state c (the unshifted frame), 16 visible states V and 16 hidden states H, read at its
own grid slot under sub-patch shifts of the backbone input, for the masked descriptors and for
the ViT's raw final tokens. Each hidden state h is predicted by

- Center: c;
- Observed: the visible state nearest to h (the visible states kept as a set of points; the
  prediction is the set's nearest point, as Manifold's is the bounded space's nearest point);
- Manifold: the bounded projection onto the Manifold fitted to V (mean, top-r directions,
  coefficients capped at `cap` times their visible spread);
- controls, the same bounded projection with other directions (mean and caps from the anchor's
  own visible states): Random (random orthonormal directions), Donor (another patch's Manifold
  directions in the same frame), Shared (one set for all patches of the frame: the top-r
  directions of all patches' visible deviations pooled);
- Full-32: the Manifold fitted to V and H together, a diagnostic ceiling that reads H.

Coverage of a predictor = 1 - sum ||h - prediction||^2 / sum ||h - c||^2, pooled over hidden
states and anchors (PMTT's "reduction in total Hidden squared error relative to the Canonical
State"). The spectrum of V (its covariance's eigenvalues per anchor) gives the effective rank
(exp of the entropy of the normalized spectrum) and the top-4 energy, averaged over anchors.
Frames stream through: per frame only running sums and per-anchor coverages are kept.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import scipy.linalg
import yaml

from sps_driving.core.orbital import (
    FAMILIES,
    Principal,
    cap_limit,
    effective_rank,
    fit_manifold,
    manifold_on,
    orbital_offsets,
    principal,
    top_energy,
)

SUMMARY_FILE = "summary.json"
PREDICTORS = ("observed", "manifold", "random", "donor", "shared", "full")
# PMTT's Table 1 ranges over DINOv3 S/B/L/H+ and two cohorts, for the figures' reference bands (%).
SEED_COVERAGE = {"observed": (55.0, 72.3), "manifold": (70.8, 79.6)}


@dataclass(frozen=True)
class OrbitalSettings:
    """The `orbital:` section of config/analysis.yaml (units and reasons there)."""

    rank: int = 4
    cap: float = 2.0
    max_rank: int = 8
    caps: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 3.0, math.inf)
    energy_top: int = 4
    seed: int = 0
    appearance_base: str = "rural-summer-dry-day-car"
    appearance_targets: tuple[str, ...] = ("rural-summer-dry-night-car",)
    appearance_first_seed: int = 0
    appearance_episodes: int = 4
    appearance_steps: tuple[int, ...] = (30, 90, 150)

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= self.max_rank:
            raise ValueError(f"orbital rank must be in [1, max_rank = {self.max_rank}], got {self.rank}")
        if not (self.cap > 0 and all(c > 0 for c in self.caps)):
            raise ValueError(f"orbital caps must be positive multiples of the visible spread, got {self.cap}, {self.caps}")
        if self.energy_top < 1 or self.appearance_episodes < 1 or not self.appearance_steps:
            raise ValueError("orbital energy_top and appearance episodes must be at least 1, with at least one step")
        if min(self.appearance_steps) < 0:
            raise ValueError(f"appearance steps are control steps from the episode start (>= 0), got {self.appearance_steps}")

    @classmethod
    def from_yaml(cls, path: Path) -> OrbitalSettings:
        raw = (yaml.safe_load(Path(path).read_text()) or {}).get("orbital", {}) or {}
        appearance = raw.pop("appearance", {}) or {}
        known = {**raw, **{f"appearance_{key}": value for key, value in appearance.items()}}
        unknown = set(known) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown orbital settings in {path}: {sorted(unknown)}")
        for name in ("caps", "appearance_targets", "appearance_steps"):
            if name in known:
                known[name] = tuple(known[name])
        return cls(**known)


@dataclass(frozen=True)
class Family:
    """The states of A anchors: canonical [A, D], visible [A, V, D], hidden [A, H, D]."""

    canonical: np.ndarray
    visible: np.ndarray
    hidden: np.ndarray

    @classmethod
    def from_views(cls, states: np.ndarray, visible: int) -> Family:
        """From every patch's states under views [canonical, visible..., hidden...]: [views, N, D]."""
        states = np.asarray(states, dtype=np.float64).transpose(1, 0, 2)
        return cls(states[:, 0], states[:, 1:1 + visible], states[:, 1 + visible:])


def nearest_point_errors(targets: np.ndarray, points: np.ndarray) -> np.ndarray:
    """[A, K]: the squared distance of each target [A, K, D] to its anchor's nearest point [A, P, D]."""
    squared = ((targets**2).sum(-1)[..., None] + (points**2).sum(-1)[:, None] - 2 * np.einsum("akd,apd->akp", targets, points))
    return np.clip(squared, 0.0, None).min(axis=-1)


def _errors(targets: np.ndarray, predictions: np.ndarray) -> np.ndarray:
    """[A]: the summed squared errors over each anchor's targets [A, K, D]."""
    return ((targets - predictions) ** 2).sum(axis=(1, 2))


def control_bases(structure: Principal, rank: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The controls' directions, [A, D, rank] orthonormal columns each: random (Gaussian, QR),
    donor (the Manifold directions of patch a + k mod A, k drawn in [1, A)) and shared (the top
    directions of every anchor's visible deviations pooled; needs the frame's anchors together)."""
    anchors, _, dim = structure.directions.shape
    own = structure.directions[:, :rank].transpose(0, 2, 1)
    random = np.linalg.qr(rng.standard_normal((anchors, dim, rank)))[0]
    donor = own[(np.arange(anchors) + int(rng.integers(1, anchors))) % anchors] if anchors > 1 else random
    # The pooled deviations' top directions, from the per-anchor structure: sum_a D_a^T L_a D_a.
    weighted = structure.directions * np.sqrt(structure.variances)[..., None]
    pooled = weighted.reshape(-1, dim).T @ weighted.reshape(-1, dim)
    shared = scipy.linalg.eigh(pooled, subset_by_index=[dim - rank, dim - 1])[1][:, ::-1]
    return {"random": random, "donor": donor, "shared": np.broadcast_to(shared, (anchors, dim, rank))}


def family_errors(family: Family, settings: OrbitalSettings, rng: np.random.Generator) -> dict:
    """Per anchor ([A] arrays unless said): the summed squared errors of every predictor of the
    hidden states (center, observed, manifold, the controls, full), of the Manifold at each rank
    0..max_rank ([A, max_rank + 1]; rank 0 is the visible mean) and at each cap ([A, caps]), the
    hidden coefficients beyond the cap ("clipped", of "coefficients" per anchor), the visible
    spectrum ([A, K], normalized), its effective rank and top energy; and "fits": the Manifold
    (fitted to the visible states only) and the controls' bounded spaces, by name."""
    canonical, visible, hidden = family.canonical, family.visible, family.hidden
    structure = principal(visible)
    rank = settings.rank
    manifold = fit_manifold(visible, rank, settings.cap, structure)
    fits = {"manifold": manifold, **{name: manifold_on(visible, basis, settings.cap)
                                     for name, basis in control_bases(structure, rank, rng).items()}}
    out = {
        "center": _errors(hidden, canonical[:, None]),
        "observed": nearest_point_errors(hidden, visible).sum(axis=1),
        **{name: _errors(hidden, fit.predict(hidden)) for name, fit in fits.items()},
        "fits": fits,
    }
    # Full-32, the ceiling that reads H: NaN for an anchor whose hidden states are not all finite.
    out["full"] = np.full(len(hidden), np.nan)
    finite = np.isfinite(hidden).all(axis=(1, 2))
    if finite.any():
        both = np.concatenate([visible[finite], hidden[finite]], axis=1)
        out["full"][finite] = _errors(hidden[finite], fit_manifold(both, rank, settings.cap).predict(hidden[finite]))

    # Every rank and cap at once: on orthonormal directions, the error of a clipped coefficient
    # z_c of a state with coefficient z drops by 2 z z_c - z_c^2 from the distance to the mean.
    max_rank = min(settings.max_rank, structure.directions.shape[1])
    deviations = hidden - structure.mean[:, None]
    z = np.einsum("ahd,akd->ahk", deviations, structure.directions[:, :max_rank])
    spread = np.sqrt(structure.variances[:, None, :max_rank])
    base = (deviations**2).sum(axis=(1, 2))

    def gains(limit):
        clipped = np.clip(z, -limit, limit)
        return (2 * z * clipped - clipped**2).sum(axis=1)  # [A, max_rank]

    limit = cap_limit(settings.cap, spread)
    out["rank"] = base[:, None] - np.concatenate([np.zeros((len(base), 1)), np.cumsum(gains(limit), axis=1)], axis=1)
    out["cap"] = np.stack([base - gains(cap_limit(cap, spread))[:, :rank].sum(axis=1) for cap in settings.caps], axis=1)
    out["clipped"] = (np.abs(z[..., :rank]) > limit[..., :rank]).sum(axis=(1, 2))
    out["coefficients"] = np.full(len(base), z.shape[1] * rank)
    out["spectrum"] = structure.variances / np.maximum(structure.variances.sum(axis=1, keepdims=True), np.finfo(float).tiny)
    out["effective_rank"] = effective_rank(structure.variances)
    out["top_energy"] = top_energy(structure.variances, settings.energy_top)
    out["variation"] = out["center"] / hidden.shape[1]  # mean squared distance of a hidden state to c
    out["canonical_energy"] = (canonical**2).sum(axis=1)
    return out


def coverage(errors, center) -> float:
    """1 - sum(errors) / sum(center): the fraction of the hidden squared error to the canonical
    state that a predictor removes (NaN when the hidden states equal the canonical one)."""
    total = float(np.sum(center))
    return 1.0 - float(np.sum(errors)) / total if total > 0 else math.nan


class FamilyTotals:
    """Running sums of one state family over frames; `summary()` pools them."""

    def __init__(self, grid_n: int, settings: OrbitalSettings):
        self.settings = settings
        self.anchors = 0
        self.sums: dict[str, float] = {name: 0.0 for name in ("center", *PREDICTORS, "clipped", "coefficients",
                                                               "effective_rank", "top_energy", "variation", "canonical_energy")}
        self.rank = np.zeros(settings.max_rank + 1)
        self.cap = np.zeros(len(settings.caps))
        self.spectrum: np.ndarray | None = None
        self.slot_center = np.zeros(grid_n)
        self.slot_manifold = np.zeros(grid_n)
        self.wins = {"manifold_over_observed": 0, "manifold_over_center": 0, "observed_over_center": 0}
        self.anchor_coverage: dict[str, list[np.ndarray]] = {"observed": [], "manifold": []}

    def add(self, errors: dict) -> None:
        self.anchors += len(errors["center"])
        for name in self.sums:
            self.sums[name] += float(np.sum(errors[name]))
        rank = errors["rank"].sum(axis=0)
        self.rank[: len(rank)] += rank
        self.cap += errors["cap"].sum(axis=0)
        spectrum = errors["spectrum"].sum(axis=0)
        self.spectrum = spectrum if self.spectrum is None else self.spectrum + spectrum
        self.slot_center += errors["center"]
        self.slot_manifold += errors["manifold"]
        center = errors["center"]
        self.wins["manifold_over_observed"] += int(np.sum(errors["manifold"] < errors["observed"]))
        self.wins["manifold_over_center"] += int(np.sum(errors["manifold"] < center))
        self.wins["observed_over_center"] += int(np.sum(errors["observed"] < center))
        varied = center > 0
        for name in self.anchor_coverage:
            self.anchor_coverage[name].append((1.0 - errors[name][varied] / center[varied]).astype(np.float32))

    def slot_coverage(self) -> np.ndarray:
        """[N]: the pooled Manifold coverage of each grid slot over frames."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.slot_center > 0, 1.0 - self.slot_manifold / self.slot_center, np.nan)

    def anchor_coverages(self, name: str) -> np.ndarray:
        return np.concatenate(self.anchor_coverage[name]) if self.anchor_coverage[name] else np.zeros(0, np.float32)

    def summary(self) -> dict:
        s, n = self.sums, max(self.anchors, 1)
        max_rank = min(self.settings.max_rank, len(self.spectrum))
        return {
            "anchors": self.anchors,
            "coverage": {name: rounded(coverage(s[name], s["center"])) for name in PREDICTORS},
            "anchor_median_coverage": {name: rounded(float(np.median(self.anchor_coverages(name))))
                                       for name in self.anchor_coverage if len(self.anchor_coverages(name))},
            "wins": {name: rounded(count / n) for name, count in self.wins.items()},
            "coverage_by_rank": [rounded(coverage(e, s["center"])) for e in self.rank[: max_rank + 1]],
            "coverage_by_cap": {_cap_name(cap): rounded(coverage(e, s["center"])) for cap, e in zip(self.settings.caps, self.cap)},
            "cap_saturation": rounded(s["clipped"] / max(s["coefficients"], 1.0)),
            "effective_rank": rounded(s["effective_rank"] / n),
            f"top{self.settings.energy_top}_energy": rounded(s["top_energy"] / n),
            "mean_spectrum": [rounded(v / n) for v in self.spectrum],
            "hidden_variation": rounded(s["variation"] / n),
            "hidden_variation_relative": rounded(s["variation"] / s["canonical_energy"]) if s["canonical_energy"] > 0 else None,
        }


class OrbitalAnalysis:
    """Feed each frame's states with add_frame(); write() draws the figures and returns the summary."""

    def __init__(self, settings: OrbitalSettings, grid, patch_px: int, families=FAMILIES):
        self.settings = settings
        self.grid = grid
        self.visible, self.hidden = orbital_offsets(patch_px)
        self.patch_px = patch_px
        self.families = tuple(families)
        self.totals = {family: FamilyTotals(grid.n, settings) for family in self.families}
        self.rng = np.random.default_rng(settings.seed)
        self.frames = 0

    @property
    def offsets(self) -> np.ndarray:
        """[33, 2] the views in the order add_frame expects: canonical (0, 0), visible, hidden."""
        return np.concatenate([np.zeros((1, 2), np.int64), self.visible, self.hidden])

    def add_frame(self, states: dict[str, np.ndarray]) -> None:
        """{family: [33, N, D]} every patch's states under `offsets`."""
        for family in self.families:
            views = np.asarray(states[family])
            if views.shape[:2] != (len(self.offsets), self.grid.n):
                raise ValueError(f"expected [{len(self.offsets)}, {self.grid.n}, D] {family} states, got {views.shape}")
            self.totals[family].add(family_errors(Family.from_views(views, len(self.visible)), self.settings, self.rng))
        self.frames += 1

    def write(self, out_dir: Path, about: dict | None = None) -> dict:
        from sps_driving.analysis import orbital_plot

        if self.frames == 0:
            raise ValueError("no frames were analysed")
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        families = {family: totals.summary() for family, totals in self.totals.items()}
        figures = orbital_plot.write_figures(self, families, SEED_COVERAGE, out_dir)
        summary = {
            **(about or {}),
            "frames": self.frames,
            "grid": [self.grid.rows, self.grid.cols],
            "patch_px": self.patch_px,
            "offsets_px": {"visible": self.visible.tolist(), "hidden": self.hidden.tolist()},
            "settings": {"rank": self.settings.rank, "cap": self.settings.cap, "max_rank": self.settings.max_rank,
                         "caps": [_cap_name(c) for c in self.settings.caps], "energy_top": self.settings.energy_top,
                         "seed": self.settings.seed},
            "families": families,
            "seed_paper_coverage_percent": {k: list(v) for k, v in SEED_COVERAGE.items()},
            "figures": figures,
        }
        (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def rounded(value: float) -> float | None:
    return None if value is None or not math.isfinite(value) else round(float(value), 6)


def _cap_name(cap: float) -> str:
    return "none" if math.isinf(cap) else f"{cap:g}"


# ---- command line (sps-driving analyze --orbital) -------------------------------------------------


def torch_extractor(args):
    """The torch DINOv2 extractor of the analyze options (--extractor-config, --backbone, ...)."""
    from sps_driving.core.backbones.loader import load_extractor
    from sps_driving.train.extract import extraction_settings_from_args

    settings = extraction_settings_from_args(args)
    config = settings.config
    if config["backbone"] != "dinov2_vits14":
        raise ValueError(f"orbital states shift the DINOv2 backbone's input; backbone {config['backbone']} has no such views")
    if config.get("threads"):
        import torch

        torch.set_num_threads(int(config["threads"]))
    return load_extractor({**config, "backend": "torch", "precision": "fp32"}), config


def extractor_record(config: dict) -> dict:
    keys = ("backbone", "input_size", "roi", "masked_layer", "falloff", "alpha", "suppression", "dtype", "device")
    return {key: config.get(key) for key in keys}


def run_orbital(args, settings: OrbitalSettings) -> int:
    """The --orbital analysis over the camera frames of bag inputs."""
    from tqdm import tqdm

    from sps_driving.analysis.readers import bag_images
    from sps_driving.core.orbital import OrbitalReader
    from sps_driving.ros.bagio import BAG_INPUTS, is_bag

    not_bags = [str(p) for p in args.inputs if not is_bag(p)]
    if not_bags:
        print(f"error: orbital views shift camera frames, and {', '.join(not_bags)} hold none (a feature cache "
              f"stores descriptors only): give bags ({BAG_INPUTS})", file=sys.stderr)
        return 2
    try:
        sources = [bag_images(path, args.stride, args.image_topic) for path in args.inputs]
        extractor, config = torch_extractor(args)
        families = ("raw",) if extractor.unmasked else FAMILIES
        analysis = OrbitalAnalysis(settings, extractor.grid, extractor.input_size[0] // extractor.grid.rows, families)
        reader = OrbitalReader(extractor, analysis.offsets, families)
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    total = sum(count for count, _ in sources)
    if args.max_frames is not None:
        total = min(total, args.max_frames)
    with tqdm(total=total, desc="orbital views", unit="frame") as progress:
        for _, images in sources:
            for image in images:
                analysis.add_frame(reader.read(image))
                progress.update()
                if analysis.frames == args.max_frames:
                    break
            if analysis.frames == args.max_frames:
                break
    if analysis.frames == 0:
        print(f"error: no frames in {', '.join(map(str, args.inputs))}", file=sys.stderr)
        return 1
    about = {"command": "sps-driving " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["analyze"] else None,
             "inputs": [str(p) for p in args.inputs], "stride": args.stride, "extractor": extractor_record(config)}
    summary = analysis.write(args.out, about)
    for family, result in summary["families"].items():
        c = result["coverage"]
        print(f"{family}: {result['anchors']} anchors; coverage of hidden states: observed {_percent(c['observed'])}, "
              f"manifold {_percent(c['manifold'])} (random {_percent(c['random'])}, donor {_percent(c['donor'])}, "
              f"shared {_percent(c['shared'])}, full-32 {_percent(c['full'])}); manifold beats observed on "
              f"{_percent(result['wins']['manifold_over_observed'])} of anchors; effective rank {result['effective_rank']:.2f}")
    print(f"written to {args.out}")
    return 0


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"
