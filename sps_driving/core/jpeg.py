"""Compressed camera frames (sensor_msgs/CompressedImage) <-> RGB arrays, without cv_bridge.

image_transport's compressed plugin writes `format` as "<raw encoding>; jpeg compressed <bgr8|mono8>"
(older drivers write just "jpeg" or "png"); OpenCV decodes JPEG and PNG to BGR, which is turned to RGB.
"""

from __future__ import annotations

import cv2
import numpy as np

from sps_driving.core.image import ImageError

FORMATS = ("jpeg", "jpg", "png")
JPEG_FORMAT = "rgb8; jpeg compressed bgr8"  # what image_transport's compressed republisher writes for an rgb8 camera


def decode_compressed(data, format_: str) -> np.ndarray:
    """uint8 [H, W, 3] RGB of a compressed frame; ImageError when it is no JPEG or PNG or is damaged."""
    if not any(name in format_.lower() for name in FORMATS):
        raise ImageError(f"unsupported compressed image format {format_!r}; supported: {', '.join(FORMATS)}")
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    bgr = cv2.imdecode(buf, cv2.IMREAD_COLOR) if buf.size else None
    if bgr is None:
        raise ImageError(f"cannot decode a {len(buf)}-byte {format_!r} frame")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def encode_jpeg(rgb: np.ndarray, quality: int) -> bytes:
    """JPEG bytes of uint8 [H, W, 3] RGB at `quality` (1..100), as the compressed republisher makes them."""
    if not 1 <= int(quality) <= 100:
        raise ValueError(f"JPEG quality must be in 1..100, got {quality}")
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:
        raise ImageError(f"cannot JPEG-encode a {rgb.shape} frame")
    return buf.tobytes()
