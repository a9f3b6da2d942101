"""Failure strips: for each failure of an in-process evaluation episode, what the policy saw in the
seconds before it, as one PNG, so a failure can be looked at rather than guessed.

A strip is the last `seconds` of camera frames before the failure, every `every_n_frames`-th one,
ending with the frame whose command preceded it; on each, the policy's kept patches outlined, the
dropped ones dimmed and the kept ones tinted by their occlusion attribution
(DrivingPolicy.attribution), captioned with the time before the failure, the steering command
(rad) and the failure kind. It is written to OUT/failures/<method>/<scenario>_seed<seed>_t<s>.png,
t the failure's time in the episode.

The policy driver keeps only the frames a strip may need: a ring buffer of `seconds` of frames
(PolicyDriver's views), emptied at each failure, since the safety driver's reset starts a new
approach. An episode writes the strips of its first `max_per_episode` failures. Settings:
config/sim.yaml, eval.failure_strips.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from sps_driving.core.overlay import frame_strip
from sps_driving.export.extractors import frame_overlay

FAILURES_FOLDER = "failures"


@dataclass(frozen=True)
class StripSettings:
    seconds: float  # s of driving before the failure
    every_n_frames: int  # frames from one strip frame to the next
    max_per_episode: int  # strips per episode at most
    height_px: int  # px, each frame's height in the strip

    @classmethod
    def from_config(cls, config: dict) -> StripSettings:
        values = config.get("eval", {}).get("failure_strips")
        if not isinstance(values, dict):
            raise ValueError("the simulator config has no eval.failure_strips (seconds, every_n_frames, max_per_episode, "
                             "height_px; see config/sim.yaml); or evaluate with --no-failure-strips")
        settings = cls(float(values["seconds"]), int(values["every_n_frames"]), int(values["max_per_episode"]),
                       int(values["height_px"]))
        if not (math.isfinite(settings.seconds) and settings.seconds > 0) or min(
                settings.every_n_frames, settings.max_per_episode, settings.height_px) < 1:
            raise ValueError(f"eval.failure_strips needs seconds > 0 and every_n_frames, max_per_episode, height_px >= 1, "
                             f"got {values}")
        return settings

    def history_frames(self, control_rate_hz: float) -> int:
        """Frames the driver keeps: `seconds` of them at the control rate."""
        return max(1, round(self.seconds * control_rate_hz))


def strips_folder(out: Path, method: str) -> Path:
    """OUT/failures/<method>, the method name made safe for a folder name (e.g. "SPS-50")."""
    return Path(out) / FAILURES_FOLDER / (re.sub(r"[^A-Za-z0-9._-]+", "_", method).strip("_") or "policy")


class FailureStrips:
    """Writes the strips of a `driver`'s (sps_driving.sim.episodes.PolicyDriver, keeping views)
    failures into `folder`; `episode` gives each episode's failure callback for drive_episode."""

    def __init__(self, folder: Path, settings: StripSettings, driver):
        if driver.views is None:
            raise ValueError("the driver keeps no frames to draw failure strips from (view_history 0)")
        self.folder, self.settings, self.driver = Path(folder), settings, driver
        self.drawer = frame_overlay(driver.extraction.settings.config, driver.policy.grid)

    def episode(self, scenario: str, seed: int) -> Callable:
        """The on_failure callback of one episode (drive_episode): (frame, step result) -> None."""
        self.driver.views.clear()
        written = []

        def on_failure(frame, step) -> None:
            views = list(self.driver.views)
            self.driver.views.clear()  # the reset starts a new approach: the next strip begins after it
            if len(written) >= self.settings.max_per_episode or not views:
                return
            time_s = frame.world.time
            kind = ", ".join(failure.value for failure in step.failures)
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"{scenario}_seed{seed}_t{time_s:.1f}.png"
            strip = self.strip(views, time_s, kind)
            if not cv2.imwrite(str(path), cv2.cvtColor(strip, cv2.COLOR_RGB2BGR)):
                raise OSError(f"could not write the failure strip {path}")
            written.append(path)

        return on_failure

    def strip(self, views: list, failure_time_s: float, kind: str) -> np.ndarray:
        """uint8 RGB strip of every every_n_frames-th view, ending with the last one."""
        chosen = views[::-1][:: self.settings.every_n_frames][::-1]
        frames, captions = [], []
        for view in chosen:
            attribution = self.driver.policy.attribution(view.descriptors, view.indices, view.state)
            frames.append(self.drawer.draw(view.image, view.indices, attribution))
            captions.append(f"{view.time_s - failure_time_s:+.1f} s  steer {view.steering:+.3f} rad\n{kind}")
        return frame_strip(frames, captions, self.settings.height_px)
