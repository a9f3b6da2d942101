"""camera_driver as a real process: an image folder at a fixed rate, Image and CameraInfo with the
same stamp and frame_id, resizing, unreadable files counted as dropped, a missing device retried."""


import cv2
import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray
from ros_helpers import Probe
from sensor_msgs.msg import CameraInfo, Image

from sps_driving.core import topics
from sps_driving.ros import msgs
from sps_driving.ros.graph import Graph, wait_for_nodes
from sps_driving.ros.process import CANNOT_START

pytestmark = pytest.mark.ros


@pytest.fixture
def probe():
    p = Probe()
    p.record(topics.IMAGE, Image, "image")
    p.record(topics.CAMERA_INFO, CameraInfo, "sensor")
    p.record(topics.DIAGNOSTICS, DiagnosticArray, "status")
    yield p
    p.close()


def test_image_folder_publishes_stamped_pairs(tmp_path, probe):
    folder = tmp_path / "frames"
    folder.mkdir()
    rng = np.random.default_rng(0)
    originals = []
    for i in range(5):
        bgr = rng.integers(0, 256, (60, 96, 3), dtype=np.uint8)
        cv2.imwrite(str(folder / f"{i:03d}.png"), bgr)
        originals.append(bgr)
    (folder / "002b.png").write_bytes(b"not a png")  # sorted between frames 2 and 3
    params = {"source": str(folder), "rate_hz": 10.0, "frame_id": "front_cam", "width": 96, "height": 60, "loop": True}

    def dropped():
        return int(probe.status("camera_driver")[2].get("dropped", 0))

    with Graph(["camera_driver"], parameters={"camera_driver": params}, log_dir=tmp_path / "logs") as graph:
        wait_for_nodes(probe.node, graph.nodes, 30, graph)
        assert probe.spin_until(lambda: len(probe.messages(topics.IMAGE)) >= 7 and dropped() >= 1, 20)
        assert graph.alive("camera_driver"), graph.log("camera_driver")
    images, infos = probe.messages(topics.IMAGE), probe.messages(topics.CAMERA_INFO)
    # Every frame has its CameraInfo with the same stamp (allowing for the last one in flight).
    info_stamps = {msgs.stamp_ns(m.header) for m in infos}
    for image in images[:-1]:
        assert msgs.stamp_ns(image.header) in info_stamps
        assert image.header.frame_id == "front_cam" and (image.width, image.height) == (96, 60)
    # The folder's frames in name order (the unreadable file skipped), resized to 96x60 unchanged.
    expected = [cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB).tobytes() for bgr in originals]
    seen = [msgs.image_to_rgb(m).tobytes() for m in images]
    first = expected.index(seen[0])
    assert seen[:5] == (expected * 3)[first:first + 5]
    stamps = [msgs.stamp_ns(m.header) for m in images]
    gaps = np.diff(stamps)  # about 10 Hz, one tick lost per loop; a late tick shortens the next gap
    assert 0.08e9 < np.median(gaps) < 0.12e9 and 0 < gaps.min() and gaps.max() < 0.5e9, gaps
    info = infos[-1]
    assert info.k[2] == 48.0 and info.k[0] > 0


def test_missing_device_is_retried_not_fatal(tmp_path, probe):
    params = {"source": str(tmp_path / "no_such_video.mp4"), "rate_hz": 20.0, "reconnect_interval_s": 0.2}
    with Graph(["camera_driver"], parameters={"camera_driver": params}, log_dir=tmp_path / "logs") as graph:
        wait_for_nodes(probe.node, graph.nodes, 30, graph)

        def reconnecting():
            return int(probe.status("camera_driver")[2].get("reconnects", 0)) >= 2

        assert probe.spin_until(reconnecting, 15)
        assert graph.alive("camera_driver")
        level, message, values = probe.status("camera_driver")
        assert level == msgs.Level.WARN and int(values["dropped"]) > 0 and values["frames"] == "0"
        assert graph.stop() == {"camera_driver": 0}  # Ctrl-C is a clean exit
    assert not probe.messages(topics.IMAGE)


def test_gstreamer_pipeline_without_gstreamer_is_a_clear_error(tmp_path):
    from sps_driving.ros.nodes.camera_driver import opencv_has_gstreamer

    if opencv_has_gstreamer():
        pytest.skip("this OpenCV has GStreamer")
    params = {"source": "aravissrc ! videoconvert ! appsink"}
    graph = Graph(["camera_driver"], parameters={"camera_driver": params}, log_dir=tmp_path)
    with graph:
        assert graph.returncode("camera_driver", wait_s=30) == CANNOT_START
        assert "needs an OpenCV built with GStreamer" in graph.log("camera_driver")
