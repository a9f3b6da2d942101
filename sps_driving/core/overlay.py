"""What the policy sees, drawn on the camera frame: the kept patches outlined, the dropped ones
dimmed, and each kept patch tinted by its attribution (how much the command moves without it).

ROS-free; the policy node publishes these frames when asked, and evaluation writes a strip of them
for every failed episode.
"""

from __future__ import annotations

import cv2
import numpy as np

from sps_driving.core.image import patch_rectangles

DROPPED_DIM = 0.45  # brightness factor of patches the selection dropped (unitless)
KEPT_OUTLINE_RGB = (255, 255, 255)
ATTRIBUTION_RGB = (255, 40, 0)  # tint of the most influential patch of a frame
MAX_TINT = 0.7  # opacity of the tint on the most influential patch (unitless)


def draw_selection(image_rgb: np.ndarray, rectangles: np.ndarray, kept: np.ndarray,
                   attribution: np.ndarray | None = None) -> np.ndarray:
    """A copy of uint8 HxWx3 `image_rgb` with patch `rectangles` (float [N, 4] left, top, right,
    bottom px, row-major over the grid; core.image.patch_rectangles) drawn: patches not in `kept`
    (int indices [k]) dimmed, kept ones outlined, and, with `attribution` (float [k], one per kept
    index, any sign), each kept patch tinted in proportion to |attribution| / max |attribution|."""
    if image_rgb.dtype != np.uint8 or image_rgb.ndim != 3 or image_rgb.shape[2] != 3:
        raise ValueError(f"expected a uint8 HxWx3 RGB image, got {image_rgb.dtype} {image_rgb.shape}")
    kept = np.asarray(kept, dtype=np.int64).reshape(-1)
    if kept.size and (kept.min() < 0 or kept.max() >= len(rectangles)):
        raise ValueError(f"kept patch indices must lie in [0, {len(rectangles)})")
    if attribution is not None:
        attribution = np.asarray(attribution, dtype=np.float64).reshape(-1)
        if attribution.shape != kept.shape:
            raise ValueError(f"{attribution.size} attributions for {kept.size} kept patches")
    boxes = np.round(np.asarray(rectangles, dtype=np.float64)).astype(np.int64)
    height, width = image_rgb.shape[:2]
    boxes[:, [0, 2]] = np.clip(boxes[:, [0, 2]], 0, width)
    boxes[:, [1, 3]] = np.clip(boxes[:, [1, 3]], 0, height)

    # Light reaching each pixel: 1 inside kept patches, DROPPED_DIM inside dropped ones, 1 outside
    # the grid (the part of the frame the region of interest leaves out stays as it is).
    light = np.ones((height, width), np.float32)
    is_kept = np.zeros(len(boxes), bool)
    is_kept[kept] = True
    for (x0, y0, x1, y1), keep in zip(boxes, is_kept):
        if not keep:
            light[y0:y1, x0:x1] = DROPPED_DIM
    out = image_rgb.astype(np.float32) * light[..., None]

    if attribution is not None and kept.size:
        strength = np.abs(attribution)
        peak = strength.max()
        if np.isfinite(peak) and peak > 0:
            tint = np.asarray(ATTRIBUTION_RGB, np.float32)
            for index, share in zip(kept, strength / peak):
                x0, y0, x1, y1 = boxes[index]
                alpha = MAX_TINT * float(share)
                out[y0:y1, x0:x1] = (1 - alpha) * out[y0:y1, x0:x1] + alpha * tint
    out = np.clip(out, 0, 255).astype(np.uint8)
    for x0, y0, x1, y1 in boxes[kept]:
        if x1 > x0 and y1 > y0:
            cv2.rectangle(out, (int(x0), int(y0)), (int(x1) - 1, int(y1) - 1), KEPT_OUTLINE_RGB, 1)
    return out


class FrameOverlay:
    """A policy's view drawn on camera frames of any size: its patches lie where its extraction
    settings put them (the `roi` resized to `input_size` (height, width) px, a `grid_shape`
    (rows, cols) grid over it); their rectangles are computed once per frame size."""

    def __init__(self, roi, input_size: tuple[int, int], grid_shape: tuple[int, int]):
        self.roi, self.input_size, self.grid_shape = roi, tuple(input_size), tuple(grid_shape)
        self._rectangles: dict[tuple[int, int], np.ndarray] = {}
        self.rectangles(self.input_size)  # refuses a grid that does not tile the input, or a bad roi

    def rectangles(self, frame_size: tuple[int, int]) -> np.ndarray:
        """float [N, 4] patch rectangles on a frame of frame_size (height, width) px (core.image.patch_rectangles)."""
        key = (int(frame_size[0]), int(frame_size[1]))
        if key not in self._rectangles:
            self._rectangles[key] = patch_rectangles(key, self.roi, self.input_size, self.grid_shape)
        return self._rectangles[key]

    def draw(self, image_rgb: np.ndarray, kept: np.ndarray, attribution: np.ndarray | None = None) -> np.ndarray:
        """draw_selection on this frame's patch rectangles."""
        return draw_selection(image_rgb, self.rectangles(image_rgb.shape[:2]), kept, attribution)


CAPTION_LINE_PX = 16  # px between caption lines


def frame_strip(frames: list[np.ndarray], captions: list[str], height: int = 160) -> np.ndarray:
    """Frames side by side, each scaled to `height` px with its caption (lines split at "\n")
    burnt in at the top left: a failure's last seconds in one image."""
    if not frames or len(frames) != len(captions):
        raise ValueError(f"{len(frames)} frames and {len(captions)} captions: need one caption per frame, at least one")
    tiles = []
    for frame, caption in zip(frames, captions):
        scale = height / frame.shape[0]
        tile = cv2.resize(frame, (max(1, round(frame.shape[1] * scale)), height), interpolation=cv2.INTER_AREA)
        for line, text in enumerate(caption.split("\n")):
            origin = (4, 14 + line * CAPTION_LINE_PX)
            cv2.putText(tile, text, origin, cv2.FONT_HERSHEY_SIMPLEX, 0.42, (0, 0, 0), 3, cv2.LINE_AA)
            cv2.putText(tile, text, origin, cv2.FONT_HERSHEY_SIMPLEX, 0.42, (255, 255, 255), 1, cv2.LINE_AA)
        tiles.append(tile)
    return np.concatenate(tiles, axis=1)
