"""The extractor node follows its `checkpoint`: through the live graph (selection and extractor as
separate processes over DDS), an I-ViT policy (falloff none) and a No-FM policy (pixels) each get
the descriptors they were trained on, computed in this process for comparison; a settings file
that contradicts the checkpoint stops the node with both values named. The real embedded DINOv2 at
112 px (an 8x8 grid)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray
from ros_helpers import Probe, Rate
from samples import tiny_policy
from sensor_msgs.msg import CameraInfo, Image, PointCloud2

from sps_driving.core import topics
from sps_driving.core.backbones.loader import load_extractor
from sps_driving.core.policies.checkpoint import read_policy_config
from sps_driving.core.selection import PatchSelector, SelectionConfig
from sps_driving.ros import msgs
from sps_driving.ros.graph import Graph, wait_for_nodes, wait_for_topics
from sps_driving.ros.process import CANNOT_START

pytestmark = pytest.mark.ros
SIZE = [112, 112]  # px: an 8x8 grid
EXTRACTORS = {
    "I-ViT": {"backbone": "dinov2_vits14", "input_size": SIZE, "falloff": "none", "backend": "torch"},
    "No-FM": {"backbone": "pixels", "input_size": SIZE, "pixel_pool": 2, "backend": "torch"},
}


def checkpoint(directory, extractor: dict, dim: int):
    """A tiny policy trained (as its config.json says) on `extractor`'s descriptors."""
    path = Path(tiny_policy(directory, rows=8, cols=8, dim=dim, backbone=extractor["backbone"], rate=0.5))
    config = json.loads((path / "config.json").read_text())
    config["extractor"] = extractor
    (path / "config.json").write_text(json.dumps(config))
    return path


def descriptors_through_the_graph(ckpt, tmp_path, image_rgb: np.ndarray, stamp: int):
    """(indices, descriptors, the extractor's timing values) the graph computes for one frame."""
    probe = Probe("checkpoint_probe")
    probe.record(topics.DESCRIPTORS, PointCloud2, "status")
    probe.record(topics.STAGE_TIMING, DiagnosticArray, "status")
    image = probe.publisher(topics.IMAGE, Image, "image")
    info = probe.publisher(topics.CAMERA_INFO, CameraInfo, "sensor_out")
    # A settings file that the checkpoint overrules where they differ (the runtime: not its to say).
    (tmp_path / "settings.yaml").write_text("backend: auto\nthreads: 1\n")
    graph = Graph(["selection", "extractor"], log_dir=tmp_path / "logs", parameters={
        "selection": {"checkpoint": str(ckpt)},
        "extractor": {"checkpoint": str(ckpt), "backbone_config": str(tmp_path / "settings.yaml"), "selection_timeout_s": 5.0},
    })
    try:
        with graph:
            wait_for_nodes(probe.node, graph.nodes, 180, graph)
            wait_for_topics(probe.node, {topics.IMAGE: 1, topics.CAMERA_INFO: 1, topics.SELECTION: 1}, 120, graph)

            def send():
                image.publish(msgs.to_ros(msgs.image_fields(image_rgb, stamp, "camera")))
                info.publish(msgs.to_ros(msgs.camera_info_fields(*image_rgb.shape[:2], stamp, "camera", math.radians(130))))

            # Sent again until it comes through: a subscription the graph lists (perhaps a killed
            # extractor's, until its lease ends) is not yet one this publisher has matched.
            assert probe.spin_until(lambda: probe.messages(topics.DESCRIPTORS), 120, every=Rate(2.0, send)), (
                graph.log("extractor")[-2000:])
            probe.spin(0.3)
            log = graph.log("extractor")
    finally:
        probe.close()
    values, indices = msgs.descriptors_from_message(probe.messages(topics.DESCRIPTORS)[0])
    timing = [msgs.diagnostic_values(m)[0] for m in probe.messages(topics.STAGE_TIMING)]
    facts = next(v for name, level, _, v in timing if name == "extractor" and level == 0)
    return indices, values, facts, log


@pytest.mark.parametrize("method", ["I-ViT", "No-FM"])
def test_each_policy_gets_the_descriptors_it_was_trained_on(tmp_path, method):
    extractor_config = EXTRACTORS[method]
    reference = load_extractor(extractor_config)
    ckpt = checkpoint(tmp_path / "policy", extractor_config, reference.dim)
    frame = np.random.default_rng(3).integers(0, 256, (120, 200, 3), dtype=np.uint8)
    stamp = 1_700_000_000_123_456_789
    indices, values, facts, log = descriptors_through_the_graph(ckpt, tmp_path, frame, stamp)
    policy = read_policy_config(ckpt)
    expected_indices = PatchSelector(SelectionConfig.from_dict(policy["selection"]), reference.grid).select(stamp)
    np.testing.assert_array_equal(indices, expected_indices)
    expected = reference.descriptors(reference.encode(frame), expected_indices)
    assert values.shape == expected.shape == (32, reference.dim)
    np.testing.assert_allclose(values, expected, atol=1e-4, rtol=1e-4)
    # The masked DINOv2 of the defaults would give other values: the comparison tells them apart.
    if method == "I-ViT":
        masked = load_extractor({**extractor_config, "falloff": "hard"})
        assert np.abs(masked.descriptors(masked.encode(frame), expected_indices) - expected).max() > 0.1
    # What it ran, said in its log and with every frame's timing
    assert facts["backend"] == "torch" and facts["threads"] == "1" and facts["precision"] == "fp32"
    assert "only torch computes these" in log and f"checkpoint {ckpt}" in log


def test_a_token_dropping_policy_gets_descriptors_of_its_kept_patches_only(tmp_path):
    """A policy trained on token-dropped descriptors (tokens kept): the node runs the ViT on the
    selection's patches only (backend auto: the token-dropping onnxruntime export), which differ
    from the same patches' dense descriptors."""
    extractor_config = {"backbone": "dinov2_vits14", "input_size": SIZE, "tokens": "kept"}
    reference = load_extractor({**extractor_config, "backend": "torch"})
    ckpt = checkpoint(tmp_path / "policy", extractor_config, reference.dim)
    frame = np.random.default_rng(4).integers(0, 256, (120, 200, 3), dtype=np.uint8)
    stamp = 1_700_000_000_223_456_789
    indices, values, facts, log = descriptors_through_the_graph(ckpt, tmp_path, frame, stamp)
    expected_indices = PatchSelector(SelectionConfig("sps", 0.5, 0), reference.grid).select(stamp)
    np.testing.assert_array_equal(indices, expected_indices)
    expected = reference.descriptors(reference.encode(frame), expected_indices)
    np.testing.assert_allclose(values, expected, atol=1e-4, rtol=1e-4)
    dense = load_extractor({**extractor_config, "backend": "torch", "tokens": "all"})
    assert np.abs(dense.descriptors(dense.encode(frame), expected_indices) - expected).max() > 0.1
    assert facts["backend"] == "onnxruntime" and "tokens 'kept' (checkpoint" in log


def test_a_setting_that_contradicts_the_checkpoint_stops_the_node(tmp_path):
    ckpt = checkpoint(tmp_path / "policy", EXTRACTORS["I-ViT"], 384)
    (tmp_path / "hard.yaml").write_text("falloff: hard\n")
    graph = Graph(["extractor"], log_dir=tmp_path / "logs", parameters={
        "extractor": {"checkpoint": str(ckpt), "backbone_config": str(tmp_path / "hard.yaml")}})
    with graph:
        assert graph.returncode("extractor", wait_s=120) == CANNOT_START
    log = graph.log("extractor")
    assert "cannot start" in log and "gives 'hard', but the policy was trained with 'none'" in log
