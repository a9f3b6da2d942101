"""Lemma 1 of SPS (section 3.5, appendix A.4), measured on real descriptors.

For a centred [N, D] descriptor matrix F_c = U_r S_r V_r^T (rank r, or its principal rank-r
part), uniform sampling of m rows preserves the row space when the row coherence
mu = N/r * max_i ||(U_r)_i||^2 is small. These functions measure mu, the distance
||P_F - P_{F_I}||_2 between the principal subspaces of all rows and of m sampled rows, the
spectral distortion of eq. 9, and the covariance scale factor alpha of eq. 13.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Gram eigenvalues (squared singular values) below this fraction of the largest count as zero:
# the eigensolver's rounding is about 1e-16 of the largest, so 1e-12 keeps clear of it.
_RELATIVE_RANK_TOLERANCE = 1e-12


@dataclass(frozen=True)
class Decomposition:
    """Thin SVD of a centred descriptor matrix, truncated to rank r."""

    centred: np.ndarray  # [N, D]
    left: np.ndarray  # U_r [N, r]
    right: np.ndarray  # V_r [D, r]

    @property
    def rank(self) -> int:
        return self.left.shape[1]


def decompose(descriptors: np.ndarray, rank: int) -> Decomposition:
    """Centre [N, D] descriptors and keep their principal rank-`rank` part (clamped to the numerical rank)."""
    x = np.asarray(descriptors, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"descriptors must be an [N, D] matrix with N >= 2, got shape {x.shape}")
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    centred = x - x.mean(axis=0)
    left, right = _top_singular_vectors(centred, rank)
    if left.shape[1] == 0:
        raise ValueError("descriptors have no variance: all rows are equal")
    return Decomposition(centred=centred, left=left, right=right)


def row_coherence(decomposition: Decomposition) -> float:
    """mu = N/r * max_i ||(U_r)_i||^2, in [1, N/r]: 1 when every patch carries the subspace
    equally, N/r when a few patches alone span it (then uniform sampling can miss them)."""
    n, r = decomposition.left.shape
    return float(n / r * (decomposition.left**2).sum(axis=1).max())


def principal_basis(rows: np.ndarray, rank: int) -> np.ndarray:
    """[D, <=rank] orthonormal basis of the principal rank-`rank` row space of `rows` (not re-centred)."""
    return _top_singular_vectors(rows, rank)[1]


def _top_singular_vectors(x: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Leading left [N, k] and right [D, k] singular vectors of x, k <= rank clamped to the
    numerical rank, from the eigenvectors of the N x N Gram matrix (faster than an SVD here)."""
    eigenvalues, vectors = np.linalg.eigh(x @ x.T)
    eigenvalues, vectors = eigenvalues[::-1], vectors[:, ::-1]
    if eigenvalues[0] <= 0:
        return vectors[:, :0], np.zeros((x.shape[1], 0))
    keep = min(rank, int((eigenvalues > eigenvalues[0] * _RELATIVE_RANK_TOLERANCE).sum()))
    left = vectors[:, :keep]
    # x^T u_i = s_i v_i; the QR step only restores orthonormality lost to rounding (same span).
    right, _ = np.linalg.qr(x.T @ left / np.sqrt(eigenvalues[:keep]))
    return left, right


def projector_distance(basis_a: np.ndarray, basis_b: np.ndarray) -> float:
    """||P_a - P_b||_2 for orthonormal bases [D, r_a], [D, r_b] without forming D x D projectors.

    Equal dimensions: the sine of the largest principal angle. Different dimensions: 1, because
    the larger subspace holds a direction orthogonal to the smaller one.
    """
    if basis_a.shape[1] != basis_b.shape[1]:
        return 1.0
    if basis_a.shape[1] == 0:
        return 0.0
    # ||(I - P_a) B||_2 is that sine, and stays accurate for tiny angles where sqrt(1 - cos^2) does not.
    residual = basis_b - basis_a @ (basis_a.T @ basis_b)
    return float(min(1.0, np.linalg.norm(residual, 2)))


def subspace_distance(decomposition: Decomposition, indices: np.ndarray) -> float:
    """||P_F - P_{F_I}||_2 between the principal subspaces of all rows and of rows `indices`."""
    sampled = decomposition.centred[np.asarray(indices, dtype=np.int64)]
    return projector_distance(decomposition.right, principal_basis(sampled, decomposition.rank))


def embedding_distortion(decomposition: Decomposition, indices: np.ndarray) -> float:
    """The smallest epsilon of eq. 9: max |eig(N/m U_I^T U_I) - 1| for sampled rows I of U_r."""
    n = decomposition.left.shape[0]
    sampled = decomposition.left[np.asarray(indices, dtype=np.int64)]
    eigenvalues = np.linalg.eigvalsh(n / sampled.shape[0] * sampled.T @ sampled)
    return float(np.abs(eigenvalues - 1.0).max())


def covariance_scale_factor(m: int, n: int) -> float:
    """alpha = (N-1)/N * m/(m-1) of eq. 13: E[covariance of m sampled rows] = alpha * full covariance."""
    if not 2 <= m <= n:
        raise ValueError(f"need 2 <= m <= N, got m={m}, N={n}")
    return (n - 1) / n * m / (m - 1)


def sample_sizes(n_patches: int, fractions: list[float]) -> list[int]:
    """Distinct row counts m = ceil(fraction * N), each at least 2, in increasing order."""
    if any(not 0.0 < f <= 1.0 for f in fractions):
        raise ValueError(f"sample fractions must be in (0, 1], got {fractions}")
    return sorted({max(2, min(n_patches, int(np.ceil(f * n_patches)))) for f in fractions})


@dataclass
class LemmaSweep:
    """Distances and distortions of many sampling draws, gathered over frames per sample size m."""

    sizes: list[int]
    distances: dict[int, list[float]]
    distortions: dict[int, list[float]]
    coherences: list[float]
    ranks: list[int]
    n_patches: int

    @classmethod
    def empty(cls, sizes: list[int], n_patches: int) -> LemmaSweep:
        return cls(sizes, {m: [] for m in sizes}, {m: [] for m in sizes}, [], [], n_patches)

    def add_frame(self, descriptors: np.ndarray, rank: int, draws: int, rng: np.random.Generator) -> None:
        """Draw `draws` uniform row subsets per sample size from one frame and record them."""
        decomposition = decompose(descriptors, rank)
        self.coherences.append(row_coherence(decomposition))
        self.ranks.append(decomposition.rank)
        n = decomposition.centred.shape[0]
        for m in self.sizes:
            for _ in range(draws):
                indices = rng.choice(n, size=m, replace=False)
                self.distances[m].append(subspace_distance(decomposition, indices))
                self.distortions[m].append(embedding_distortion(decomposition, indices))

    def summary(self) -> dict:
        """Per m: mean and 95th percentile of the subspace distance and of eq. 9's epsilon, and alpha."""
        if not self.coherences:
            raise ValueError("no frame was added to the lemma sweep")
        rows = []
        for m in self.sizes:
            distances = np.asarray(self.distances[m])
            distortions = np.asarray(self.distortions[m])
            rows.append(
                {
                    "m": m,
                    "fraction": m / self.n_patches,
                    "distance_mean": float(distances.mean()),
                    "distance_p95": float(np.percentile(distances, 95)),
                    "distortion_mean": float(distortions.mean()),
                    "distortion_p95": float(np.percentile(distortions, 95)),
                    "alpha": covariance_scale_factor(m, self.n_patches),
                }
            )
        return {
            "frames": len(self.coherences),
            "n_patches": self.n_patches,
            "rank_mean": float(np.mean(self.ranks)),
            "coherence_mean": float(np.mean(self.coherences)),
            "coherence_max": float(np.max(self.coherences)),
            "coherence_bound": self.n_patches / float(np.mean(self.ranks)),
            "samples": rows,
        }
