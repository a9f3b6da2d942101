"""Every command that reads a bag takes the same inputs: a rosbag2 folder (sqlite3 or mcap), a
bare .mcap file (what MCAP writers and `ros2 bag record -s mcap` hand out without metadata.yaml)
and a bare .db3 file; anything else is a clear error. One small car drive (camera frames and
PACMod 3 reports, one engagement) written each way goes through `extract`, `interventions`,
`analyze` and `replay`, which must read the same drive from each."""

import json
import shutil

import numpy as np
import pytest
from test_car_labels import write_car_bag

from sps_driving.cli import main
from sps_driving.ros import bagio
from sps_driving.train.cache import FeatureCache

TICKS = 90  # 3 s of reports at 30 Hz, 30 camera frames
ENGAGED = ((45, 75),)  # the stack drives from 1.5 s to 2.5 s
SHAPES = ("folder-sqlite3", "folder-mcap", "bare-mcap", "bare-db3")


def write_shape(directory, shape):
    """The drive as `shape`: a rosbag2 folder `drive`, or its storage file alone as `drive.mcap` / `drive.db3`."""
    kind, storage = shape.split("-")
    folder = write_car_bag(directory / "drive", "sqlite3" if storage == "db3" else storage, ticks=TICKS, engaged=ENGAGED)
    if kind == "folder":
        return folder
    (file,) = folder.glob(f"*.{storage}")
    bare = file.rename(directory / f"drive.{storage}")
    shutil.rmtree(folder)
    return bare


@pytest.fixture(scope="module")
def bags(tmp_path_factory):
    return {shape: write_shape(tmp_path_factory.mktemp(shape), shape) for shape in SHAPES}


def test_every_shape_is_a_bag_of_the_same_drive(bags):
    reference = bags["folder-sqlite3"]
    for shape, path in bags.items():
        assert bagio.is_bag(path), shape
        assert bagio.bag_name(path) == "drive"
        assert bagio.topic_types(path) == bagio.topic_types(reference), shape
        assert bagio.message_count(path, "/camera/image_raw") == TICKS // 3


@pytest.mark.parametrize("shape", SHAPES)
def test_extract_interventions_and_analyze_read_each_shape_alike(bags, shape, tmp_path, capsys):
    reference, path = bags["folder-sqlite3"], bags[shape]
    pixels = tmp_path / "pixels.yaml"
    pixels.write_text("backbone: pixels\ninput_size: [28, 28]\n")

    def extracted(bag, out):
        assert main(["extract", "--out", str(out), "--extractor-config", str(pixels), str(bag)]) == 0
        return capsys.readouterr().out, FeatureCache(out)

    printed, cache = extracted(path, tmp_path / "cache")
    _, expected = extracted(reference, tmp_path / "reference")
    assert "labels from pacmod3 reports" in printed and "drive: " in printed
    assert len(cache) > 0 and cache.meta["counts"] == expected.meta["counts"]
    np.testing.assert_array_equal(cache.stamps, expected.stamps)
    np.testing.assert_array_equal(cache.targets, expected.targets)

    def interventions(bag):
        assert main(["interventions", str(bag), "--json", "--out", str(tmp_path / "report")]) == 0
        drive = json.loads(capsys.readouterr().out)["drives"][0]
        return {k: drive[k] for k in ("events", "engaged_s", "engaged_km", "distance_km", "duration_s", "start_ns")}

    summary = interventions(path)
    assert summary == interventions(reference) and summary["engaged_s"] == pytest.approx(1.0, abs=0.05)

    assert main(["analyze", str(path), "--out", str(tmp_path / "analysis"), "--extractor-config", str(pixels)]) == 0
    assert json.loads((tmp_path / "analysis" / "summary.json").read_text())["frames"] == TICKS // 3


@pytest.mark.ros
@pytest.mark.parametrize("shape", ("folder-sqlite3", "folder-mcap", "bare-mcap"))
def test_replay_reads_each_shape(bags, shape, tmp_path, capsys):
    """Every frame through the live graph (a tiny policy that reads the speed from the PACMod
    report, the real DINOv2 at 112 px), compared with the human's driving on the frames the car's
    labels keep: the same count `extract` writes."""
    from samples import tiny_policy

    ckpt = tiny_policy(tmp_path / "ckpt", rows=8, cols=8, dim=384, state_inputs=("speed_mps",))
    (tmp_path / "extraction.yaml").write_text("input_size: [112, 112]\n")
    assert main(["replay", str(bags[shape]), "--out", str(tmp_path / "out"), "--json", "--checkpoint", str(ckpt),
                 "--backbone-config", str(tmp_path / "extraction.yaml"), "--log-dir", str(tmp_path / "logs")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["frames_in"], report["frames_out"]) == (TICKS // 3, TICKS // 3), report["drops"]
    assert report["reference_source"].startswith("pacmod3 reports")
    (tmp_path / "pixels.yaml").write_text("backbone: pixels\ninput_size: [28, 28]\n")
    assert main(["extract", "--out", str(tmp_path / "cache"), "--extractor-config", str(tmp_path / "pixels.yaml"),
                 str(bags[shape])]) == 0
    assert report["reference_commands"] == len(FeatureCache(tmp_path / "cache")) > 0


def test_what_is_no_bag_is_a_clear_error_in_every_command(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a bag")
    broken = tmp_path / "broken.mcap"
    broken.write_bytes(b"\x89MCAP0\r\n" + bytes(64))
    cut_short = tmp_path / "cut_short"  # a recording stopped before rosbag2 wrote metadata.yaml
    cut_short.mkdir()
    shutil.copy(broken, cut_short / "cut_short_0.mcap")
    expected = {notes: "is not a bag: expected a rosbag2 folder (with metadata.yaml), a .mcap file or a .db3 file",
                broken: "cannot read the bag", cut_short: f"ros2 bag reindex {cut_short}", tmp_path / "missing": "no bag"}
    for path, message in expected.items():
        for command in (["extract", "--out", str(tmp_path / "cache")], ["interventions", "--out", str(tmp_path / "report")],
                        ["replay"],
                        ["analyze", "--out", str(tmp_path / "analysis")]):
            assert main([*command, str(path)]) == 2, (command, path)
            captured = capsys.readouterr()
            assert message in captured.out + captured.err, (command, path, captured)
    with pytest.raises(bagio.BagError, match="is not a bag"):
        bagio.topic_types(notes)


def test_a_damaged_bag_is_a_bag_error_however_it_is_damaged(bags, tmp_path):
    """Bytes overwritten anywhere in a storage file: each read either gets the messages or stops
    with a BagError that names the bag, never another exception."""
    errors = 0
    for shape in ("bare-mcap", "bare-db3"):
        data = bags[shape].read_bytes()
        for fraction in np.linspace(0.05, 0.95, 10):
            at = int(len(data) * fraction)
            damaged = tmp_path / f"damaged{bags[shape].suffix}"
            damaged.write_bytes(data[:at] + bytes([0xAB]) * 4096 + data[at + 4096:])
            try:
                sum(1 for _ in bagio.read_messages(damaged))
            except bagio.BagError as exc:
                assert str(damaged) in str(exc)
                errors += 1
    assert errors > 0
