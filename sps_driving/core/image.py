"""Raw camera image <-> RGB array conversion, without cv_bridge (PyPI's is broken on numpy 2).

Works on the fields of a sensor_msgs/Image, whether it came from rclpy or from a rosbag2 read
with rosbags, so nodes, replay and the feature-cache writer share one validated decoder.
"""

from __future__ import annotations

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


def normalized_pixels(image_rgb: np.ndarray, size: tuple[int, int], resize: str, mean, std) -> np.ndarray:
    """A backbone's input: uint8 HxWx3 RGB -> float32 [1, 3, height, width] for size = (height,
    width), resized (the aspect is not kept), scaled to [0, 1] and normalized per channel."""
    if not isinstance(image_rgb, np.ndarray) or image_rgb.dtype != np.uint8:
        raise ImageError(f"expected a uint8 numpy RGB image, got {getattr(image_rgb, 'dtype', type(image_rgb))}")
    if image_rgb.ndim != 3 or image_rgb.shape[2] != 3 or min(image_rgb.shape[:2]) < 1:
        raise ImageError(f"expected an HxWx3 RGB image, got shape {image_rgb.shape}")
    height, width = size
    resized = cv2.resize(image_rgb, (width, height), interpolation=RESIZE[resize])
    pixels = (resized.astype(np.float32) / 255.0 - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1)[None])
