"""A calibrated tiny checkpoint for the OOD score's tests: training frames whose patches lie near a
few prototypes, both scores fitted on three quarters of them and scaled on the rest."""

import numpy as np
from samples import tiny_policy

from sps_driving.core.backbones.runtimes import file_sha256
from sps_driving.core.ood import (
    FORMAT,
    PEAK_METHOD,
    OodScorer,
    PatchCoreset,
    PooledMahalanobis,
    calibration_methods,
    descriptor_settings,
)
from sps_driving.core.policies.checkpoint import WEIGHTS_FILE, read_policy_config

DIM = 16
K = 32  # kept patches of a frame (rate 0.5 of the tiny policy's 8 x 8 grid)


def training_frames(rng, frames=400):
    prototypes = rng.standard_normal((8, DIM)).astype(np.float32) * 3.0
    which = rng.integers(len(prototypes), size=(frames, K))
    return prototypes[which] + 0.3 * rng.standard_normal((frames, K, DIM)).astype(np.float32)


def fitted(rng, frames) -> OodScorer:
    fit, held = frames[: len(frames) * 3 // 4], frames[len(frames) * 3 // 4:]
    mahalanobis = PooledMahalanobis.fit(fit.mean(axis=1), shrinkage=0.1)
    coreset = PatchCoreset.fit(fit.reshape(-1, DIM), 64, rng)
    coreset_raw = [coreset.raw(f) for f in held]
    scales = {"pooled_mahalanobis": float(np.quantile([mahalanobis.raw(f) for f in held], 0.99)),
              **{m: float(np.quantile([r[m] for r in coreset_raw], 0.99)) for m in ("patch_coreset", PEAK_METHOD)}}
    return OodScorer(mahalanobis, coreset, {"scales": scales})


def calibrated_checkpoint(directory, scorer: OodScorer, **policy):
    """A tiny policy at `directory` with `scorer` saved as its calibration; (folder, its config)."""
    ckpt = tiny_policy(directory, dim=DIM, **policy)
    config = read_policy_config(ckpt)
    scorer.meta.update(format=FORMAT, descriptors=descriptor_settings(config),
                       policy_weights_sha256=file_sha256(ckpt / WEIGHTS_FILE))
    scorer.save(ckpt)
    return ckpt, config


def calibration_of(ckpt, scale: float = 1.0) -> None:
    """A calibration of `ckpt` for its own descriptors (an identity Mahalanobis, a random coreset),
    each score divided by `scale`: a tiny one puts every frame far above any threshold."""
    config = read_policy_config(ckpt)
    dim = int(config["descriptor_dim"])
    rng = np.random.default_rng(0)
    meta = {"format": FORMAT, "descriptors": descriptor_settings(config), "scales": dict.fromkeys(calibration_methods(None), scale),
            "policy_weights_sha256": file_sha256(ckpt / WEIGHTS_FILE)}
    scorer = OodScorer(PooledMahalanobis(np.zeros(dim), np.eye(dim)), PatchCoreset(rng.standard_normal((8, dim)).astype(np.float32)),
                       meta)
    scorer.save(ckpt)
