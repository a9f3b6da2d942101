"""Frame history for policies that read the last frames (the patch policy), ROS-free and torch-free.

A window is the newest frame and up to T - 1 earlier ones at the frame stride: for k = 1 .. T - 1
the frame whose camera stamp is nearest (newest stamp - k * stride), if within the stride
tolerance. The world steps at 10 Hz and the car's camera runs at 30 Hz: at a stride of 0.1 s a
window takes every world frame and every third camera frame, the same span of time on both.

`FrameHistory` keeps the frames of the last window span and gives each new frame its window:

- a frame whose stamp is not after the previous frame's (a restarted bag, a new episode) or
  that follows it by more than `max_gap_s` (a stalled stream) starts a new history: counted as
  `reset_backwards` or `reset_gap`;
- a stride slot without a frame within the tolerance (a frame dropped upstream) ends the window
  there, so a window never skips a slot: counted as `missing_frame`; a window shorter than T only
  because the history is (after a start or reset) as `short_window`.

Training forms its windows with the same class over each drive of the feature cache in stamp
order (`frame_windows`), so a window never crosses drives or stamp gaps, and the policy node,
replay, the in-process and the graph evaluation step the same one frame by frame.

Selection shared across the window (setting `shared_selection`): every frame of a block of
T * stride seconds (from stamp 0) keeps the subset the policy's selection draws for the block's
first stamp (`SharedWindowSelector`), so a window sees one subset, or two where it straddles a
block boundary. By default each frame draws its own (SPS), and a window sees up to T subsets.
"""

from __future__ import annotations

import bisect
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from sps_driving.core.grid import PatchGrid
from sps_driving.core.selection import PatchSelector, SelectionConfig

# The architecture that reads windows of frames (sps_driving.core.policies.patch_policy).
PATCH_POLICY = "patch_policy"
# Its window settings, besides those of its transformer (config "policy"; values: config/train.yaml).
WINDOW_SETTINGS = ("window_frames", "frame_stride_s", "stride_tolerance_s", "max_gap_s", "shared_selection")
COUNTS = ("frames", "reset_backwards", "reset_gap", "missing_frame", "short_window")
COUNTER_PREFIX = "history_"  # of these counts among a policy node's counters (the replay report reads them)


@dataclass(frozen=True)
class HistorySettings:
    window_frames: int  # T: frames in a window, the newest included
    frame_stride_s: float  # s between a window's frames
    stride_tolerance_s: float  # s; a frame this close to a stride slot fills it
    max_gap_s: float  # s; a longer gap between consecutive frames starts a new history

    def __post_init__(self) -> None:
        if isinstance(self.window_frames, bool) or int(self.window_frames) != self.window_frames or self.window_frames < 1:
            raise ValueError(f"window_frames must be an integer >= 1, got {self.window_frames!r}")
        object.__setattr__(self, "window_frames", int(self.window_frames))
        for name in ("frame_stride_s", "stride_tolerance_s", "max_gap_s"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if not (math.isfinite(self.frame_stride_s) and self.frame_stride_s > 0):
            raise ValueError(f"frame_stride_s must be a positive number of seconds, got {self.frame_stride_s}")
        # Below half the stride, at most one slot can claim a frame.
        if not 0 <= self.stride_tolerance_s < self.frame_stride_s / 2:
            raise ValueError(f"stride_tolerance_s must be in [0, frame_stride_s / 2), got {self.stride_tolerance_s}")
        if not (math.isfinite(self.max_gap_s) and self.max_gap_s > 0):
            raise ValueError(f"max_gap_s must be a positive number of seconds, got {self.max_gap_s}")

    @property
    def stride_ns(self) -> int:
        return int(round(self.frame_stride_s * 1e9))

    @property
    def tolerance_ns(self) -> int:
        return int(round(self.stride_tolerance_s * 1e9))

    @property
    def max_gap_ns(self) -> int:
        return int(round(self.max_gap_s * 1e9))

    @property
    def block_ns(self) -> int:
        """The period of a selection shared across the window: T strides."""
        return self.window_frames * self.stride_ns


def history_settings(config: dict) -> HistorySettings | None:
    """The window of a policy config (a checkpoint's config.json), None for a single-frame policy."""
    if config.get("architecture") != PATCH_POLICY:
        return None
    policy = config["policy"]
    return HistorySettings(policy["window_frames"], policy["frame_stride_s"], policy["stride_tolerance_s"],
                           policy["max_gap_s"])


class FrameHistory:
    """The recent frames of one stream by camera stamp (ns); `push` gives each frame its window
    (module docstring). `counts` holds how many frames it took and its resets, cut and short windows."""

    def __init__(self, settings: HistorySettings):
        self.settings = settings
        self._stamps: list[int] = []
        self._items: list[Any] = []
        self._first_ns: int | None = None  # the stamp the stream (re)started with
        self.counts = dict.fromkeys(COUNTS, 0)

    def __len__(self) -> int:
        return len(self._stamps)

    def reset(self) -> None:
        """Forget every frame (a new episode); not counted as a reset of the stream."""
        self._stamps.clear()
        self._items.clear()
        self._first_ns = None

    def push(self, stamp_ns: int, item: Any) -> list:
        """Add the frame stamped `stamp_ns`; returns its window's items, oldest first, `item` last."""
        stamp_ns = int(stamp_ns)
        s = self.settings
        if self._stamps:
            if stamp_ns <= self._stamps[-1]:
                self.counts["reset_backwards"] += 1
                self.reset()
            elif stamp_ns - self._stamps[-1] > s.max_gap_ns:
                self.counts["reset_gap"] += 1
                self.reset()
        self.counts["frames"] += 1
        self._first_ns = stamp_ns if self._first_ns is None else self._first_ns
        # What a later window can still use: the last (T - 1) strides, and the tolerance.
        oldest_kept = stamp_ns - (s.window_frames - 1) * s.stride_ns - s.tolerance_ns
        drop = bisect.bisect_left(self._stamps, oldest_kept)
        del self._stamps[:drop], self._items[:drop]
        window = [item]
        limit = len(self._stamps)  # slots are filled from frames older than the one filled last
        for k in range(1, s.window_frames):
            slot = stamp_ns - k * s.stride_ns
            found = self._nearest(slot, limit)
            if found is None:
                if self._first_ns < slot - s.tolerance_ns:
                    self.counts["missing_frame"] += 1  # the stream was there, the frame was not
                else:
                    self.counts["short_window"] += 1
                break
            window.append(self._items[found])
            limit = found
        self._stamps.append(stamp_ns)
        self._items.append(item)
        return window[::-1]

    def _nearest(self, slot_ns: int, limit: int) -> int | None:
        """Index (< limit) of the stored frame nearest `slot_ns`, if within the tolerance."""
        right = bisect.bisect_left(self._stamps, slot_ns, 0, limit)
        candidates = [i for i in (right - 1, right) if 0 <= i < limit]
        if not candidates:
            return None
        best = min(candidates, key=lambda i: abs(self._stamps[i] - slot_ns))
        return best if abs(self._stamps[best] - slot_ns) <= self.settings.tolerance_ns else None


def frame_windows(stamps: np.ndarray, streams: np.ndarray, settings: HistorySettings,
                  usable: np.ndarray | None = None) -> np.ndarray:
    """int64 [F, T]: for each of F frames (their camera `stamps` ns and `streams`, e.g. the feature
    cache's source ids) the frame indices of its window, oldest first, -1 after its last frame (its
    own index); the rows of frames not `usable` (bool [F]) are all -1. Each stream's usable frames
    run through a `FrameHistory` in stamp order, so a window never crosses streams or gaps."""
    stamps = np.asarray(stamps, dtype=np.int64)
    streams = np.asarray(streams)
    usable = np.ones(len(stamps), dtype=bool) if usable is None else np.asarray(usable, dtype=bool)
    windows = np.full((len(stamps), settings.window_frames), -1, dtype=np.int64)
    for stream in np.unique(streams[usable]):
        frames = np.flatnonzero(usable & (streams == stream))
        history = FrameHistory(settings)
        for frame in frames[np.argsort(stamps[frames], kind="stable")]:
            window = history.push(int(stamps[frame]), int(frame))
            windows[frame, : len(window)] = window
    return windows


class SharedWindowSelector(PatchSelector):
    """The selection of `config` shared by every frame of a block of `block_ns` (module docstring):
    a frame keeps what `PatchSelector` selects for its block's first stamp."""

    def __init__(self, config: SelectionConfig, grid: PatchGrid, block_ns: int):
        super().__init__(config, grid)
        if block_ns < 1:
            raise ValueError(f"a shared selection's block must be at least 1 ns, got {block_ns}")
        self.block_ns = int(block_ns)

    def select(self, stamp_ns: int) -> np.ndarray:
        if isinstance(stamp_ns, numbers.Integral) and not isinstance(stamp_ns, bool) and stamp_ns >= 0:
            stamp_ns = int(stamp_ns) - int(stamp_ns) % self.block_ns
        return super().select(stamp_ns)  # which refuses what is not a stamp


def policy_selector(config: dict, grid: PatchGrid) -> PatchSelector:
    """The selection of a policy config: shared across its window when a patch policy says so."""
    selection = SelectionConfig.from_dict(config["selection"])
    settings = history_settings(config)
    if settings is not None and config["policy"]["shared_selection"]:
        return SharedWindowSelector(selection, grid, settings.block_ns)
    return PatchSelector(selection, grid)


def window_coverage(selector: PatchSelector, settings: HistorySettings, windows: int = 200,
                    start_ns: int = 1_700_000_000_000_000_000) -> float:
    """The mean fraction of the grid's patch positions that a full window of frames at the stride
    keeps in at least one of its frames, over `windows` consecutive windows (one per stride) of the
    selector's own per-stamp selection: how much of the image a window reveals at the selector's
    rate (SPS keeps rate * N per frame; T independent frames reveal 1 - (1 - rate)^T on average)."""
    stride = settings.stride_ns
    frames = windows + settings.window_frames - 1
    masks = selector.stamp_masks([start_ns + i * stride for i in range(frames)])
    revealed = [masks[i:i + settings.window_frames].any(axis=0).mean() for i in range(windows)]
    return float(np.mean(revealed))
