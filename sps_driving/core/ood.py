"""Out-of-distribution scores of one frame's kept patch descriptors, calibrated on a policy's
training frames. Pure logic, no ROS.

Two scores, each a distance from what the policy was trained on:
- `pooled_mahalanobis`: the Mahalanobis distance of the mean of the kept descriptors from the
  training frames' means (covariance shrunk toward its average variance, so that the D x D
  estimate stays well conditioned on a few thousand frames);
- `patch_coreset`: the mean over the kept patches of each one's Euclidean distance to the nearest
  centre of a k-center coreset of training patch descriptors (greedy farthest-point selection),
  so a frame with a few unfamiliar patches among familiar ones scores above a frame of familiar ones.

A calibration made from drives that record the car's lane pose (the simulator's, or a data car's
localization against a lane map) adds a third kind, a score of the moment rather than of the scene:
a linear probe (`LanePoseProbe`) that reads the car's lateral offset and heading error in its lane
from the kept descriptors pooled in column bands, fitted on the training frames' recorded poses.
`lane_offset` is its lateral offset's magnitude (m); `lane_lookahead` that offset carried
LOOKAHEAD_M ahead along its heading. Each is high where the stack sees itself near its lane's edge.

Each raw value is divided by its 99th percentile over held-out training frames (`scale`), so a
score of 1.0 is where 1% of in-distribution frames lie above, whichever method. The calibration
is a pair of files in the checkpoint's folder: `ood.safetensors` (the tensors) and `ood.json`
(format, the descriptors it was made for, the digest of the policy's weights, the scales, and
how it was made). `load_calibration` refuses a calibration of other descriptors or another
policy with the reason.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "sps_driving.ood/1"
TENSORS_FILE = "ood.safetensors"
META_FILE = "ood.json"
METHODS = ("pooled_mahalanobis", "patch_coreset")
# The kept patch farthest from the coreset: a local novelty (an animal on the road) that the mean
# over the kept patches dilutes. In calibrations that give it a scale (those made since it exists).
PEAK_METHOD = "patch_peak"
PROBE_METHODS = ("lane_offset", "lane_lookahead")  # in a calibration made with lane poses (LanePoseProbe)
SCORE_METHODS = METHODS + (PEAK_METHOD,) + PROBE_METHODS  # every score a calibration can have
LOOKAHEAD_M = 10.0  # m along the car's heading at which `lane_lookahead` reads the lateral offset (1 s at 10 m/s)
# Scores of the policy's own uncertainty, logged in evaluations beside the calibrated ones (rad,
# uncalibrated): the spread of an ensemble's heads' steering commands
# (sps_driving.core.policies.ensemble.head_disagreement), and of a policy's steering over other
# selections of the same frame (SelectionDisagreement).
HEAD_DISAGREEMENT = "head_disagreement"
SELECTION_DISAGREEMENT = "selection_disagreement"
SCALE_QUANTILE = 0.99  # the held-out training frames' quantile that a score of 1.0 stands for
# The extraction settings that decide what a descriptor is (sps_driving.export.extractors): a
# calibration of other values describes other descriptors.
DESCRIPTOR_SETTINGS = ("backbone", "input_size", "roi", "masked_layer", "falloff", "alpha", "suppression", "tokens",
                       "model_path")
# What a checkpoint written before a setting existed means by its absence.
SETTING_DEFAULTS = {"tokens": "all"}


def load_ood_config(path=None) -> dict:
    """config/ood.yaml (or `path`): score, calibration and rule settings, the score's method checked."""
    import yaml

    from sps_driving.core.resources import config_path

    path = Path(path) if path is not None else config_path("ood.yaml")
    config = yaml.safe_load(Path(path).read_text()) or {}
    missing = [key for key in ("score", "calibration", "rule") if not isinstance(config.get(key), dict)]
    if missing:
        raise ValueError(f"{path}: missing sections {missing}")
    if config["score"].get("method") not in SCORE_METHODS:
        raise ValueError(f"{path}: score method must be one of {SCORE_METHODS}, got {config['score'].get('method')!r}")
    return config


class CalibrationError(ValueError):
    """A calibration that is missing, unreadable or made for other descriptors or another policy."""


def _pooled(descriptors: np.ndarray) -> np.ndarray:
    if descriptors.ndim != 2 or len(descriptors) == 0:
        raise ValueError(f"OOD score: expected [k, D] descriptors with k >= 1, got shape {descriptors.shape}")
    return descriptors.mean(axis=0, dtype=np.float64)


@dataclass(frozen=True)
class PooledMahalanobis:
    mean: np.ndarray  # float64 [D]
    precision: np.ndarray  # float64 [D, D]: the inverse of the shrunk covariance

    @classmethod
    def fit(cls, pooled: np.ndarray, shrinkage: float) -> PooledMahalanobis:
        """pooled: [n, D] the training frames' mean kept descriptors; shrinkage in [0, 1]: the weight
        of the average variance on the covariance's diagonal."""
        if not 0.0 <= shrinkage <= 1.0:
            raise ValueError(f"shrinkage must lie in [0, 1], got {shrinkage}")
        pooled = np.asarray(pooled, dtype=np.float64)
        mean = pooled.mean(axis=0)
        covariance = np.cov(pooled, rowvar=False)
        average = np.trace(covariance) / len(covariance)
        shrunk = (1.0 - shrinkage) * covariance + shrinkage * average * np.eye(len(covariance))
        return cls(mean, np.linalg.inv(shrunk))

    def raw(self, descriptors: np.ndarray) -> float:
        delta = _pooled(descriptors) - self.mean
        return float(math.sqrt(max(float(delta @ self.precision @ delta), 0.0)))


@dataclass(frozen=True)
class PatchCoreset:
    centers: np.ndarray  # float32 [M, D]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_squared", np.einsum("md,md->m", self.centers, self.centers))

    @classmethod
    def fit(cls, patches: np.ndarray, size: int, rng: np.random.Generator) -> PatchCoreset:
        """Greedy k-center: start from a random patch, then add the patch farthest from the centres so far."""
        patches = np.asarray(patches, dtype=np.float32)
        if not 1 <= size <= len(patches):
            raise ValueError(f"a coreset of {size} centres needs at least that many patches, got {len(patches)}")
        squared = np.einsum("nd,nd->n", patches, patches)
        chosen = [int(rng.integers(len(patches)))]
        nearest = np.full(len(patches), np.inf, dtype=np.float32)
        for _ in range(size - 1):
            c = patches[chosen[-1]]
            nearest = np.minimum(nearest, squared - 2.0 * (patches @ c) + squared[chosen[-1]])
            chosen.append(int(np.argmax(nearest)))
        return cls(patches[chosen].copy())

    def distances(self, descriptors: np.ndarray) -> np.ndarray:
        """[k] each patch's Euclidean distance to its nearest centre."""
        x = np.asarray(descriptors, dtype=np.float32)
        squared = np.einsum("kd,kd->k", x, x)[:, None] - 2.0 * (x @ self.centers.T) + self._squared[None, :]
        return np.sqrt(np.maximum(squared.min(axis=1), 0.0))

    def raw(self, descriptors: np.ndarray) -> dict:
        """{patch_coreset: the kept patches' mean distance, patch_peak: their largest}."""
        if descriptors.ndim != 2 or len(descriptors) == 0:
            raise ValueError(f"OOD score: expected [k, D] descriptors with k >= 1, got shape {descriptors.shape}")
        distances = self.distances(descriptors)
        return {"patch_coreset": float(distances.mean()), PEAK_METHOD: float(distances.max())}


def lookahead_offset(lateral_m, heading_rad):
    """|lateral offset LOOKAHEAD_M ahead along the heading| (m), of numbers or arrays."""
    return np.abs(lateral_m + LOOKAHEAD_M * np.tan(heading_rad))


def band_features(descriptors: np.ndarray, indices: np.ndarray, bands: int, cols: int) -> np.ndarray:
    """[bands * D + 1]: the mean of the kept descriptors in each of `bands` column bands of a grid of
    `cols` columns (the mean of all kept ones for a band without any), then 1 for the intercept."""
    x = np.asarray(descriptors, dtype=np.float64)
    band = (np.asarray(indices) % cols) * bands // cols
    overall = _pooled(x)
    pooled = [x[band == b].mean(axis=0) if np.any(band == b) else overall for b in range(bands)]
    return np.concatenate([*pooled, [1.0]])


@dataclass(frozen=True)
class LanePoseProbe:
    """Lateral offset (m, left positive) and heading error (rad) in the lane, linear in the kept
    descriptors' means over `bands` column bands of the grid (a band without a kept patch takes the
    mean of all kept ones), so any selection of the frame's patches can be read."""

    weights: np.ndarray  # float64 [bands * D + 1, 2]: the last row is the intercept
    bands: int
    cols: int

    @classmethod
    def fit(cls, features: np.ndarray, poses: np.ndarray, ridge: float, bands: int, cols: int) -> LanePoseProbe:
        """features: [n, bands * D + 1] (`band_features` of each training frame); poses: [n, 2] the recorded
        (lateral offset, heading error); ridge: the penalty on the standardized features' weights."""
        x = np.asarray(features[:, :-1], dtype=np.float64)
        y = np.asarray(poses, dtype=np.float64)
        mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
        z = (x - mean) / std
        w = np.linalg.solve(z.T @ z + ridge * np.eye(z.shape[1]), z.T @ (y - y.mean(axis=0)))
        w = w / std[:, None]  # back to the unstandardized features, so a frame costs one product
        return cls(np.vstack([w, y.mean(axis=0) - mean @ w]), bands, cols)

    def pose(self, descriptors: np.ndarray, indices: np.ndarray) -> tuple[float, float]:
        lateral, heading = band_features(descriptors, indices, self.bands, self.cols) @ self.weights
        return float(lateral), float(heading)

    def raw(self, descriptors: np.ndarray, indices: np.ndarray) -> dict:
        lateral, heading = self.pose(descriptors, indices)
        return {"lane_offset": abs(lateral), "lane_lookahead": float(lookahead_offset(lateral, heading))}


def descriptor_settings(policy_config: dict) -> dict:
    """What the checkpoint's descriptors are: dimension, grid and the extraction settings that shape them."""
    extractor = policy_config.get("extractor") or {}
    return {"descriptor_dim": int(policy_config["descriptor_dim"]), "grid": dict(policy_config["grid"]),
            "extractor": {key: extractor.get(key, SETTING_DEFAULTS.get(key)) for key in DESCRIPTOR_SETTINGS}}


def calibration_methods(probe, peak: bool = True) -> tuple:
    """The scores a calibration has: METHODS, PEAK_METHOD where it has its scale, and PROBE_METHODS
    where it has a lane-pose probe."""
    return METHODS + ((PEAK_METHOD,) if peak else ()) + (PROBE_METHODS if probe is not None else ())


class OodScorer:
    """The scores of a calibration (`calibration_methods`); `scores` gives each one of a frame,
    normalized by its scale."""

    def __init__(self, mahalanobis: PooledMahalanobis, coreset: PatchCoreset, meta: dict,
                 probe: LanePoseProbe | None = None):
        self.models = {"pooled_mahalanobis": mahalanobis, "patch_coreset": coreset}
        self.probe = probe
        self.methods = calibration_methods(probe, PEAK_METHOD in meta["scales"])
        self.meta = meta
        self.scales = {name: float(meta["scales"][name]) for name in self.methods}
        self.dim = len(mahalanobis.mean)

    def score(self, descriptors: np.ndarray, method: str, indices: np.ndarray | None = None) -> float:
        """One method's score of a frame's kept descriptors [k, D] (a probe's also needs their patch
        `indices`); ValueError for a frame of the wrong shape."""
        return self.scores(descriptors, indices, (method,))[method]

    def scores(self, descriptors: np.ndarray, indices: np.ndarray | None = None, methods=None) -> dict:
        descriptors = np.asarray(descriptors)
        if descriptors.ndim != 2 or descriptors.shape[1] != self.dim or len(descriptors) == 0:
            raise ValueError(f"OOD score: expected [k, {self.dim}] descriptors with k >= 1, got shape {descriptors.shape}")
        methods = self.methods if methods is None else methods
        if missing := [m for m in methods if m not in self.methods]:
            raise ValueError(f"OOD score: this calibration has no {missing} (it has {self.methods})")
        raw = {}
        if "pooled_mahalanobis" in methods:
            raw["pooled_mahalanobis"] = self.models["pooled_mahalanobis"].raw(descriptors)
        if {"patch_coreset", PEAK_METHOD} & set(methods):
            raw.update(self.models["patch_coreset"].raw(descriptors))
        if any(m in PROBE_METHODS for m in methods):
            if indices is None or len(indices) != len(descriptors):
                raise ValueError(f"OOD score: the lane-pose probe needs the {len(descriptors)} kept patches' indices")
            raw.update(self.probe.raw(descriptors, indices))
        return {m: raw[m] / self.scales[m] for m in methods}

    def save(self, directory) -> Path:
        from safetensors.numpy import save_file

        directory = Path(directory)
        probe = {} if self.probe is None else {"probe_weights": self.probe.weights}
        save_file({"mean": self.models["pooled_mahalanobis"].mean, "precision": self.models["pooled_mahalanobis"].precision,
                   "centers": self.models["patch_coreset"].centers, **probe}, str(directory / TENSORS_FILE))
        (directory / META_FILE).write_text(json.dumps(self.meta, indent=1) + "\n")
        return directory / META_FILE


def load_calibration(directory, policy_config: dict, weights_path=None, method: str | None = None) -> OodScorer:
    """The calibration in the checkpoint folder `directory`, checked against the checkpoint's
    config (and, with `weights_path`, its weights; with `method`, that it has that score);
    CalibrationError with the reason otherwise."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    from sps_driving.core.backbones.runtimes import file_sha256

    directory = Path(directory)
    meta_path, tensors_path = directory / META_FILE, directory / TENSORS_FILE
    if not meta_path.is_file() or not tensors_path.is_file():
        raise CalibrationError(f"no OOD calibration in {directory} ({META_FILE} and {TENSORS_FILE}): make one with "
                               f"`sps-driving ood calibrate --policy {directory} --cache CACHE`, or turn the OOD score off")
    try:
        meta = json.loads(meta_path.read_text())
        tensors = load_file(str(tensors_path))
    except (OSError, ValueError, SafetensorError) as exc:
        raise CalibrationError(f"OOD calibration in {directory} cannot be read: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise CalibrationError(f"{meta_path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    expected = descriptor_settings(policy_config)
    if meta.get("descriptors") != expected:
        raise CalibrationError(f"OOD calibration {meta_path} was made for other descriptors: {meta.get('descriptors')} "
                               f"against the policy's {expected}")
    if weights_path is not None and meta.get("policy_weights_sha256") != file_sha256(Path(weights_path)):
        raise CalibrationError(f"OOD calibration {meta_path} belongs to another policy (weights digest "
                               f"{str(meta.get('policy_weights_sha256'))[:12]}..., {weights_path} is "
                               f"{file_sha256(Path(weights_path))[:12]}...): calibrate it again")
    dim = expected["descriptor_dim"]
    shapes = {"mean": (dim,), "precision": (dim, dim)}
    if any(name not in tensors for name in ("mean", "precision", "centers")) \
            or any(tensors[name].shape != shape for name, shape in shapes.items()) \
            or tensors["centers"].ndim != 2 or tensors["centers"].shape[1] != dim:
        raise CalibrationError(f"{tensors_path} lacks mean [{dim}], precision [{dim}, {dim}] or centers [M, {dim}]")
    probe = None
    if "probe_weights" in tensors:
        bands, cols = meta.get("probe", {}).get("bands"), expected["grid"]["cols"]
        if not isinstance(bands, int) or not 1 <= bands <= cols or tensors["probe_weights"].shape != (bands * dim + 1, 2):
            raise CalibrationError(f"{tensors_path}: probe_weights {tensors['probe_weights'].shape} do not fit "
                                   f"{bands} bands of [{dim}] descriptors ({meta_path} 'probe')")
        probe = LanePoseProbe(tensors["probe_weights"].astype(np.float64), bands, cols)
    scales = meta.get("scales", {})
    methods = calibration_methods(probe, PEAK_METHOD in scales)
    if any(not (isinstance(scales.get(m), (int, float)) and scales[m] > 0) for m in methods):
        raise CalibrationError(f"{meta_path} needs a positive scale for each of {methods}, got {scales}")
    if method is not None and method not in methods:
        why = ("a lane-pose probe needs drives that record the lane pose" if method in PROBE_METHODS
               else "it was made before that score existed: calibrate again")
        raise CalibrationError(f"the OOD score {method} is not in the calibration in {directory} (it has {methods}: {why})")
    return OodScorer(PooledMahalanobis(tensors["mean"].astype(np.float64), tensors["precision"].astype(np.float64)),
                     PatchCoreset(tensors["centers"].astype(np.float32)), meta, probe)


class SelectionDisagreement:
    """The standard deviation (rad) of a policy's steering over `draws` other selections of one
    frame: the selection's own draws with seeds seed + 1 .. seed + draws at the frame's stamp, each
    read from the frame's descriptors of every patch, in one batch. A policy trained with SPS has
    seen such draws, so their spread is its uncertainty about this frame, not a novelty of its
    input. Zero for a dense policy (every draw keeps every patch)."""

    def __init__(self, policy, draws: int):
        from dataclasses import replace

        from sps_driving.core.selection import PatchSelector

        if draws < 2:
            raise ValueError(f"a selection disagreement needs at least 2 draws, got {draws}")
        config = policy.selector.config
        self.policy = policy
        self.selectors = [PatchSelector(replace(config, seed=config.seed + 1 + k), policy.grid) for k in range(draws)]

    def __call__(self, every_patch: np.ndarray, stamp_ns: int, state: dict | None) -> float:
        """`every_patch`: the frame's [N, D] descriptors of every patch of the policy's grid."""
        kept = [selector.select(stamp_ns) for selector in self.selectors]
        commands = self.policy.predict_batch([every_patch[indices] for indices in kept], kept, [state] * len(kept))
        return float(np.std(commands[:, 0]))

