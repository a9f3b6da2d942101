"""`sps-driving replay` of the bundled drive (100 frames at 10 Hz) through the live graph with a
patch policy (a tiny random one of the real architecture: windows of 3 frames 0.1 s apart, reading
the car's speed; test/samples.py) and the real embedded DINOv2 at 112 px: every frame gets a
command, equal to the in-process evaluation driver's (sim.episodes.PolicyDriver, the same history)
on the same frames and speeds, and the report carries the policy's history and its per-frame time."""

import json

import numpy as np
import pytest
from samples import tiny_policy

from sps_driving import cli
from sps_driving.core import topics
from sps_driving.core.resources import package_path
from sps_driving.core.state import nearest
from sps_driving.ros import msgs
from sps_driving.ros.bagio import read_messages
from sps_driving.sim.episodes import PolicyDriver

pytestmark = pytest.mark.ros


def test_replay_of_the_bundled_drive_with_a_patch_policy(tmp_path, capsys):
    bag = package_path("data/demo_drive")
    ckpt = tiny_policy(tmp_path / "ckpt", rows=8, cols=8, dim=384, architecture="patch_policy", state_inputs=("speed_mps",))
    extraction = tmp_path / "extraction.yaml"
    extraction.write_text("input_size: [112, 112]\n")
    out = tmp_path / "out"
    code = cli.main(["replay", str(bag), "--out", str(out), "--json", "--checkpoint", str(ckpt), "--backbone-config",
                     str(extraction), "--log-dir", str(tmp_path / "logs")])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and (report["frames_in"], report["frames_out"]) == (100, 100), report["drops"]
    # One drive at 10 Hz: only its first two frames have short windows.
    assert report["policy_history"] == {"frames": 100, "reset_backwards": 0, "reset_gap": 0, "missing_frame": 0,
                                        "short_window": 2}
    assert report["compute_ms"]["policy"]["count"] == 100 and report["compute_ms"]["policy"]["p50"] > 0
    recorded = {msgs.stamp_ns(m.msg.header): msgs.command_from_message(m.msg) for m in read_messages(out, [topics.POLICY_COMMAND])}

    speeds = [(msgs.stamp_ns(m.msg.header), msgs.speed_from_message(m.msg)) for m in read_messages(bag, [topics.VEHICLE_TWIST])]
    speed_stamps = np.array([s for s, _ in speeds], dtype=np.int64)
    driver = PolicyDriver(str(ckpt), backbone_config=str(extraction))
    driver.reset()
    for item in read_messages(bag, [topics.IMAGE]):
        stamp = msgs.stamp_ns(item.msg.header)
        speed = speeds[nearest(speed_stamps, stamp)][1]
        command = driver(msgs.image_to_rgb(item.msg), stamp, {"speed_mps": speed})
        assert recorded[stamp] == pytest.approx(command, abs=1e-4), stamp
    assert driver.drops == 0 and driver.streaming.counts["history_short_window"] == 2
