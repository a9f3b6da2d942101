"""Raw camera image <-> RGB array conversion, without cv_bridge (PyPI's is broken on numpy 2),
and a backbone's input: the frame's region of interest, resized and normalized.

Works on the fields of a sensor_msgs/Image, whether it came from rclpy or from a rosbag2 read
with rosbags, so nodes, replay and the feature-cache writer share one validated decoder.

Region of interest (the `roi` extraction setting): null (the whole frame) or [top, bottom, left,
right], fractions of the frame's height (top, bottom) and width (left, right), 0 <= top < bottom
<= 1 and 0 <= left < right <= 1. Its pixel edges on an H x W frame are the fractions times the
frame's size rounded half up, computed exactly on the fractions as written in decimal
(`roi_box`): rows [round(top H), round(bottom H)), columns [round(left W), round(right W)). So
the same fractions crop the same pixels of any frame of a size, and the same region, to the
rounding, of a frame rendered at another size.
"""

from __future__ import annotations

import math
from fractions import Fraction
from numbers import Real

import cv2
import numpy as np

# encoding -> (channels, conversion to RGB or None when already RGB)
_DECODERS = {
    "rgb8": (3, None),
    "bgr8": (3, cv2.COLOR_BGR2RGB),
    "rgba8": (4, cv2.COLOR_RGBA2RGB),
    "bgra8": (4, cv2.COLOR_BGRA2RGB),
    "mono8": (1, cv2.COLOR_GRAY2RGB),
    # Bayer patterns as GigE machine-vision cameras send them. OpenCV names the pattern by the
    # second row's first two pixels, so ROS "rggb" is OpenCV "BG".
    "bayer_rggb8": (1, cv2.COLOR_BayerBG2RGB),
    "bayer_bggr8": (1, cv2.COLOR_BayerRG2RGB),
    "bayer_gbrg8": (1, cv2.COLOR_BayerGR2RGB),
    "bayer_grbg8": (1, cv2.COLOR_BayerGB2RGB),
}
ENCODINGS = tuple(_DECODERS)
_ENCODERS = {"rgb8": None, "bgr8": cv2.COLOR_RGB2BGR, "mono8": cv2.COLOR_RGB2GRAY}
RESIZE = {"cubic": cv2.INTER_CUBIC, "area": cv2.INTER_AREA}  # backbone preprocessing interpolations


class ImageError(ValueError):
    """A frame that cannot be decoded: callers drop and count it."""


def to_rgb(data, height: int, width: int, encoding: str, step: int) -> np.ndarray:
    """Decode raw image bytes to a contiguous uint8 [height, width, 3] RGB array."""
    if encoding not in _DECODERS:
        raise ImageError(f"unsupported image encoding {encoding!r}; supported: {', '.join(ENCODINGS)}")
    channels, conversion = _DECODERS[encoding]
    if height <= 0 or width <= 0:
        raise ImageError(f"empty image {width}x{height}")
    row_bytes = width * channels
    if step < row_bytes:
        raise ImageError(f"step {step} is shorter than a {encoding} row of width {width} ({row_bytes} bytes)")
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    if buf.size < step * (height - 1) + row_bytes:
        raise ImageError(f"{buf.size} bytes is too short for a {width}x{height} {encoding} image with step {step}")
    rows = np.lib.stride_tricks.as_strided(buf, shape=(height, row_bytes), strides=(step, 1))
    pixels = rows.reshape(height, width, channels) if channels > 1 else rows.reshape(height, width)
    if conversion is None:
        return np.ascontiguousarray(pixels)
    return cv2.cvtColor(np.ascontiguousarray(pixels), conversion)


def from_rgb(rgb: np.ndarray, encoding: str = "rgb8") -> tuple[bytes, int]:
    """Encode a uint8 [H, W, 3] RGB array; returns (data, step)."""
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ImageError(f"expected uint8 [H, W, 3] RGB, got {rgb.dtype} {rgb.shape}")
    if encoding not in _ENCODERS:
        raise ImageError(f"cannot encode to {encoding!r}; supported: {', '.join(_ENCODERS)}")
    conversion = _ENCODERS[encoding]
    out = np.ascontiguousarray(rgb if conversion is None else cv2.cvtColor(rgb, conversion))
    return out.tobytes(), out.strides[0]


def check_roi(roi) -> list[float] | None:
    """`roi` validated: None (the whole frame) or [top, bottom, left, right] as floats, fractions
    of the frame's height and width with 0 <= top < bottom <= 1 and 0 <= left < right <= 1."""
    if roi is None:
        return None
    expected = ("roi must be null (the whole frame) or [top, bottom, left, right]: fractions of the frame's "
                "height (top, bottom) and width (left, right), 0 <= top < bottom <= 1 and 0 <= left < right <= 1")
    if isinstance(roi, (str, bytes)) or not hasattr(roi, "__len__") or len(roi) != 4:
        raise ValueError(f"{expected}; got {roi!r}")
    if not all(isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v) for v in roi):
        raise ValueError(f"{expected}; got {roi!r} (not four finite numbers)")
    top, bottom, left, right = (float(v) for v in roi)
    if not (0.0 <= top < bottom <= 1.0 and 0.0 <= left < right <= 1.0):
        raise ValueError(f"{expected}; got {roi!r}")
    return [top, bottom, left, right]


def _edge(fraction: float, size: int) -> int:
    """round(fraction * size), halves up, exact on the fraction's decimal digits."""
    return math.floor(Fraction(repr(fraction)) * size + Fraction(1, 2))


def roi_box(frame_height: int, frame_width: int, roi) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) px of `roi` on a frame of that size: rows top..bottom - 1 and
    columns left..right - 1 are kept (the rounding of the module docstring). ImageError when the
    region has no pixel on this frame."""
    roi = check_roi(roi)
    if roi is None:
        return 0, frame_height, 0, frame_width
    top, bottom = (_edge(f, frame_height) for f in roi[:2])
    left, right = (_edge(f, frame_width) for f in roi[2:])
    if bottom <= top or right <= left:
        raise ImageError(f"roi {roi} keeps no pixel of a {frame_width}x{frame_height} frame")
    return top, bottom, left, right


def patch_rectangles(frame_size: tuple[int, int], roi, input_size: tuple[int, int],
                     grid_shape: tuple[int, int]) -> np.ndarray:
    """Where each patch of the backbone's grid comes from in the camera frame: float64 [N, 4]
    (left, top, right, bottom) px, row-major over the grid (patch j = row * cols + col), in pixel
    edge coordinates (pixel (r, c) covers [c, c + 1) x [r, r + 1)). frame_size and input_size are
    (height, width) px; the frame's `roi` is resized to input_size, whose grid_shape (rows, cols)
    patches each cover input_size / grid_shape px."""
    rows, cols = (int(v) for v in grid_shape)
    in_height, in_width = (int(v) for v in input_size)
    if rows < 1 or cols < 1 or in_height % rows or in_width % cols:
        raise ValueError(f"a {rows}x{cols} patch grid does not tile a {in_width}x{in_height} input")
    top, bottom, left, right = roi_box(int(frame_size[0]), int(frame_size[1]), roi)
    ys = top + (bottom - top) * np.arange(rows + 1) / rows  # patch row edges in frame px
    xs = left + (right - left) * np.arange(cols + 1) / cols
    r, c = np.divmod(np.arange(rows * cols), cols)
    return np.stack([xs[c], ys[r], xs[c + 1], ys[r + 1]], axis=1)


def normalized_pixels(image_rgb: np.ndarray, size: tuple[int, int], resize: str, mean, std, roi=None) -> np.ndarray:
    """A backbone's input: uint8 HxWx3 RGB -> float32 [1, 3, height, width] for size = (height,
    width): the frame's `roi` (None: all of it; see the module docstring) resized to size (the
    aspect is not kept), scaled to [0, 1] and normalized per channel."""
    if not isinstance(image_rgb, np.ndarray) or image_rgb.dtype != np.uint8:
        raise ImageError(f"expected a uint8 numpy RGB image, got {getattr(image_rgb, 'dtype', type(image_rgb))}")
    if image_rgb.ndim != 3 or image_rgb.shape[2] != 3 or min(image_rgb.shape[:2]) < 1:
        raise ImageError(f"expected an HxWx3 RGB image, got shape {image_rgb.shape}")
    if roi is not None:
        top, bottom, left, right = roi_box(*image_rgb.shape[:2], roi)
        image_rgb = np.ascontiguousarray(image_rgb[top:bottom, left:right])
    height, width = size
    resized = cv2.resize(image_rgb, (width, height), interpolation=RESIZE[resize])
    pixels = (resized.astype(np.float32) / 255.0 - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1)[None])
