"""Figures of the orbital (patch state family) analysis and of the appearance shift, as PNG files."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from sps_driving.analysis.plot import save_figure  # noqa: E402

OFFSETS_FIGURE = "orbital_offsets.png"
COVERAGE_FIGURE = "orbital_coverage.png"
RANK_FIGURE = "orbital_rank.png"
SPECTRUM_FIGURE = "orbital_spectrum.png"
MAP_FIGURE = "orbital_coverage_map.png"
ANCHOR_FIGURE = "orbital_anchor_coverage.png"
APPEARANCE_FIGURE = "appearance_coverage.png"
LABELS = {"observed": "Observed", "manifold": "Manifold", "random": "Random", "donor": "Donor", "shared": "Shared",
          "full": "Full-32 (reads H)"}
COLORS = {"masked": "tab:blue", "raw": "tab:orange"}


def write_figures(analysis, families: dict, seed_coverage: dict, out_dir: Path) -> list[str]:
    """Every figure of an OrbitalAnalysis with its family summaries and the seed paper's coverage
    ranges; returns their file names."""
    plot_offsets(analysis.visible, analysis.hidden, analysis.patch_px, out_dir / OFFSETS_FIGURE)
    plot_coverage(families, seed_coverage, out_dir / COVERAGE_FIGURE)
    plot_rank(families, analysis.settings.rank, out_dir / RANK_FIGURE)
    plot_spectrum(families, analysis.settings.energy_top, out_dir / SPECTRUM_FIGURE)
    plot_coverage_map({f: t.slot_coverage().reshape(analysis.grid.rows, analysis.grid.cols) for f, t in analysis.totals.items()},
                      out_dir / MAP_FIGURE)
    plot_anchor_coverage({f: {name: t.anchor_coverages(name) for name in ("observed", "manifold")}
                          for f, t in analysis.totals.items()}, out_dir / ANCHOR_FIGURE)
    return [OFFSETS_FIGURE, COVERAGE_FIGURE, RANK_FIGURE, SPECTRUM_FIGURE, MAP_FIGURE, ANCHOR_FIGURE]


def plot_offsets(visible: np.ndarray, hidden: np.ndarray, patch_px: int, path: Path) -> None:
    """Where the anchor (the patch centre) lands under each view, inside its patch (PMTT Fig. 2b)."""
    fig, ax = plt.subplots(figsize=(4.2, 4.8))
    half = patch_px / 2
    ax.add_patch(plt.Rectangle((-half, -half), patch_px, patch_px, fill=False, linewidth=1.2, color="0.3"))
    ax.plot(visible[:, 1], visible[:, 0], "^", color="tab:blue", label=f"visible ({len(visible)})")
    ax.plot(hidden[:, 1], hidden[:, 0], "o", mfc="none", color="tab:red", label=f"hidden ({len(hidden)})")
    ax.plot([0], [0], "s", color="black", label="canonical")
    ax.set_xlim(-half - 0.5, half + 0.5)
    ax.set_ylim(half + 0.5, -half - 0.5)  # image rows grow downward
    ax.set_aspect("equal")
    ax.set_xlabel("dx (px of the backbone input)")
    ax.set_ylabel("dy (px)")
    ax.set_title(f"orbital views inside a {patch_px} px patch")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=7)
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def plot_coverage(families: dict, seed_ranges: dict, path: Path) -> None:
    """Pooled coverage of the hidden states by predictor and family, with the seed paper's ranges."""
    names = list(LABELS)
    fig, ax = plt.subplots(figsize=(7.4, 4.2))
    width = 0.8 / len(families)
    for i, (family, summary) in enumerate(families.items()):
        values = [100 * (summary["coverage"][n] if summary["coverage"][n] is not None else np.nan) for n in names]
        x = np.arange(len(names)) + (i - (len(families) - 1) / 2) * width
        ax.bar(x, values, width, color=COLORS.get(family), label=f"{family} ({summary['anchors']} anchors)")
        for xi, v in zip(x, values):
            ax.text(xi, v + (1 if v >= 0 else -4), f"{v:.0f}", ha="center", fontsize=7)
    for name, (low, high) in seed_ranges.items():
        k = names.index(name)
        ax.fill_between([k - 0.45, k + 0.45], low, high, color="0.6", alpha=0.35, linewidth=0,
                        label="seed paper (DINOv3 S-H+)" if k == 0 else None)
    ax.axhline(0, color="0.3", linewidth=0.8)
    ax.set_xticks(range(len(names)), [LABELS[n] for n in names], fontsize=8)
    ax.set_ylabel("coverage of hidden states, % (vs Center)")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def plot_rank(families: dict, rank: int, path: Path) -> None:
    """Manifold coverage against its rank (0: the visible mean), with Observed's level."""
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for family, summary in families.items():
        values = [100 * (v if v is not None else np.nan) for v in summary["coverage_by_rank"]]
        ax.plot(range(len(values)), values, "o-", color=COLORS.get(family), label=f"{family}: Manifold")
        observed = summary["coverage"]["observed"]
        if observed is not None:
            ax.axhline(100 * observed, color=COLORS.get(family), linestyle=":", label=f"{family}: Observed")
    ax.axvline(rank, color="0.4", linestyle="--", linewidth=1, label=f"chosen rank {rank}")
    ax.set_xlabel("Manifold rank r")
    ax.set_ylabel("coverage of hidden states, %")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_spectrum(families: dict, top: int, path: Path) -> None:
    """Mean normalized spectrum of the visible states per anchor."""
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for family, summary in families.items():
        spectrum = summary["mean_spectrum"]
        ax.plot(range(1, len(spectrum) + 1), spectrum, "o-", color=COLORS.get(family),
                label=f"{family}: effective rank {summary['effective_rank']:.2f}, top-{top} energy "
                      f"{100 * summary[f'top{top}_energy']:.0f}%")
    ax.set_yscale("log")
    ax.set_xlabel("component of the visible states")
    ax.set_ylabel("share of the variance (mean over anchors)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_coverage_map(maps: dict, path: Path) -> None:
    """Per grid slot, the pooled Manifold coverage over frames."""
    fig, axes = plt.subplots(1, len(maps), figsize=(4.6 * len(maps), 3.4), squeeze=False)
    for ax, (family, grid) in zip(axes[0], maps.items()):
        image = ax.imshow(100 * grid, cmap="viridis", vmin=0, vmax=100, interpolation="nearest")
        ax.set_title(f"{family}: Manifold coverage per patch, %", fontsize=9)
        ax.set_xlabel("column")
        ax.set_ylabel("row")
        fig.colorbar(image, ax=ax, shrink=0.8)
    save_figure(fig, path)


def plot_anchor_coverage(coverages: dict, path: Path) -> None:
    """Histograms of per-anchor coverage, Observed against Manifold (clipped to [-50, 100] %)."""
    fig, axes = plt.subplots(1, len(coverages), figsize=(4.6 * len(coverages), 3.4), squeeze=False)
    bins = np.linspace(-50, 100, 61)
    for ax, (family, values) in zip(axes[0], coverages.items()):
        for name, color in (("observed", "tab:gray"), ("manifold", COLORS.get(family))):
            ax.hist(np.clip(100 * values[name], -50, 100), bins=bins, color=color, alpha=0.6, label=LABELS[name])
        ax.set_title(family, fontsize=9)
        ax.set_xlabel("coverage of one anchor's hidden states, %")
        ax.set_ylabel("anchors")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_appearance(results: dict, path: Path) -> None:
    """Per target scenario and scenery: how much of the appearance shift of each patch's token
    the base frame's Manifold covers, against Observed, the visible mean alone and the random and
    shared controls, per family; the shift's size in orbital units at the bars' foot."""
    rows = list(results)
    families = sorted({family for row in results.values() for family in row})
    fig, axes = plt.subplots(len(families), 1, figsize=(max(7.0, 1.1 * len(rows)), 4.2 * len(families)), squeeze=False)
    bars = (("mean", "visible mean", "tab:olive"), ("random", "Random", "tab:purple"), ("shared", "Shared", "tab:green"),
            ("observed", "Observed", "tab:gray"), ("manifold", "Manifold", None))
    width = 0.8 / len(bars)
    for ax, family in zip(axes[:, 0], families):
        x = np.arange(len(rows))
        for k, (name, label, color) in enumerate(bars):
            values = [100 * (results[r][family]["coverage"][name] or np.nan) for r in rows]
            ax.bar(x + (k - (len(bars) - 1) / 2) * width, values, width, color=color or COLORS.get(family), label=label)
        for xi, r in zip(x, rows):
            ax.text(xi, 2, f"x{results[r][family]['shift_over_orbit']:.0f}", ha="center", fontsize=7, rotation=90)
        ax.axhline(0, color="0.3", linewidth=0.8)
        ax.set_xticks(x, rows, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("coverage of the shift, % (x: its size / the orbit's)")
        ax.set_title(f"{family} tokens: the shift covered by the base frame's spaces", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)
