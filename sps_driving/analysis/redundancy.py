"""The streamed redundancy analysis: frames in one at a time, figures and summary.json out.

Per frame it keeps only running sums (E(m) curves, a pooled covariance, correlation
statistics); the frame shown in the correlation heatmap, the overlay frame and the frames of
the lemma sweep are the only ones whose data is looked at beyond that.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import yaml
from tqdm import tqdm

from sps_driving.analysis import plot
from sps_driving.analysis.correlation import CorrelationSummary, patch_correlation
from sps_driving.analysis.lemma import LemmaSweep, sample_sizes
from sps_driving.analysis.pca import (
    CurveAverage,
    RunningCovariance,
    components_to_reach,
    curve_from_covariance,
    explained_variance_curve,
    top_norm_rows,
    top_patch_count,
)
from sps_driving.analysis.readers import open_sources, read_rgb
from sps_driving.analysis.similarity import cosine_similarity_map, overlay, overlay_grid
from sps_driving.core.grid import PatchGrid

SUMMARY_FILE = "summary.json"
EXPLAINED_VARIANCE_FIGURE = "explained_variance.png"
CORRELATION_FIGURE = "patch_correlation.png"
LEMMA_FIGURE = "lemma_subspace.png"
OVERLAY_GRID_FIGURE = "similarity_grid.png"


@dataclass(frozen=True)
class AnalysisSettings:
    """config/analysis.yaml, validated (units there)."""

    explained_variance_level: float = 0.9
    top_patches: int = 128
    correlation_frame: int = 0
    strong_correlation: float = 0.5
    overlay_frame: int = 0
    overlay_seeds: tuple[tuple[float, float], ...] = ((0.75, 0.5), (0.5, 0.1))
    overlay_cell_width: int = 120
    overlay_opacity: float = 0.5
    lemma_rank: int | None = None
    lemma_fractions: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
    lemma_draws: int = 20
    lemma_frame_stride: int = 25
    lemma_max_frames: int = 20
    lemma_seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.explained_variance_level <= 1.0:
            raise ValueError(f"explained_variance_level must be in (0, 1], got {self.explained_variance_level}")
        for name in ("top_patches", "overlay_cell_width", "lemma_draws", "lemma_frame_stride"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.lemma_max_frames < 0 or self.correlation_frame < 0 or self.overlay_frame < 0:
            raise ValueError("frame indices and lemma max_frames must not be negative")
        if self.lemma_rank is not None and self.lemma_rank < 1:
            raise ValueError(f"lemma rank must be at least 1, got {self.lemma_rank}")
        if any(not (0.0 <= r <= 1.0 and 0.0 <= c <= 1.0) for r, c in self.overlay_seeds):
            raise ValueError(f"overlay seeds are [row, col] fractions in [0, 1], got {self.overlay_seeds}")

    @classmethod
    def from_yaml(cls, path: Path) -> AnalysisSettings:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        lemma = raw.pop("lemma", {}) or {}
        raw.pop("orbital", None)  # the orbital analysis's section (sps_driving.analysis.orbital)
        known = {f"lemma_{key}": value for key, value in lemma.items()}
        known.update(raw)
        unknown = set(known) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown settings in {path}: {sorted(unknown)}")
        if "overlay_seeds" in known:
            known["overlay_seeds"] = tuple(tuple(float(v) for v in seed) for seed in known["overlay_seeds"])
        if "lemma_fractions" in known:
            known["lemma_fractions"] = tuple(float(v) for v in known["lemma_fractions"])
        return cls(**known)


class RedundancyAnalysis:
    """Feed frames with add_frame(); write() draws the figures and returns the summary."""

    def __init__(self, settings: AnalysisSettings, grid: PatchGrid) -> None:
        self.settings = settings
        self.grid = grid
        self.top_count = top_patch_count(grid.n, settings.top_patches)
        self.frames = 0
        self.frames_without_variance = 0
        self.frames_dropped_nonfinite = 0
        self.dim: int | None = None
        self._curves_all = CurveAverage()
        self._curves_top = CurveAverage()
        self._components_all: list[int] = []
        self._components_top: list[int] = []
        self._pooled = RunningCovariance()
        self._correlation = CorrelationSummary(settings.strong_correlation)
        self._correlation_matrix: np.ndarray | None = None
        self._overlay: tuple[np.ndarray, np.ndarray | None] | None = None
        self._lemma = LemmaSweep.empty(sample_sizes(grid.n, list(settings.lemma_fractions)), grid.n)
        self._lemma_rng = np.random.default_rng(settings.lemma_seed)

    def add_frame(self, descriptors: np.ndarray, image_rgb: np.ndarray | None = None) -> bool:
        """One frame's [N, D] descriptors (all patches, row-major) and, if known, its RGB image.

        A frame with NaN or Inf is dropped and counted (returns False); a wrong shape is an error.
        """
        x = np.asarray(descriptors, dtype=np.float64)
        if x.ndim != 2 or x.shape[0] != self.grid.n:
            raise ValueError(f"expected [{self.grid.n}, D] descriptors, got shape {x.shape}")
        if self.dim is None:
            self.dim = x.shape[1]
        elif x.shape[1] != self.dim:
            raise ValueError(f"descriptor dim changed from {self.dim} to {x.shape[1]}")
        if not np.isfinite(x).all():
            self.frames_dropped_nonfinite += 1
            return False
        index = self.frames
        self.frames += 1
        level = self.settings.explained_variance_level

        curve_all = explained_variance_curve(x)
        curve_top = explained_variance_curve(top_norm_rows(x, self.top_count))
        if curve_all is None or curve_top is None:
            self.frames_without_variance += 1
        else:
            self._curves_all.add(curve_all)
            self._curves_top.add(curve_top)
            self._components_all.append(components_to_reach(curve_all, level))
            self._components_top.append(components_to_reach(curve_top, level))
        self._pooled.add(x)

        corr = patch_correlation(x)
        self._correlation.add(corr)
        if index == self.settings.correlation_frame:
            self._correlation_matrix = corr
        if index == self.settings.overlay_frame:
            self._overlay = (x, image_rgb)

        lemma = self.settings
        if (
            curve_all is not None
            and index % lemma.lemma_frame_stride == 0
            and len(self._lemma.coherences) < lemma.lemma_max_frames
        ):
            rank = lemma.lemma_rank or components_to_reach(curve_all, level)
            self._lemma.add_frame(x, rank, lemma.lemma_draws, self._lemma_rng)
        return True

    def write(self, out_dir: Path, about: dict | None = None) -> dict:
        """Write the PNG figures and summary.json (led by `about`, e.g. input and backbone) into
        `out_dir`; return the summary."""
        if not self._components_all:
            raise ValueError(f"none of the {self.frames} frames had any variance across patches")
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        level = self.settings.explained_variance_level
        curve_all, curve_top = self._curves_all.mean(), self._curves_top.mean()
        components_all = components_to_reach(curve_all, level)
        components_top = components_to_reach(curve_top, level)
        pooled_curve = curve_from_covariance(self._pooled.covariance()) if self._pooled.rows > 1 else None
        figures = [EXPLAINED_VARIANCE_FIGURE]
        plot.plot_explained_variance(
            curve_all, curve_top, components_all, components_top, self.top_count, level, out_dir / EXPLAINED_VARIANCE_FIGURE
        )
        if self._correlation_matrix is not None:
            plot.plot_correlation(self._correlation_matrix, self.settings.correlation_frame, out_dir / CORRELATION_FIGURE)
            figures.append(CORRELATION_FIGURE)
        lemma_summary = None
        if self._lemma.coherences:
            lemma_summary = self._lemma.summary()
            plot.plot_lemma(lemma_summary, out_dir / LEMMA_FIGURE)
            figures.append(LEMMA_FIGURE)
        figures += self._write_overlays(out_dir)

        summary = {
            **(about or {}),
            "frames": self.frames,
            "frames_without_variance": self.frames_without_variance,
            "frames_dropped_nonfinite": self.frames_dropped_nonfinite,
            "grid": [self.grid.rows, self.grid.cols],
            "dim": self.dim,
            "explained_variance_level": level,
            "top_patches": self.top_count,
            "components_90_all": components_all,
            "components_90_top": components_top,
            "components_90_pooled": components_to_reach(pooled_curve, level) if pooled_curve is not None else None,
            "per_frame_components_all": _distribution(self._components_all),
            "per_frame_components_top": _distribution(self._components_top),
            "explained_variance_all": [round(float(v), 6) for v in curve_all],
            "explained_variance_top": [round(float(v), 6) for v in curve_top],
            "correlation": self._correlation.summary(),
            "lemma": lemma_summary,
            "figures": figures,
        }
        (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _write_overlays(self, out_dir: Path) -> list[str]:
        if self._overlay is None or self._overlay[1] is None:
            return []
        descriptors, image = self._overlay
        opacity = self.settings.overlay_opacity
        written = []
        for row_fraction, col_fraction in self.settings.overlay_seeds:
            row = min(self.grid.rows - 1, int(row_fraction * self.grid.rows))
            col = min(self.grid.cols - 1, int(col_fraction * self.grid.cols))
            seed = row * self.grid.cols + col
            name = f"similarity_seed_r{row}_c{col}.png"
            _write_rgb(out_dir / name, overlay(image, cosine_similarity_map(descriptors, self.grid, seed), opacity))
            written.append(name)
        mosaic = overlay_grid(image, descriptors, self.grid, self.settings.overlay_cell_width, opacity)
        _write_rgb(out_dir / OVERLAY_GRID_FIGURE, mosaic)
        return written + [OVERLAY_GRID_FIGURE]


def _distribution(values: list[int]) -> dict:
    array = np.asarray(values)
    return {"mean": float(array.mean()), "median": float(np.median(array)), "min": int(array.min()), "max": int(array.max())}


def _write_rgb(path: Path, image_rgb: np.ndarray) -> None:
    # Full compression: the overlay grid is a large image and is meant to be kept with results.
    if not cv2.imwrite(str(path), cv2.cvtColor(image_rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_PNG_COMPRESSION, 9]):
        raise OSError(f"could not write {path}")


def run_redundancy(args: argparse.Namespace, settings: AnalysisSettings) -> int:
    """The redundancy analysis over every input of `sps-driving analyze` (its docstring)."""
    try:
        overlay_image = read_rgb(args.overlay_image) if args.overlay_image is not None else None
        sources = open_sources(args.inputs, args.stride, args)
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    first = sources[0]
    mismatched = [s.path for s in sources if (s.backbone, s.grid) != (first.backbone, first.grid)]
    if mismatched:
        print(f"error: {', '.join(map(str, mismatched))} differ from {first.path} in backbone or patch grid "
              f"({first.backbone}, {first.grid.rows}x{first.grid.cols}): analyse them separately", file=sys.stderr)
        return 2

    analysis = RedundancyAnalysis(settings, first.grid)
    total = sum(s.frames for s in sources)
    if args.max_frames is not None:
        total = min(total, args.max_frames)
    with tqdm(total=total, desc="analyse", unit="frame") as progress:
        for descriptors, image in itertools.chain.from_iterable(s.stream for s in sources):
            if image is None and analysis.frames == settings.overlay_frame:
                image = overlay_image
            if not analysis.add_frame(descriptors, image):
                print(f"warning: dropped a frame with non-finite descriptors "
                      f"({analysis.frames_dropped_nonfinite} dropped)", file=sys.stderr)
            progress.update()
            if analysis.frames == args.max_frames:
                break
    if analysis.frames == 0:
        print(f"error: no frames in {', '.join(map(str, args.inputs))}", file=sys.stderr)
        return 1
    summary = analysis.write(args.out, {"inputs": [str(p) for p in args.inputs], "backbone": first.backbone})
    print(
        f"{first.backbone}: {summary['frames']} frames, grid {first.grid.rows}x{first.grid.cols}, D={summary['dim']}: "
        f"90% variance with {summary['components_90_all']} components (all patches), "
        f"{summary['components_90_top']} (top-{summary['top_patches']} by norm); "
        f"mean |off-diagonal correlation| {summary['correlation']['mean_abs_offdiagonal']:.3f}; "
        f"written to {args.out}"
    )
    return 0


