"""The shipped policy (what the car runs by default) and the one it replaced (models/sps50_dinov2,
still shipped under its own name) with the real embedded DINOv2 on the bundled drive's frames, in
process: the descriptors they were trained on, finite commands within their output bounds, and
steering close to the expert's on a drive like their own."""

import numpy as np
import pytest

from sps_driving.core import topics
from sps_driving.core.backbones import resolve_config
from sps_driving.core.backbones.dinov2 import DinoV2Extractor
from sps_driving.core.policies.checkpoint import load_policy
from sps_driving.core.resources import SHIPPED_POLICY, package_path
from sps_driving.ros import bagio, msgs

FRAMES = 12  # spread over the 10 s drive


@pytest.fixture(scope="module")
def drive():
    """[(stamp ns, RGB frame, {state input: value}, the expert's (steering, throttle))] of evenly
    spaced frames of data/demo_drive; the recorder writes a frame's speed and target at its stamp."""
    path = package_path("data/demo_drive")

    def by_stamp(topic, read):
        return {msgs.stamp_ns(m.msg.header): read(m.msg) for m in bagio.read_messages(path, [topic])}

    reference = by_stamp(topics.REFERENCE_COMMAND, msgs.command_from_message)
    speed = by_stamp(topics.VEHICLE_TWIST, msgs.speed_from_message)
    target = by_stamp(topics.TARGET_SPEED, msgs.speed_from_message)
    images = [m.msg for m in bagio.read_messages(path, [topics.IMAGE])]
    chosen = [images[i] for i in np.linspace(0, len(images) - 1, FRAMES).astype(int)]
    frames = []
    for m in chosen:
        stamp = msgs.stamp_ns(m.header)
        frames.append((stamp, msgs.image_to_rgb(m), {"speed_mps": speed[stamp], "target_speed_mps": target[stamp]},
                       reference[stamp]))
    return frames


# Each policy's architecture, selection and kept patches, and bounds on its steering's mean error
# and correlation against the expert over these frames that only trained weights meet (steering
# straight: 0.008 rad error and no correlation).
SHIPPED = {
    SHIPPED_POLICY: ("positional_transformer", "spps", 87, 0.0075, 0.6),  # 0.0071 rad, 0.66
    "models/sps50_dinov2": ("mlp", "sps", 144, 0.0075, 0.6),  # 0.0057 rad, 0.83
}


@pytest.mark.parametrize("folder", SHIPPED)
def test_shipped_policies_drive_the_bundled_drive(model, drive, folder):
    architecture, variant, kept, max_error, min_correlation = SHIPPED[folder]
    policy = load_policy(package_path(folder))
    assert (policy.config["architecture"], policy.selection.variant) == (architecture, variant)
    extractor = DinoV2Extractor.from_config(resolve_config(policy.config["extractor"]), model=model)
    assert (extractor.grid, extractor.dim) == (policy.grid, policy.descriptor_dim)
    max_steering = policy.config["output"]["max_steering_rad"]
    commands, expert = [], []
    for stamp, rgb, state, reference in drive:
        indices = policy.selector.select(stamp)
        assert len(indices) == kept
        commands.append(policy.predict(extractor.descriptors(extractor.encode(rgb), indices), indices, state))
        expert.append(reference)
    commands, expert = np.array(commands), np.array(expert)
    assert np.all(np.isfinite(commands))
    assert np.all(np.abs(commands[:, 0]) <= max_steering) and np.all(np.abs(commands[:, 1]) <= 1.0)
    error = np.mean(np.abs(commands[:, 0] - expert[:, 0]))
    correlation = np.corrcoef(commands[:, 0], expert[:, 0])[0, 1]
    assert error < max_error
    assert correlation > min_correlation
