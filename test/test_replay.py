"""The replay report from recorded data (no ROS needed), and `sps-driving replay` end to end on a
real rosbag2 through the live graph with the real embedded DINOv2."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from rclpy.serialization import serialize_message

from sps_driving.core import topics
from sps_driving.ros import msgs
from sps_driving.ros.bagio import TYPESTORE, BagWriter, read_messages, to_bag
from sps_driving.ros.msgs import Level, command_fields, image_fields, lane_pose_fields
from sps_driving.tools.replay import Record, build_report, default_output, format_report, match_reference

MS = 1_000_000


def as_bag(msg, msgtype):
    """An rclpy message as the recorder stores it: a rosbags message from its CDR bytes."""
    return TYPESTORE.deserialize_cdr(serialize_message(msg), msgtype)


def timing(stamp, stage, compute_ms=None, dropped=None):
    if dropped:
        arr = msgs.stage_drop_message(stamp, stage, dropped, {})
    else:
        arr = msgs.stage_timing_message(stamp, stage, compute_ms, {})
    return as_bag(arr, "diagnostic_msgs/msg/DiagnosticArray")


def test_report_counts_errors_latency_and_overhead():
    t0 = 10_000 * MS
    stamps = [1_000 * MS + i * 33 * MS for i in range(4)]
    frames = {s: t0 + i * 100 * MS for i, s in enumerate(stamps)}
    records = []
    predicted = [(0.1, 0.2), (0.2, 0.2), (0.0, -0.1)]
    for i, s in enumerate(stamps[:3]):  # the 4th frame is dropped by the extractor
        enter = frames[s]
        records.append(Record(topics.SELECTION, enter + 2 * MS, as_bag(msgs.selection_message([0, 1], 2, 2, s, "c"),
                                                                       "sensor_msgs/msg/Image")))
        desc = msgs.descriptors_message(np.zeros((2, 3), np.float32), np.array([0, 1]), s, "c")
        records.append(Record(topics.DESCRIPTORS, enter + 50 * MS, as_bag(desc, "sensor_msgs/msg/PointCloud2")))
        records.append(Record(topics.POLICY_COMMAND, enter + 60 * MS, to_bag(command_fields(*predicted[i], s))))
        records.append(Record(topics.STAGE_TIMING, enter + 50 * MS, timing(s, "extractor", 45.0)))
        records.append(Record(topics.STAGE_TIMING, enter + 60 * MS, timing(s, "policy", 5.0 + i)))
    records.append(Record(topics.STAGE_TIMING, frames[stamps[3]] + 5 * MS, timing(stamps[3], "extractor", dropped="bad image")))
    event = msgs.diagnostics(0, "safety_monitor", Level.ERROR, "lane_boundary", {"failure": "lane_boundary", "interventions": 1})
    records.append(Record(topics.SAFETY_EVENTS, t0, as_bag(event, "diagnostic_msgs/msg/DiagnosticArray")))
    status = msgs.diagnostics(0, "safety_monitor", Level.ERROR, "", {"interventions": 1})
    records.append(Record(topics.DIAGNOSTICS, t0, as_bag(status, "diagnostic_msgs/msg/DiagnosticArray")))
    vehicle = msgs.diagnostics(0, "vehicle_interface", Level.WARN, "", {"interventions": 2, "stop_reasons": "safety_stop,camera_timeout"})
    records.append(Record(topics.DIAGNOSTICS, t0, as_bag(vehicle, "diagnostic_msgs/msg/DiagnosticArray")))
    # References: exact stamp for frames 0 and 1, 10 ms off for frame 2 (matched), none for 3.
    reference = {stamps[0]: (0.0, 0.2), stamps[1]: (0.3, 0.0), stamps[2] + 10 * MS: (0.0, 0.0)}
    r = build_report(frames, records, reference, wall_s=2.0)
    assert (r["frames_in"], r["frames_out"], r["frames_dropped"]) == (4, 3, 1)
    assert r["drops"] == {"extractor: bad image": 1} and r["throughput_fps"] == 1.5
    assert r["reference_commands"] == 3
    assert r["steering_mae"] == pytest.approx((0.1 + 0.1 + 0.0) / 3)
    assert r["steering_rmse"] == pytest.approx(math.sqrt((0.01 + 0.01) / 3))
    assert r["steering_max"] == pytest.approx(0.1)
    assert r["throttle_mae"] == pytest.approx((0.0 + 0.2 + 0.1) / 3) and r["throttle_max"] == pytest.approx(0.2)
    assert r["failures"] == {"lane_boundary": 1}
    assert r["interventions"] == 3 and r["interventions_safety"] == 1 and r["interventions_override"] == 2
    assert r["vehicle_stop_reasons"] == {"safety_stop": 1, "camera_timeout": 1}
    lat = r["latency_ms"]
    assert lat["selection"]["p50"] == pytest.approx(2.0) and lat["extractor"]["p50"] == pytest.approx(50.0)
    assert lat["camera_to_command"]["p50"] == pytest.approx(60.0) and lat["camera_to_command"]["count"] == 3
    assert lat["camera_to_command"]["p99"] == pytest.approx(60.0)
    # Overhead = 60 - 45 - (5, 6, 7) = (10, 9, 8) ms.
    assert r["compute_ms"]["graph_overhead"]["p50"] == pytest.approx(9.0)
    assert r["compute_ms"]["policy"]["max"] == pytest.approx(7.0)
    json.dumps(r)  # the --json output is plain JSON


def status(name, values):
    return as_bag(msgs.diagnostics(0, name, Level.OK, "", values), "diagnostic_msgs/msg/DiagnosticArray")


def test_report_accounts_for_every_image_and_weighs_stopping_by_time():
    """Five frames played 1 s apart and two images held back for a repeated stamp; statuses on
    /diagnostics and on the old status topics, told apart by name."""
    s = 1_000 * MS
    t0 = 50 * s
    stamps = [7 * s + i * 33 * MS for i in range(5)]
    frames = {stamp: t0 + i * s for i, stamp in enumerate(stamps)}
    records = [Record(topics.POLICY_COMMAND, frames[stamps[i]] + 100 * MS, to_bag(command_fields(0.0, 0.0, stamps[i]))) for i in (0, 1, 4)]
    # Frame 2: the extractor drops it and a later stage reports it too: one drop, the first reason.
    records.append(Record(topics.STAGE_TIMING, frames[stamps[2]] + 10 * MS, timing(stamps[2], "extractor", dropped="stale")))
    records.append(Record(topics.STAGE_TIMING, frames[stamps[2]] + 20 * MS, timing(stamps[2], "policy", dropped="late")))
    records.append(Record(topics.STAGE_TIMING, t0, timing(3 * s, "extractor", dropped="stale")))  # not a frame played
    # Frame 3: nothing came.
    vehicle_statuses = [  # (time from t0 ms, topic, stop reasons)
        (-1000, topics.DIAGNOSTICS, "no_command"),  # start-up, before the first frame: not counted
        (500, topics.DIAGNOSTICS, ""),
        (1000, topics.DIAGNOSTICS, "safety_stop"),
        (2000, topics.DIAGNOSTICS, ""),
        (3000, topics.DIAGNOSTICS, "command_timeout,safety_stop"),
        (5000, topics.DIAGNOSTICS, "camera_timeout"),  # after the last frame
    ]
    for ms, topic, reasons in vehicle_statuses:
        records.append(Record(topic, t0 + ms * MS, status("vehicle_interface", {"stop_reasons": reasons, "interventions": 1})))
    records.append(Record(topics.DIAGNOSTICS, t0 + 1500 * MS, status("extractor", {"stop_reasons": "other", "interventions": 9})))
    records.append(Record(topics.DIAGNOSTICS, t0 + 100 * MS, status("safety_monitor", {"interventions": 1})))
    records.append(Record(topics.DIAGNOSTICS, t0 + 200 * MS, status("safety_monitor", {"interventions": 2})))
    r = build_report(frames, records, {}, wall_s=4.0, repeated_stamps=2)
    assert (r["frames_in"], r["frames_out"], r["frames_dropped"]) == (7, 3, 4)
    assert r["drops"] == {"repeated stamp": 2, "extractor: stale": 1, "no outcome": 1}
    assert r["frames_out"] + sum(r["drops"].values()) == r["frames_in"]
    # Stopping from 1 to 2 s and from 3 s to the last frame at 4 s, of 4 s.
    assert r["vehicle_stopping_fraction"] == pytest.approx(0.5)
    assert r["vehicle_stop_reasons"] == {"safety_stop": 2, "command_timeout": 1, "camera_timeout": 1}
    assert r["interventions_safety"] == 2 and r["interventions_override"] == 1
    text = format_report(r)
    assert "dropped, repeated stamp: 2" in text and "dropped, no outcome: 1" in text
    assert "vehicle stopping 50% of the time from first to last frame" in text


def test_report_of_nothing_is_well_formed():
    r = build_report({5: 1}, [], {}, wall_s=0.0)
    assert r["frames_dropped"] == 1 and r["drops"] == {"no outcome": 1}
    assert r["steering_mae"] is None and r["throughput_fps"] is None and r["vehicle_stopping_fraction"] is None
    assert r["latency_ms"]["camera_to_command"] == {"p50": None, "p99": None, "mean": None, "max": None, "count": 0}


def test_match_reference_takes_the_nearest_within_tolerance():
    ref = {100: (1.0, 0.0), 200: (2.0, 0.0), 400: (4.0, 0.0)}
    assert match_reference([95, 160, 300, 1000], ref, 50) == {95: (1.0, 0.0), 160: (2.0, 0.0)}
    assert match_reference([1], {}, 50) == {}


@pytest.mark.ros
def test_replay_cli_end_to_end_matches_the_core(tmp_path, capsys):
    """Frames of an mcap bag through the five node processes (real DINOv2 at 112 px, a tiny random
    policy that reads the car's speed and the cruise target); every frame gets a command that
    equals the core run in-process on the same frames and the bag's state. The state of each frame
    was recorded after its image (as a car or `collect` records it), and PACMod 3's speed report
    carries the speed (a car bag). A second image with an already played stamp is held back and
    counted as a drop. With --overlay the policy node draws the first frame (every 5th) and the
    output bag records it."""
    from samples import tiny_policy

    from sps_driving import cli
    from sps_driving.core.backbones.loader import load_extractor
    from sps_driving.core.policies.checkpoint import load_policy
    from sps_driving.core.selection import PatchSelector
    from sps_driving.core.state import STATE_NAMES

    ckpt = tiny_policy(tmp_path / "ckpt", rows=8, cols=8, dim=384, state_inputs=STATE_NAMES)
    (tmp_path / "extraction.yaml").write_text("input_size: [112, 112]\n")
    rng = np.random.default_rng(0)
    t0 = 1_700_000_000_000_000_000
    images = {}
    with BagWriter(tmp_path / "drive", "mcap") as bag:
        for i in range(4):
            t = t0 + i * 33_333_333
            images[t] = rng.integers(0, 256, (600, 960, 3), dtype=np.uint8)
            bag.write(topics.IMAGE, image_fields(images[t], t, "camera", "bgr8"), t)
            bag.write(topics.REFERENCE_COMMAND, command_fields(0.0, 0.1, t), t)
            bag.write(topics.LANE_POSE, lane_pose_fields(0.2, 0.0, t), t)
            bag.write(topics.PACMOD_SPEED_RPT, msgs.Fields("pacmod3_msgs/msg/VehicleSpeedRpt", {
                "header": msgs.header_fields(t), "vehicle_speed": 4.0 + 2 * i, "vehicle_speed_valid": True}), t)
            bag.write(topics.TARGET_SPEED, msgs.twist_fields(9.0, t), t)
            if i == 1:  # another image with the same stamp, other pixels
                bag.write(topics.IMAGE, image_fields(255 - images[t], t, "camera", "bgr8"), t + 1)
    out = tmp_path / "out"
    code = cli.main([
        "replay", str(tmp_path / "drive"), "--out", str(out), "--json", "--checkpoint", str(ckpt),
        "--backbone-config", str(tmp_path / "extraction.yaml"), "--frame-timeout", "60", "--log-dir", str(tmp_path / "logs"),
        "--overlay",
    ])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (report["frames_in"], report["frames_out"], report["frames_dropped"]) == (5, 4, 1), report["drops"]
    overlays = [m.msg for m in read_messages(out, [topics.POLICY_OVERLAY])]
    assert [msgs.stamp_ns(m.header) for m in overlays] == [t0] and (overlays[0].height, overlays[0].width) == (600, 960)
    assert report["drops"] == {"repeated stamp": 1}
    assert report["frames_out"] + sum(report["drops"].values()) == report["frames_in"]
    assert 0.0 <= report["vehicle_stopping_fraction"] <= 1.0
    assert report["reference_commands"] == 4 and report["steering_mae"] is not None
    assert report["failures"] == {} and report["interventions"] == 0
    for stage in ("selection", "extractor", "policy", "camera_to_command"):
        assert report["latency_ms"][stage]["count"] == 4 and report["latency_ms"][stage]["p50"] > 0
    recorded = {msgs.stamp_ns(m.msg.header): msgs.command_from_message(m.msg) for m in read_messages(out, [topics.POLICY_COMMAND])}
    assert set(recorded) == set(images)
    # The graph ran the default backend (auto: the onnxruntime export); the core runs torch.
    assert report["extractor"]["backend"] == "onnxruntime" and report["extractor"]["precision"] == "fp32", report
    extractor = load_extractor({"input_size": [112, 112], "backend": "torch"})
    policy = load_policy(ckpt)
    selector = PatchSelector(policy.selection, policy.grid)
    for i, (stamp, rgb) in enumerate(images.items()):
        indices = selector.select(stamp)
        state = {"speed_mps": 4.0 + 2 * i, "target_speed_mps": 9.0}
        expected = policy.predict(extractor.descriptors(extractor.encode(rgb), indices), indices, state)
        assert recorded[stamp] == pytest.approx(expected, abs=1e-4)


@pytest.mark.ros
def test_replay_realtime_drops_stale_frames_and_never_queues(tmp_path, capsys, monkeypatch):
    """12 frames at 100 fps, faster than CPU extraction (16-21 ms a frame at 112x112 on 2 cores, which
    keeps up with 30 fps once warm): the extractor skips to the newest frame.
    The bag was recorded with a vendor camera driver's topic name, mapped to the graph's. Without
    --out the output bag goes to out/replay/ under the current folder."""
    from samples import tiny_policy

    from sps_driving import cli

    ckpt = tiny_policy(tmp_path / "ckpt", rows=8, cols=8, dim=384)
    (tmp_path / "extraction.yaml").write_text("input_size: [112, 112]\n")
    rng = np.random.default_rng(1)
    t0 = 1_700_000_000_000_000_000
    with BagWriter(tmp_path / "drive", "sqlite3") as bag:
        for i in range(12):
            t = t0 + i * 10_000_000
            bag.write("/flir_camera/image_raw", image_fields(rng.integers(0, 256, (600, 960, 3), dtype=np.uint8), t, "camera"), t)
    # The node processes import the package this test imported, wherever the current folder is.
    import sps_driving

    monkeypatch.setenv("PYTHONPATH", str(Path(sps_driving.__file__).resolve().parent.parent))
    monkeypatch.chdir(tmp_path)
    code = cli.main([
        "replay", str(tmp_path / "drive"), "--realtime", "--json", "--checkpoint", str(ckpt),
        "--backbone-config", str(tmp_path / "extraction.yaml"), "--topic", "/flir_camera/image_raw:=/camera/image_raw",
    ])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["mode"] == "realtime"
    assert report["frames_in"] == 12 and 1 <= report["frames_out"] < 12, report
    assert report["drops"].get("extractor: stale", 0) >= 1
    assert report["frames_out"] + sum(report["drops"].values()) == report["frames_dropped"] + report["frames_out"] == 12
    out = tmp_path / report["output_bag"]
    assert report["output_bag"].startswith("out/replay/drive_") and out.is_dir()
    assert report["reference_commands"] == 0 and report["steering_mae"] is None
    commands = list(read_messages(out, [topics.POLICY_COMMAND]))
    assert len(commands) == report["frames_out"]


def test_replay_sets_the_extractors_precision_only_when_asked():
    from sps_driving.tools.replay import graph_parameters

    bag_topics = {topics.IMAGE: "sensor_msgs/msg/Image"}
    assert "precision" not in graph_parameters(Path("/p"), bag_topics, True, 60.0)["extractor"]
    assert graph_parameters(Path("/p"), bag_topics, True, 60.0, precision="int8")["extractor"]["precision"] == "int8"


def test_default_output_is_outside_the_bag_tree():
    out = default_output(Path("data/demo_drive/"))
    assert out.parent == Path("out/replay") and out.name.startswith("demo_drive_")


def test_replay_refuses_bad_inputs_with_clear_errors(tmp_path, capsys):
    from samples import tiny_policy

    from sps_driving import cli

    assert cli.main(["replay", str(tmp_path / "missing")]) == 2
    assert "no bag at" in capsys.readouterr().out
    with BagWriter(tmp_path / "no_images", "sqlite3") as bag:
        bag.write(topics.LANE_POSE, lane_pose_fields(0.0, 0.0, 1), 1)
    assert cli.main(["replay", str(tmp_path / "no_images")]) == 2
    assert "no sensor_msgs/Image frames on /camera/image_raw" in capsys.readouterr().out
    with BagWriter(tmp_path / "drive", "sqlite3") as bag:
        bag.write(topics.IMAGE, image_fields(np.zeros((4, 4, 3), np.uint8), 1, "camera"), 1)
    assert cli.main(["replay", str(tmp_path / "drive"), "--checkpoint", str(tmp_path / "none")]) == 2
    out = capsys.readouterr().out
    assert "no policy checkpoint at" in out and "policy.safetensors and config.json" in out
    ckpt = tiny_policy(tmp_path / "ckpt")
    (tmp_path / "taken").mkdir()
    assert cli.main(["replay", str(tmp_path / "drive"), "--checkpoint", str(ckpt), "--out", str(tmp_path / "taken")]) == 2
    assert "exists" in capsys.readouterr().out
    assert cli.main(["replay", str(tmp_path / "drive"), "--topic", "/a=/b"]) == 2
    assert "--topic takes" in capsys.readouterr().out
    assert cli.main(["replay", str(tmp_path / "drive"), "--topic", "/camera/image_raw:=/other"]) == 2
    assert "no sensor_msgs/Image frames" in capsys.readouterr().out


# ---------------------------------------------------------------- state supplied for camera-only bags

CAMERA_ONLY = {topics.IMAGE: "sensor_msgs/msg/Image"}
BOTH = {"state_inputs": ["speed_mps", "target_speed_mps"]}


def test_state_comes_from_the_bag_from_options_or_the_policy_parameter_and_says_which(tmp_path):
    from sps_driving.tools.replay import ReplayError, state_plan

    params = tmp_path / "graph.yaml"
    params.write_text("policy:\n  ros__parameters:\n    target_speed_mps: 4.5\n")
    # A camera-only bag, nothing supplied: no speed at all, the target from the policy node's parameter.
    publish, sources = state_plan(BOTH, CAMERA_ONLY, {}, params)
    assert publish == {}
    assert sources == {"speed_mps": {"from": "none"},
                       "target_speed_mps": {"from": "parameter", "parameter": "policy target_speed_mps", "value": 4.5}}
    # Supplied by the options: published on the topics the policy node reads, with each frame's stamp.
    publish, sources = state_plan(BOTH, CAMERA_ONLY, {"speed_mps": 5.0, "target_speed_mps": 7.0}, params)
    assert publish == {topics.VEHICLE_TWIST: 5.0, topics.TARGET_SPEED: 7.0}
    assert sources["speed_mps"] == {"from": "option", "option": "--speed-mps", "value": 5.0, "topic": topics.VEHICLE_TWIST}
    assert sources["target_speed_mps"] == {"from": "option", "option": "--target-speed-mps", "value": 7.0,
                                           "topic": topics.TARGET_SPEED}
    # From the bag, under its own name or another topic played as the one the policy reads (--topic).
    recorded = {**CAMERA_ONLY, topics.PACMOD_SPEED_RPT: "pacmod3_msgs/msg/VehicleSpeedRpt"}
    _, sources = state_plan(BOTH, recorded, {"target_speed_mps": 7.0}, params)
    assert sources["speed_mps"] == {"from": "bag", "topic": topics.PACMOD_SPEED_RPT}
    _, sources = state_plan({"state_inputs": ["speed_mps"]}, {**CAMERA_ONLY, topics.VEHICLE_TWIST: "geometry_msgs/msg/TwistStamped"},
                            {}, params, {"/gps/twist": topics.VEHICLE_TWIST})
    assert sources == {"speed_mps": {"from": "bag", "topic": "/gps/twist", "played_as": topics.VEHICLE_TWIST}}
    # Never over a recorded value, never for a state the policy does not read, only a real speed.
    with pytest.raises(ReplayError, match="records speed_mps on /pacmod/vehicle_speed_rpt"):
        state_plan(BOTH, recorded, {"speed_mps": 5.0}, params)
    with pytest.raises(ReplayError, match="the policy reads no target_speed_mps"):
        state_plan({"state_inputs": ["speed_mps"]}, CAMERA_ONLY, {"target_speed_mps": 7.0}, params)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ReplayError, match="--speed-mps"):
            state_plan(BOTH, CAMERA_ONLY, {"speed_mps": bad}, params)
    with pytest.raises(ReplayError, match="--target-speed-mps"):
        state_plan(BOTH, CAMERA_ONLY, {"target_speed_mps": 0.0}, params)


def test_report_text_says_where_the_state_came_from():
    r = build_report({5: 1}, [], {}, wall_s=0.0)
    r["state"] = {"speed_mps": {"from": "option", "option": "--speed-mps", "value": 5.0, "topic": topics.VEHICLE_TWIST},
                  "target_speed_mps": {"from": "parameter", "parameter": "policy target_speed_mps", "value": 4.0}}
    text = format_report(r)
    assert "state speed_mps: 5 m/s on every frame, supplied by --speed-mps (not recorded)" in text
    assert "state target_speed_mps: 4 m/s, the policy target_speed_mps parameter (not recorded)" in text


@pytest.mark.ros
def test_a_camera_only_bag_replays_with_the_state_supplied_by_options(tmp_path, capsys):
    """A bare .mcap with camera frames only (a dash camera) and a tiny policy that reads the speed
    and the cruise target: without options every frame is dropped for want of a speed (the car's
    rule); with --speed-mps and --target-speed-mps every frame gets the command the core computes
    from those values, and the report says they were supplied."""
    from samples import tiny_policy

    from sps_driving import cli
    from sps_driving.core.backbones.loader import load_extractor
    from sps_driving.core.policies.checkpoint import load_policy
    from sps_driving.core.selection import PatchSelector
    from sps_driving.core.state import STATE_NAMES

    ckpt = tiny_policy(tmp_path / "ckpt", rows=8, cols=8, dim=384, state_inputs=STATE_NAMES)
    (tmp_path / "extraction.yaml").write_text("input_size: [112, 112]\n")
    rng = np.random.default_rng(2)
    t0 = 1_700_000_000_000_000_000
    images = {}
    with BagWriter(tmp_path / "dashcam", "mcap") as bag:
        for i in range(4):
            t = t0 + i * 33_333_333
            images[t] = rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)
            bag.write(topics.IMAGE, image_fields(images[t], t, "camera"), t)
    (file,) = (tmp_path / "dashcam").glob("*.mcap")
    dashcam = file.rename(tmp_path / "dashcam.mcap")

    def replay(*options):
        out = tmp_path / f"out{len(options)}"
        assert cli.main(["replay", str(dashcam), "--out", str(out), "--json", "--checkpoint", str(ckpt), "--backbone-config",
                         str(tmp_path / "extraction.yaml"), "--log-dir", str(tmp_path / "logs"), *options]) == 0
        return json.loads(capsys.readouterr().out), out

    report, _ = replay()
    assert (report["frames_in"], report["frames_out"]) == (4, 0)
    assert report["drops"] == {"policy: no speed_mps received yet": 4}
    assert report["state"]["speed_mps"] == {"from": "none"} and report["state"]["target_speed_mps"]["from"] == "parameter"

    report, out = replay("--speed-mps", "5.0", "--target-speed-mps", "7.0")
    assert (report["frames_in"], report["frames_out"]) == (4, 4), report["drops"]
    assert report["state"] == {
        "speed_mps": {"from": "option", "option": "--speed-mps", "value": 5.0, "topic": topics.VEHICLE_TWIST},
        "target_speed_mps": {"from": "option", "option": "--target-speed-mps", "value": 7.0, "topic": topics.TARGET_SPEED}}
    assert "state speed_mps: 5 m/s on every frame, supplied by --speed-mps (not recorded)" in format_report(report)
    recorded = {msgs.stamp_ns(m.msg.header): msgs.command_from_message(m.msg) for m in read_messages(out, [topics.POLICY_COMMAND])}
    extractor = load_extractor({"input_size": [112, 112], "backend": "torch"})
    policy = load_policy(ckpt)
    selector = PatchSelector(policy.selection, policy.grid)
    for stamp, rgb in images.items():
        indices = selector.select(stamp)
        expected = policy.predict(extractor.descriptors(extractor.encode(rgb), indices), indices,
                                  {"speed_mps": 5.0, "target_speed_mps": 7.0})
        assert recorded[stamp] == pytest.approx(expected, abs=1e-4)
