"""Labels from the car's own drives: `sps-driving extract` of real rosbag2 files (sqlite3 and mcap)
with PACMod 3 reports in the upstream ROS 2 layout, the intervention marks in the cache and in
training, the human's reference in `replay`, and the recording profile."""

import json
import math

import numpy as np
import pytest
import torch

from sps_driving.cli import main
from sps_driving.core import topics
from sps_driving.core.backbones.loader import load_extractor
from sps_driving.core.control import ControlLimits, EngageState, VehicleCommand, from_pacmod, to_pacmod
from sps_driving.ros import bagio, msgs
from sps_driving.ros.bagio import TYPESTORE
from sps_driving.ros.car_labels import read_car_labels
from sps_driving.ros.drive import read_drive
from sps_driving.ros.graph import car_facts
from sps_driving.ros.msgs import Fields, header_fields
from sps_driving.train.cache import FeatureCache, FeatureCacheWriter
from sps_driving.train.extract import ExtractSettings, extract

S = 1_000_000_000
MS = 1_000_000
T0 = 1_700_000_000 * S
TICK_NS = S // 30  # PACMod reports at 30 Hz
FRAME_NS = 100 * MS  # camera frames at 10 Hz
FRAME_OFFSET_NS = 15 * MS  # frames fall between the reports
FRAME_LOG_DELAY_NS = 5 * MS  # a frame is recorded this long after its stamp
# Each report topic's offset within the 33 ms CAN cycle, as they arrive on the car.
PHASE_MS = {
    topics.PACMOD_GLOBAL_RPT: 0, topics.PACMOD_ENABLED: 1, topics.PACMOD_STEERING_RPT: 4, topics.PACMOD_BRAKE_RPT: 8,
    topics.PACMOD_ACCEL_RPT: 12, topics.PACMOD_SHIFT_RPT: 16, topics.PACMOD_SPEED_RPT: 20,
}
SYSTEM_FLAGS = ("override_active", "command_output_fault", "input_output_fault", "output_reported_fault", "pacmod_fault",
                "vehicle_fault", "command_timeout")
GLOBAL_FLAGS = ("override_active", "user_can_timeout", "steering_can_timeout", "brake_can_timeout", "subsystem_can_timeout",
                "vehicle_can_timeout", "pacmod_sys_fault_active", "supervisory_enable_required", "config_fault_active")
SHIFT = TYPESTORE.types["pacmod3_msgs/msg/SystemRptInt"]


def steering_wheel(t):
    """rad of the steering wheel at t s."""
    return 2.0 * math.sin(2 * math.pi * 0.5 * t)


def throttle(t):
    """The signed pedal effort at t s: negative (braking) over (1.25, 2.5) s, (3.75, 5) s, ..."""
    return 0.3 * math.sin(2 * math.pi * 0.4 * t)


def speed(t):
    """m/s: at standstill until 1 s, a smooth start to 6 m/s at 2.5 s, then 6 +- 0.5."""
    if t < 1.0:
        return 0.0
    if t < 2.5:
        x = (t - 1.0) / 1.5
        return 6.0 * x * x * (3 - 2 * x)
    return 6.0 + 0.5 * math.sin(t - 2.5)


# The drive of `write_car_bag`, in 30 Hz report ticks: the stack drives from 120, 240 and 300.
ENGAGED = ((120, 166), (240, 272), (300, 324))
OVERRIDE = (165, 171)  # the safety driver brakes: the brake report shows it at 165, the global report from 166 (enable off)
FAULT = (270, 280)  # a steering fault from 270; the driver clears enable at 272
GAP = (90, 99)  # no steering reports
INVALID_SPEED = (105, 108)  # the speed report says it is not valid
REVERSE_FROM = 345  # the shift report says reverse
TICKS = 360  # 12 s
WINDOW_S = 1.0  # intervention window of the tests


def report_time(tick, topic):
    return T0 + tick * TICK_NS + PHASE_MS[topic] * MS


def system_rpt(t, kind="Float", **values):
    flags = {name: values.pop(name, False) for name in SYSTEM_FLAGS}
    return Fields(f"pacmod3_msgs/msg/SystemRpt{kind}", {"header": header_fields(t), **flags, **values})


def global_rpt(t, enabled, **flags):
    return Fields("pacmod3_msgs/msg/GlobalRpt", {"header": header_fields(t), "enabled": enabled,
                                                 **{name: flags.get(name, False) for name in GLOBAL_FLAGS}})


def image(i):
    return np.random.default_rng(i).integers(0, 256, size=(42, 56, 3), dtype=np.uint8)


def within(tick, span):
    return span[0] <= tick < span[1]


def write_car_bag(path, storage="sqlite3", ticks=TICKS, engaged=ENGAGED, command=False, override=OVERRIDE,
                  stack_wheel=None):
    """A drive on the car: camera frames and the PACMod 3 reports (see the constants above), each
    written at its stamp (frames FRAME_LOG_DELAY_NS later); with `command`, the world's reference
    command on every frame too. `stack_wheel(t)`: the steering wheel's angle while the stack drives
    (enabled, no override), where the human's is `steering_wheel`."""
    with bagio.BagWriter(path, storage) as bag:
        for k in range(ticks):
            t = k / 30
            enabled = any(within(k, span) for span in engaged)
            overridden = within(k, override)
            fault = within(k, FAULT)
            wheel = stack_wheel if stack_wheel is not None and enabled and not overridden else steering_wheel

            def write(topic, fields):
                bag.write(topic, fields, report_time(k, topic))

            at = {topic: report_time(k, topic) for topic in PHASE_MS}
            write(topics.PACMOD_GLOBAL_RPT, global_rpt(at[topics.PACMOD_GLOBAL_RPT], enabled,
                                                       override_active=overridden and k > override[0], pacmod_sys_fault_active=fault))
            write(topics.PACMOD_ENABLED, Fields("std_msgs/msg/Bool", {"data": enabled}))
            if not within(k, GAP):
                write(topics.PACMOD_STEERING_RPT, system_rpt(at[topics.PACMOD_STEERING_RPT], enabled=enabled, vehicle_fault=fault,
                                                             output=wheel(k / 30 + PHASE_MS[topics.PACMOD_STEERING_RPT] / 1e3)))
            pedal = throttle(t + PHASE_MS[topics.PACMOD_ACCEL_RPT] / 1e3)
            write(topics.PACMOD_ACCEL_RPT, system_rpt(at[topics.PACMOD_ACCEL_RPT], enabled=enabled, output=max(pedal, 0.0)))
            pedal = throttle(t + PHASE_MS[topics.PACMOD_BRAKE_RPT] / 1e3)
            write(topics.PACMOD_BRAKE_RPT, system_rpt(at[topics.PACMOD_BRAKE_RPT], enabled=enabled, override_active=overridden,
                                                      output=max(-pedal, 0.0)))
            gear = SHIFT.SHIFT_REVERSE if k >= REVERSE_FROM else SHIFT.SHIFT_FORWARD
            write(topics.PACMOD_SHIFT_RPT, system_rpt(at[topics.PACMOD_SHIFT_RPT], kind="Int", output=gear, command=gear))
            write(topics.PACMOD_SPEED_RPT, Fields("pacmod3_msgs/msg/VehicleSpeedRpt", {
                "header": header_fields(at[topics.PACMOD_SPEED_RPT]),
                "vehicle_speed": speed(t + PHASE_MS[topics.PACMOD_SPEED_RPT] / 1e3),
                "vehicle_speed_valid": not within(k, INVALID_SPEED)}))
            if k % 3 == 0:  # a frame every third tick, between the reports
                stamp = T0 + (k // 3) * FRAME_NS + FRAME_OFFSET_NS
                bag.write(topics.IMAGE, msgs.image_fields(image(k // 3), stamp, "camera"), stamp + FRAME_LOG_DELAY_NS)
                if command:
                    bag.write(topics.REFERENCE_COMMAND, msgs.command_fields(0.01, 0.2, stamp), stamp)
    return path


def frame_times(ticks=TICKS):
    """Stamps (ns) of the frames of `write_car_bag`, and their times since T0 in s."""
    stamps = [T0 + n * FRAME_NS + FRAME_OFFSET_NS for n in range(ticks // 3)]
    return stamps, [(s - T0) / S for s in stamps]


def s(tick, topic=topics.PACMOD_GLOBAL_RPT):
    """The time in s of a report tick."""
    return (report_time(tick, topic) - T0) / S


GUARD_S = 0.1  # config/train.yaml handover_guard_s
# The drive's handovers (s, kind): each engagement seen on the global report, the override on the
# brake report first, the fault's and the operator's disengagements on the global report.
HANDOVERS = ((s(120), "engage"), (s(OVERRIDE[0], topics.PACMOD_BRAKE_RPT), "override"), (s(240), "engage"),
             (s(FAULT[0] + 2), "disengage"), (s(300), "engage"), (s(324), "disengage"))


def near_handover(log, handovers=HANDOVERS, guard_s=GUARD_S):
    """"near_<kind>" of the handover nearest to log time `log` (s) when within the guard, else None."""
    at, kind = min(handovers, key=lambda handover: abs(handover[0] - log))
    return f"near_{kind}" if abs(at - log) < guard_s else None


def expected_drop(t):
    """Why the frame at t s has no label, from the drive's timeline; None: a label."""
    log = t + FRAME_LOG_DELAY_NS / S
    brake_override, fault_disable = s(OVERRIDE[0], topics.PACMOD_BRAKE_RPT), s(FAULT[0] + 2)
    if s(120) <= log < brake_override or s(240) <= log < fault_disable or s(300) <= log < s(324):
        return "stack_driving"
    if near_handover(log):
        return near_handover(log)
    if s(GAP[0] - 1, topics.PACMOD_STEERING_RPT) < t < s(GAP[1], topics.PACMOD_STEERING_RPT):
        return "report_gap"
    if t < s(0, topics.PACMOD_SPEED_RPT):  # before the first speed report
        return "report_gap"
    if s(INVALID_SPEED[0] - 1, topics.PACMOD_SPEED_RPT) < t < s(INVALID_SPEED[1], topics.PACMOD_SPEED_RPT):
        return "speed_invalid"
    if t >= s(REVERSE_FROM, topics.PACMOD_SHIFT_RPT):
        return "reverse"
    if speed(t) < 0.5:
        return "standstill"
    return None


@pytest.fixture(scope="module")
def pixels():
    """The pixels backbone on a 28 px input: a 2x2 grid, fast."""
    return load_extractor({"backbone": "pixels", "input_size": [28, 28]})


@pytest.fixture(scope="module", params=["sqlite3", "mcap"])
def car_bag(request, tmp_path_factory):
    return write_car_bag(tmp_path_factory.mktemp(request.param) / "car_drive", request.param)


SETTINGS = ExtractSettings(intervention_window_s=WINDOW_S)


@pytest.fixture(scope="module")
def car_cache(car_bag, pixels, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "cache"
    return extract([car_bag], out, pixels, {"backbone": "pixels"}, SETTINGS), FeatureCache(out)


def test_the_human_frames_get_the_known_traces_interpolated_to_their_stamps(car_cache):
    report, cache = car_cache
    stamps, times = frame_times()
    kept = [stamp for stamp, t in zip(stamps, times) if expected_drop(t) is None]
    reasons = [expected_drop(t) for t in times]
    expected_counts = {reason: reasons.count(reason) for reason in set(reasons) if reason}
    assert set(expected_counts) == {"stack_driving", "near_engage", "near_override", "near_disengage", "report_gap",
                                    "speed_invalid", "reverse", "standstill"}
    # The 1 s after the override: 10 frames, the first within the guard.
    assert report["car_drive"] == {"written": len(kept), **expected_counts, "written_without_target_speed_mps": len(kept),
                                   "written_intervention": 9}
    np.testing.assert_array_equal(cache.stamps, kept)
    t = (cache.stamps - T0) / S
    ratio = float(car_facts()["steering_ratio"])
    # Linear interpolation between reports 1/30 s apart: error <= (1/30)^2 / 8 * max |f''|; each
    # pedal's kink where the throttle changes sign adds up to (1/30) / 4 * max |throttle'|.
    period = 1 / 30
    np.testing.assert_allclose(cache.targets[:, 0], [steering_wheel(x) / ratio for x in t], atol=period**2 / 8 * 2.0 * math.pi**2 / ratio)
    max_slope = 0.3 * 2 * math.pi * 0.4
    np.testing.assert_allclose(cache.targets[:, 1], [throttle(x) for x in t], atol=2 * period / 4 * max_slope)
    np.testing.assert_allclose(cache.state_values(["speed_mps"])[:, 0], [speed(x) for x in t], atol=1e-2)
    braking = [i for i, x in enumerate(t) if throttle(x) < -0.05]
    assert len(braking) > 10 and np.all(cache.targets[braking, 1] < 0), "the brake pedal is negative throttle"
    assert any(1.25 < x < 2.5 for x in t[braking]) and any(6.25 < x < 7.5 for x in t[braking])


def test_an_override_marks_the_following_frames_a_fault_or_a_disable_does_not(car_cache):
    _, cache = car_cache
    override_s = s(OVERRIDE[0], topics.PACMOD_BRAKE_RPT)
    log = (cache.stamps - T0 + FRAME_LOG_DELAY_NS) / S
    np.testing.assert_array_equal(cache.intervention, (log >= override_s) & (log < override_s + WINDOW_S))
    # Human frames after the fault and after the operator's disable are labels, not interventions.
    assert np.any((log > s(FAULT[0] + 2)) & (log < s(300))) and np.any(log > s(324))
    labels = cache.meta["labels"]["car_drive"]
    assert [i["time_ns"] for i in labels["interventions"]] == [report_time(OVERRIDE[0], topics.PACMOD_BRAKE_RPT)]
    assert labels["from"] == "pacmod3 reports" and "also_in_bag" not in labels
    assert labels["steering_ratio"] == float(car_facts()["steering_ratio"])
    assert labels["rules"] == {"max_report_gap_s": 0.1, "min_speed_mps": 0.5, "exclude_reverse": True,
                               "label_stack_driving": False, "intervention_window_s": WINDOW_S, "handover_guard_s": GUARD_S}
    assert labels["reverse_from"] == [topics.PACMOD_SHIFT_RPT, "negative speed"]


def test_rules_are_settings(car_bag, pixels, tmp_path):
    """The stack's own frames become labels when asked; standstill and reverse ones when the rules allow."""
    settings = ExtractSettings(label_stack_driving=True, min_speed_mps=0.0, exclude_reverse=False)
    report = extract([car_bag], tmp_path / "all", pixels, settings=settings)["car_drive"]
    _, times = frame_times()
    near = {t for t in times if near_handover(t + FRAME_LOG_DELAY_NS / S)}  # now on both sides of each
    gaps = sum(expected_drop(t) in ("report_gap", "speed_invalid") for t in times if t not in near)
    assert report["written"] == len(times) - len(near) - gaps and "stack_driving" not in report and "reverse" not in report


# A drive whose steering jumps at every handover (the stack steers 3 rad of wheel off the human's
# trace), each handover falling between a frame and the reports after it: the stack engages at
# tick 61, the safety driver brakes at 124 (brake report first, enable off from 127), the stack
# engages again at 181 and the operator disengages at 241.
HANDOVER_ENGAGED, HANDOVER_OVERRIDE, HANDOVER_TICKS = ((61, 127), (181, 241)), (124, 130), 300
CHANGES = ((s(61), "engage"), (s(124, topics.PACMOD_BRAKE_RPT), "override"), (s(181), "engage"), (s(241), "disengage"))


def stack_wheel(t):
    return steering_wheel(t) + 3.0


@pytest.fixture(scope="module")
def handover_bag(tmp_path_factory):
    return write_car_bag(tmp_path_factory.mktemp("handover") / "handover", "mcap", ticks=HANDOVER_TICKS,
                         engaged=HANDOVER_ENGAGED, override=HANDOVER_OVERRIDE, stack_wheel=stack_wheel)


def test_no_label_mixes_the_human_with_the_stack_and_frames_near_a_handover_are_dropped(handover_bag, tmp_path, capsys):
    """With the shipped guard (config/train.yaml), from the command line: every frame within the guard
    of a handover is dropped and counted by its kind, every label is the human's; with no guard, the
    frames whose reports straddle a handover are dropped, and every label is still the human's."""
    (tmp_path / "pixels.yaml").write_text("backbone: pixels\ninput_size: [28, 28]\n")
    assert main(["extract", "--out", str(tmp_path / "cache"), "--extractor-config", str(tmp_path / "pixels.yaml"),
                 str(handover_bag)]) == 0
    printed = capsys.readouterr().out
    cache = FeatureCache(tmp_path / "cache")
    ratio = float(car_facts()["steering_ratio"])
    _, times = frame_times(HANDOVER_TICKS)
    logs = [t + FRAME_LOG_DELAY_NS / S for t in times]
    reasons = [near_handover(log, CHANGES) for log in logs]
    stack = [s(61) <= log < s(124, topics.PACMOD_BRAKE_RPT) or s(181) <= log < s(241) for log in logs]
    expected = {kind: sum(r == kind and not on for r, on in zip(reasons, stack)) for kind in ("near_engage", "near_override",
                                                                                                 "near_disengage")}
    assert all(expected.values()), expected  # the drive has human frames within the guard of each kind
    counts = cache.meta["counts"]["handover"]
    assert {kind: counts.get(kind, 0) for kind in expected} == expected
    assert "handovers: engage 2, disengage 1, override 1; dropped " in printed
    assert all(f"{kind} {count}" in printed for kind, count in expected.items()), printed
    assert cache.meta["labels"]["handover"]["rules"]["handover_guard_s"] == GUARD_S

    def assert_only_human_labels(cache):
        t = (cache.stamps - T0) / S
        np.testing.assert_allclose(cache.targets[:, 0], [steering_wheel(x) / ratio for x in t],
                                   atol=(1 / 30) ** 2 / 8 * 2.0 * math.pi**2 / ratio)

    labelled_logs = (cache.stamps - T0 + FRAME_LOG_DELAY_NS) / S
    assert min(abs(log - at) for log in labelled_logs for at, _ in CHANGES) >= GUARD_S
    assert_only_human_labels(cache)

    report = extract([handover_bag], tmp_path / "unguarded", load_extractor({"backbone": "pixels", "input_size": [28, 28]}),
                     settings=ExtractSettings(handover_guard_s=0.0))["handover"]
    assert not any(kind in report for kind in expected) and report["across_handover"] >= 2
    assert_only_human_labels(FeatureCache(tmp_path / "unguarded"))


def test_a_bag_with_both_sources_says_which_it_used(tmp_path, pixels):
    bag = write_car_bag(tmp_path / "both", "mcap", ticks=150, engaged=(), command=True)
    extract([bag], tmp_path / "auto", pixels)
    labels = FeatureCache(tmp_path / "auto").meta["labels"]["both"]
    assert labels["from"] == topics.REFERENCE_COMMAND and labels["also_in_bag"] == "pacmod3 reports"
    np.testing.assert_allclose(FeatureCache(tmp_path / "auto").targets, [[0.01, 0.2]] * 50, atol=1e-7)
    extract([bag], tmp_path / "car", pixels, settings=ExtractSettings(label_source="pacmod3"))
    labels = FeatureCache(tmp_path / "car").meta["labels"]["both"]
    assert labels["from"] == "pacmod3 reports" and labels["also_in_bag"] == topics.REFERENCE_COMMAND


def test_a_car_bag_without_engagement_reports_is_refused(tmp_path, pixels):
    bag = tmp_path / "no_engagement"
    with bagio.BagWriter(bag) as writer:
        for k in range(3):
            t = T0 + k * TICK_NS
            writer.write(topics.IMAGE, msgs.image_fields(image(k), t, "camera"), t)
            for topic in (topics.PACMOD_STEERING_RPT, topics.PACMOD_ACCEL_RPT, topics.PACMOD_BRAKE_RPT):
                writer.write(topic, system_rpt(t), t)
            writer.write(topics.PACMOD_SPEED_RPT, Fields("pacmod3_msgs/msg/VehicleSpeedRpt", {
                "header": header_fields(t), "vehicle_speed": 3.0, "vehicle_speed_valid": True}), t)
    with pytest.raises(ValueError, match="no topic /pacmod/global_rpt .* or /pacmod/enabled"):
        extract([bag], tmp_path / "cache", pixels)
    assert not (tmp_path / "cache").exists()
    report = extract([bag], tmp_path / "cache", pixels, settings=ExtractSettings(label_stack_driving=True))
    assert report["no_engagement"] == {"written": 3, "written_without_target_speed_mps": 3}  # reports at the frames' stamps


def test_from_pacmod_reads_back_what_to_pacmod_sends():
    limits = ControlLimits()
    for steering, throttle_value in ((0.1, 0.2), (-0.3, -0.5), (0.0, 0.0)):
        sent = to_pacmod(VehicleCommand(True, False, steering, throttle_value, False, (), None, EngageState.ENGAGED), limits, 14.8)
        assert from_pacmod(sent.steering_wheel_rad, sent.accel, sent.brake, 14.8) == pytest.approx((steering, throttle_value))
    with pytest.raises(ValueError, match="steering_ratio"):
        from_pacmod(1.0, 0.0, 0.0, 0.0)


def test_training_weighs_intervention_frames(tmp_path):
    """intervention_weight 1 trains exactly as a cache without marks; another weight differently."""
    from sps_driving.train.trainer import TrainConfig, train

    rng = np.random.default_rng(0)
    frames = [(rng.normal(size=(4, 6)), rng.uniform(-0.2, 0.2), rng.uniform(-1, 1)) for _ in range(40)]
    meta = {"backbone": "test-random", "grid": {"rows": 2, "cols": 2}, "descriptor_dim": 6}
    for name, marked in (("plain", False), ("marked", True)):
        with FeatureCacheWriter(tmp_path / name, meta) as writer:
            for i, (descriptors, steering, throttle_value) in enumerate(frames):
                writer.add(descriptors, steering, throttle_value, T0 + i * FRAME_NS, "drive", intervention=marked and i % 4 == 0)
    assert FeatureCache(tmp_path / "marked").intervention.sum() == 10
    assert not FeatureCache(tmp_path / "plain").intervention.any()

    def weights(cache, out, weight):
        cfg = TrainConfig.from_yaml(cache=str(tmp_path / cache), out=str(tmp_path / out), epochs=2, batch_size=8, width=8,
                                    reduce=2, state_inputs=[], device="cpu", intervention_weight=weight)
        train(cfg)
        from safetensors.torch import load_file

        return load_file(str(tmp_path / out / "last" / "policy.safetensors"))

    plain, neutral, heavy = weights("plain", "p", 1.0), weights("marked", "n", 1.0), weights("marked", "h", 5.0)
    assert all(torch.equal(plain[k], neutral[k]) for k in plain)
    assert any(not torch.equal(plain[k], heavy[k]) for k in plain)
    recorded = json.loads((tmp_path / "h" / "config.json").read_text())["training"]
    assert recorded["intervention_weight"] == 5.0 and recorded["intervention_frames"] > 0


def test_replay_compares_with_the_human_on_the_frames_extract_labels(car_bag, car_cache):
    """The replay's reference of a car bag: the cache's labels, frame for frame."""
    from sps_driving.tools.replay import build_report, human_reference

    _, cache = car_cache
    car = read_car_labels(read_drive(car_bag), SETTINGS.car_label_rules(), float(car_facts()["steering_ratio"]))
    stamps, _ = frame_times()
    reference, excluded = human_reference(car, {stamp: stamp + FRAME_LOG_DELAY_NS for stamp in stamps})
    assert sorted(reference) == cache.stamps.tolist()
    np.testing.assert_allclose([reference[s] for s in cache.stamps.tolist()], cache.targets, atol=1e-6)
    assert sum(excluded.values()) == len(stamps) - len(cache)
    # A policy that answers with the human's steering and no throttle: exact steering, the throttle's error.
    policy = {stamp: (ref[0], 0.0) for stamp, ref in reference.items()}
    records = [msgs_record(stamp, command) for stamp, command in policy.items()]
    report = build_report({stamp: stamp for stamp in stamps}, records, reference, 1.0)
    assert report["reference_commands"] == len(cache) and report["steering_mae"] == pytest.approx(0.0, abs=1e-12)
    assert report["throttle_mae"] == pytest.approx(np.abs(cache.targets[:, 1]).mean(), rel=1e-5)


def msgs_record(stamp, command):
    from sps_driving.tools.replay import Record

    return Record(topics.POLICY_COMMAND, stamp, bagio.to_bag(msgs.command_fields(*command, stamp)))


def test_the_recording_profile_holds_what_extract_replay_and_interventions_read(tmp_path, capsys):
    from sps_driving.core.state import STATE_INPUTS
    from sps_driving.ros.car_labels import ENGAGEMENT_REPORTS, GEAR_REPORT, REPORTS
    from sps_driving.tools.record import load_profile, record_command
    from sps_driving.tools.replay import PLAYED

    profile = load_profile()
    recorded = set(profile["topics"])
    needed = {topics.IMAGE_COMPRESSED, topics.CAMERA_INFO, GEAR_REPORT[0], *(t for t, _ in REPORTS.values()),
              *(t for t, _ in ENGAGEMENT_REPORTS), *PLAYED, topics.PACMOD_TURN_RPT,
              *(spec.sources[0][0] for spec in STATE_INPUTS.values())}
    assert needed - {topics.VEHICLE_TWIST} <= recorded  # the car's speed is PACMod's report, not the world's twist
    assert profile["storage"] == "mcap"
    command = record_command("drives/d1", profile, camera_topic="/flir_camera/image_raw",
                             camera_info_topic="/flir_camera/camera_info")
    assert command[:7] == ["ros2", "bag", "record", "-s", "mcap", "-o", "drives/d1"]
    assert "/flir_camera/image_raw/compressed" in command and topics.IMAGE_COMPRESSED not in command
    assert topics.CAMERA_INFO not in command and len(command) == 7 + len(recorded)
    assert {topics.DRIVER_NOTE, topics.SAFETY_STOP, topics.FAILSAFE_STATUS, topics.SELECTION} <= recorded
    assert profile["camera"] == {"compression": "jpeg", "jpeg_quality": 90}
    assert main(["record", str(tmp_path / "d2"), "--print"]) == 0
    republish, record = capsys.readouterr().out.strip().splitlines()
    assert republish.startswith("ros2 run image_transport republish raw compressed --ros-args -r in:=/camera/image_raw ")
    assert "out/compressed:=/camera/image_raw/compressed" in republish and "out.jpeg_quality:=90" in republish
    assert record.startswith(f"ros2 bag record -s mcap -o {tmp_path / 'd2'} /camera/image_raw/compressed ")
    raw = tmp_path / "raw.yaml"
    raw.write_text(f"storage: mcap\ncamera: {{compression: none}}\ntopics: {{{topics.IMAGE}: camera}}\n")
    assert main(["record", str(tmp_path / "d3"), "--print", "--profile", str(raw)]) == 0
    assert capsys.readouterr().out.strip() == f"ros2 bag record -s mcap -o {tmp_path / 'd3'} /camera/image_raw"


@pytest.mark.ros
def test_a_car_bag_trains_a_policy_whose_replay_shows_its_commands_against_the_humans(tmp_path, capsys):
    """Done when: `extract` of a car bag, `train`, then `replay` of the same bag through the node
    processes: every frame gets a command or a drop reason, and the report's errors are the
    policy's recorded commands against the human's labels on the frames extract kept."""
    from sps_driving.ros.bagio import read_messages
    from sps_driving.tools.replay import format_report

    bag = write_car_bag(tmp_path / "car_drive", "mcap")
    (tmp_path / "pixels.yaml").write_text("backbone: pixels\ninput_size: [28, 28]\n")
    cache_dir, policy = tmp_path / "cache", tmp_path / "policy"
    assert main(["extract", "--out", str(cache_dir), "--extractor-config", str(tmp_path / "pixels.yaml"), str(bag)]) == 0
    printed = capsys.readouterr().out
    assert "labels from pacmod3 reports" in printed and "safety-driver interventions: 1" in printed
    # The car records no cruise target: the policy reads the speed only.
    assert main(["train", "--cache", str(cache_dir), "--out", str(policy), "--epochs", "2", "--width", "16", "--reduce", "2",
                 "--state-inputs", "speed_mps", "--validation-fraction", "0.3", "--device", "cpu"]) == 0
    capsys.readouterr()
    out = tmp_path / "replayed"
    assert main(["replay", str(bag), "--out", str(out), "--json", "--checkpoint", str(policy), "--frame-timeout", "60",
                 "--log-dir", str(tmp_path / "logs")]) == 0
    report = json.loads(capsys.readouterr().out)
    frames = len(frame_times()[0])
    assert report["frames_in"] == frames and report["frames_out"] + report["frames_dropped"] == frames
    assert report["frames_out"] >= frames - 4, report["drops"]  # at most the frames without a valid speed around them
    commands = {msgs.stamp_ns(m.msg.header): msgs.command_from_message(m.msg) for m in read_messages(out, [topics.POLICY_COMMAND])}
    cache = FeatureCache(cache_dir)
    human = {stamp: tuple(target) for stamp, target in zip(cache.stamps.tolist(), cache.targets.tolist()) if stamp in commands}
    assert report["reference_source"].startswith("pacmod3 reports") and report["reference_commands"] == len(human) > 40
    steering_errors = [abs(commands[stamp][0] - ref[0]) for stamp, ref in human.items()]
    throttle_errors = [abs(commands[stamp][1] - ref[1]) for stamp, ref in human.items()]
    assert report["steering_mae"] == pytest.approx(np.mean(steering_errors), rel=1e-5)
    assert report["throttle_mae"] == pytest.approx(np.mean(throttle_errors), rel=1e-5)
    assert sum(report["reference_excluded"].values()) == frames - len(cache)
    assert report["reference_excluded"]["stack_driving"] > 0
    assert "reference commands matched" in format_report(report) and "frames without the human's command" in format_report(report)
