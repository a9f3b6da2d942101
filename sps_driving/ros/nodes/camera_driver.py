"""camera_driver: frames from a camera, a video file or an image folder, at a fixed rate.

`source` is a V4L2 device ("/dev/video0" or "0"), a GStreamer pipeline (contains "!", e.g. "aravissrc !
videoconvert ! appsink" for the GigE Blackfly), a video file, or a folder of images (sorted by
name). Publishes sensor_msgs/Image (rgb8, resized to width x height) and a CameraInfo with the same
stamp and frame_id. A device or pipeline that stops delivering is reopened every
`reconnect_interval_s`; each tick without a frame is a dropped frame, counted in its status on /diagnostics.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import cv2
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.node import Node
from sensor_msgs.msg import CameraInfo, Image

from sps_driving.core import topics
from sps_driving.ros import msgs
from sps_driving.ros.nodes.common import Param, declare, now_ns, run

PARAMETERS = {
    "source": Param("/dev/video0", 'V4L2 device (path or index), GStreamer pipeline (contains "!"), video file or image folder'),
    "rate_hz": Param(30.0, "frames published per second (the BFS-PGE-23S3C runs at 30 fps)", "Hz", above=0.0),
    "frame_id": Param("camera", "TF frame of the camera"),
    "width": Param(960, "published image width (frames of another size are resized)", "px", min=1),
    "height": Param(600, "published image height", "px", min=1),
    "hfov_deg": Param(130.0, "horizontal field of view, for CameraInfo intrinsics", "deg", above=0.0, below=180.0),
    "loop": Param(False, "restart a video file or image folder at its end"),
    "reconnect_interval_s": Param(1.0, "time without frames before the device or pipeline is reopened", "s", min=0.0),
}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm")


class FolderSource:
    def __init__(self, folder: Path, loop: bool):
        self.files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not self.files:
            raise ValueError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {folder}")
        self.loop = loop
        self.position = 0

    def read(self):
        if self.position >= len(self.files):
            if not self.loop:
                return None
            self.position = 0
        path = self.files[self.position]
        self.position += 1
        return cv2.imread(str(path), cv2.IMREAD_COLOR)

    def finished(self) -> bool:
        return not self.loop and self.position >= len(self.files)


def opencv_has_gstreamer() -> bool:
    return re.search(r"GStreamer:\s*YES", cv2.getBuildInformation()) is not None


class CaptureSource:
    """OpenCV VideoCapture of a device index, a GStreamer pipeline or a video file."""

    def __init__(self, source: str, loop: bool, width: int, height: int):
        if "!" in source and not opencv_has_gstreamer():
            raise ValueError(
                "a GStreamer pipeline needs an OpenCV built with GStreamer (the ROS distro's python3-opencv is; "
                "the PyPI opencv-python wheels are not)"
            )
        self.source, self.loop, self.width, self.height = source, loop, width, height
        self.is_file = Path(source).is_file()
        self.capture = None
        self.open()

    def open(self) -> bool:
        if self.capture is not None:
            self.capture.release()
        if self.source.isdigit() or self.source.startswith("/dev/video"):
            device = int(self.source) if self.source.isdigit() else self.source
            self.capture = cv2.VideoCapture(device, cv2.CAP_V4L2)
            self.capture.set(cv2.CAP_PROP_FRAME_WIDTH, self.width)
            self.capture.set(cv2.CAP_PROP_FRAME_HEIGHT, self.height)
        elif "!" in self.source:
            self.capture = cv2.VideoCapture(self.source, cv2.CAP_GSTREAMER)
        else:
            self.capture = cv2.VideoCapture(self.source)
        return self.capture.isOpened()

    def read(self):
        ok, frame = self.capture.read() if self.capture.isOpened() else (False, None)
        if not ok and self.is_file and self.loop:
            self.capture.set(cv2.CAP_PROP_POS_FRAMES, 0)
            ok, frame = self.capture.read()
        return frame if ok else None

    def finished(self) -> bool:
        return self.is_file and not self.loop and self.capture.get(cv2.CAP_PROP_POS_FRAMES) >= self.capture.get(
            cv2.CAP_PROP_FRAME_COUNT
        )


class CameraDriver(Node):
    NODE_NAME = "camera_driver"

    def __init__(self):
        super().__init__(self.NODE_NAME)
        p = declare(self, PARAMETERS)
        self.frame_id = p["frame_id"]
        self.size = (p["width"], p["height"])
        self.hfov_rad = math.radians(p["hfov_deg"])
        self.reconnect_interval_s = p["reconnect_interval_s"]
        source = p["source"]
        if Path(source).is_dir():
            self.source = FolderSource(Path(source), p["loop"])
        else:
            self.source = CaptureSource(source, p["loop"], *self.size)
            if not self.source.capture.isOpened():
                self.get_logger().error(f"cannot open camera source {source!r}; retrying every {self.reconnect_interval_s} s")
        self.counters = {"frames": 0, "dropped": 0, "reconnects": 0}
        self._failing_since_ns = None
        self._finished_logged = False
        self.image_pub = self.create_publisher(Image, topics.IMAGE, msgs.qos("image"))
        self.info_pub = self.create_publisher(CameraInfo, topics.CAMERA_INFO, msgs.qos("sensor_out"))
        self.status_pub = self.create_publisher(DiagnosticArray, topics.DIAGNOSTICS, msgs.qos("status"))
        self.create_timer(1.0 / p["rate_hz"], self._tick)
        self.create_timer(1.0, self._publish_status)

    def _tick(self) -> None:
        if self.source.finished():
            if not self._finished_logged:
                self.get_logger().info(f"source finished after {self.counters['frames']} frames")
                self._finished_logged = True
            return
        frame = self.source.read()
        stamp = now_ns(self)
        if frame is None:
            self.counters["dropped"] += 1
            self._failing_since_ns = self._failing_since_ns or stamp
            if isinstance(self.source, CaptureSource) and stamp - self._failing_since_ns > self.reconnect_interval_s * 1e9:
                self.counters["reconnects"] += 1
                self._failing_since_ns = stamp
                opened = self.source.open()
                self.get_logger().warning(f"no frames: reopened source ({'ok' if opened else 'failed'})")
            return
        self._failing_since_ns = None
        if (frame.shape[1], frame.shape[0]) != self.size:
            frame = cv2.resize(frame, self.size, interpolation=cv2.INTER_AREA)
        image = msgs.to_ros(msgs.image_fields(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB), stamp, self.frame_id))
        self.image_pub.publish(image)
        self.info_pub.publish(msgs.to_ros(msgs.camera_info_fields(frame.shape[0], frame.shape[1], stamp, self.frame_id, self.hfov_rad)))
        self.counters["frames"] += 1

    def _publish_status(self) -> None:
        level = msgs.Level.WARN if self._failing_since_ns else msgs.Level.OK
        message = "no frames" if level else "ok"
        self.status_pub.publish(msgs.diagnostics(now_ns(self), self.NODE_NAME, level, message, self.counters, hardware_id="camera"))


def main(args=None) -> int:
    return run(CameraDriver, args)


if __name__ == "__main__":
    raise SystemExit(main())
