"""Figures of the redundancy analysis, written as PNG files (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402


def plot_explained_variance(
    curve_all: np.ndarray, curve_top: np.ndarray, components_all: int, components_top: int,
    top_count: int, level: float, path: Path,
) -> None:
    """Figure 3a: E(m) for all patches and for the top-norm patches, the level line and both markers."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    m = np.arange(1, curve_all.shape[0] + 1)
    ax.plot(m, curve_all, color="tab:blue", label="all patches")
    ax.plot(m, curve_top, color="tab:orange", label=f"top-{top_count} patches by $\\ell_2$ norm")
    ax.axhline(level, color="red", linewidth=1.0, label=f"{level:.0%} explained variance")
    ax.axvline(components_all, color="tab:blue", linestyle="--", linewidth=1.0, label=f"{components_all} components")
    ax.axvline(components_top, color="tab:orange", linestyle=":", linewidth=1.2, label=f"{components_top} components")
    ax.set_xlim(1, max(2 * max(components_all, components_top), 16))
    ax.set_ylim(0.0, 1.01)
    ax.set_xlabel("number of principal components m")
    ax.set_ylabel("cumulative explained variance E(m)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path)


def plot_correlation(corr: np.ndarray, frame_index: int, path: Path) -> None:
    """Figure 3b: the N x N patch-wise Pearson correlation of one frame."""
    fig, ax = plt.subplots(figsize=(5.6, 4.8))
    image = ax.imshow(corr, cmap="coolwarm", vmin=-1.0, vmax=1.0, interpolation="nearest")
    fig.colorbar(image, ax=ax, label="Pearson correlation")
    ax.set_title(f"patch-wise correlation, frame {frame_index}")
    ax.set_xlabel("patch index")
    ax.set_ylabel("patch index")
    save_figure(fig, path)


def plot_lemma(summary: dict, path: Path) -> None:
    """Subspace distance ||P_F - P_F_I||_2 (mean and 95th percentile) and eq. 9's epsilon against
    the sampled fraction m/N, with the covariance scale factor alpha on a second axis."""
    rows = summary["samples"]
    fraction = [row["fraction"] for row in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(fraction, [row["distance_mean"] for row in rows], "o-", color="tab:blue", label="subspace distance, mean")
    ax.plot(fraction, [row["distance_p95"] for row in rows], "o--", color="tab:blue", alpha=0.6, label="subspace distance, p95")
    ax.plot(fraction, [row["distortion_mean"] for row in rows], "s-", color="tab:green", label="eq. 9 $\\varepsilon$, mean")
    ax.set_xlabel("sampled fraction of patches m/N")
    ax.set_ylabel("distance / distortion")
    ax.set_ylim(bottom=0.0)
    ax.grid(alpha=0.3)
    alpha_ax = ax.twinx()
    alpha_ax.plot(fraction, [row["alpha"] for row in rows], "^:", color="tab:red", label="$\\alpha$ (eq. 13)")
    alpha_ax.set_ylabel("covariance scale factor $\\alpha$")
    handles = ax.get_legend_handles_labels()[0] + alpha_ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    ax.set_title(
        f"rank r = {summary['rank_mean']:.1f} (mean), coherence $\\mu$ = {summary['coherence_mean']:.2f}"
        f" (bound N/r = {summary['coherence_bound']:.1f})"
    )
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
