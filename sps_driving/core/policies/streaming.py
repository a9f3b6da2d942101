"""Stepping a loaded policy one camera frame at a time: `StreamingPolicy`, the one way the policy
node, replay, the in-process and the graph evaluation run a patch policy, whose window of frames
a `FrameHistory` keeps (sps_driving.core.history)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from sps_driving.core.history import COUNTER_PREFIX, FrameHistory, history_settings
from sps_driving.core.policies.checkpoint import DrivingPolicy
from sps_driving.core.policies.patch_policy import window_tensors
from sps_driving.core.state import state_vector


class StreamingPolicy:
    """A loaded policy fed one camera frame at a time: a patch policy reads the window its
    `FrameHistory` gives the frame (sps_driving.core.history), any other policy the frame alone.
    `counts` are the history's (module history: frames, resets by reason, cut and short windows),
    empty for a single-frame policy."""

    def __init__(self, policy: DrivingPolicy):
        self.policy = policy
        settings = history_settings(policy.config)
        self.history = None if settings is None else FrameHistory(settings)

    @property
    def counts(self) -> dict:
        return {} if self.history is None else {COUNTER_PREFIX + k: v for k, v in self.history.counts.items()}

    def describe(self) -> str:
        if self.history is None:
            return "one frame per command"
        s = self.history.settings
        return (f"windows of {s.window_frames} frame(s) {s.frame_stride_s:g} s apart (tolerance {s.stride_tolerance_s:g} s, "
                f"a gap over {s.max_gap_s:g} s restarts the history)")

    def reset(self) -> None:
        """A new episode: forget the frames so far."""
        if self.history is not None:
            self.history.reset()

    def _frame(self, descriptors, indices, state) -> tuple:
        """A frame as the history keeps it: (descriptors, indices, state vector or None); ValueError
        for one the policy cannot take."""
        descriptors, indices = self.policy.checked_frame(descriptors, indices)
        return descriptors, indices, state_vector(self.policy.state_inputs, state) if self.policy.state_inputs else None

    @torch.no_grad()
    def _command(self, window: list) -> tuple[float, float]:
        out = self.policy.module.forward_windows(*window_tensors(window, self.policy.descriptor_dim, self.policy.device))
        steering, throttle = out[0, -1].cpu().numpy().astype(np.float64)
        if not (np.isfinite(steering) and np.isfinite(throttle)):
            raise ValueError("policy produced a non-finite command")
        return float(steering), float(throttle)

    def step(self, stamp_ns: int, descriptors: np.ndarray, indices: np.ndarray,
             state: Mapping[str, float] | None = None) -> tuple[float, float]:
        """(steering rad, throttle) for the frame stamped `stamp_ns` (its kept descriptors [k, D] at
        patch `indices` [k], and its state for a policy that reads one). A frame the policy cannot
        take (ValueError) is not added to the history."""
        if self.history is None:
            return self.policy.predict(descriptors, indices, state)
        frame = self._frame(descriptors, indices, state)
        return self._command(self.history.push(stamp_ns, frame))

    def predict_full_window(self, descriptors: np.ndarray, indices: np.ndarray,
                            state: Mapping[str, float] | None = None) -> tuple[float, float]:
        """The command for a frame whose window holds T frames like it (for timing: the work of
        one step with a full history); a single-frame policy's `predict`."""
        if self.history is None:
            return self.policy.predict(descriptors, indices, state)
        return self._command([self._frame(descriptors, indices, state)] * self.history.settings.window_frames)
