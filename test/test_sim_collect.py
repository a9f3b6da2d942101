"""`sps-driving collect` writes real rosbag2 files that read back with the car's topics and types."""

import json
import math

import numpy as np
import pytest

from sps_driving.cli import main
from sps_driving.core import topics
from sps_driving.core.image import to_rgb
from sps_driving.ros.bagio import read_messages, topic_types
from sps_driving.ros.msgs import stamp_ns

EXPECTED_TYPES = {
    topics.IMAGE: "sensor_msgs/msg/Image",
    topics.CAMERA_INFO: "sensor_msgs/msg/CameraInfo",
    topics.REFERENCE_COMMAND: "sensor_msgs/msg/JointState",
    topics.VEHICLE_TWIST: "geometry_msgs/msg/TwistStamped",
    topics.TARGET_SPEED: "geometry_msgs/msg/TwistStamped",
    topics.LANE_POSE: "geometry_msgs/msg/PoseStamped",
    topics.OBSTACLE_RANGE: "sensor_msgs/msg/Range",
}


@pytest.mark.parametrize("storage", ["sqlite3", "mcap"])
def test_collect_writes_rosbag2_with_the_car_topics(tmp_path, storage):
    out = tmp_path / "drives"
    assert main(["collect", "--out", str(out), "--episodes", "2", "--seed", "5", "--episode-s", "1.5", "--width", "160",
                 "--storage", storage]) == 0
    bags = sorted(p for p in out.iterdir() if p.is_dir())
    assert [b.name for b in bags] == ["episode_00000", "episode_00001"]
    manifest = json.loads((out / "collect.json").read_text())
    assert manifest["scenario"] == "rural-summer-dry-day-car" and manifest["image_size"] == [160, 100]
    assert all(r["interventions"] == 0 for r in manifest["results"])

    first_stamps = []
    for bag in bags:
        assert topic_types(bag) == EXPECTED_TYPES
        by_topic = {}
        for m in read_messages(bag):
            by_topic.setdefault(m.topic, []).append(m)
        assert {t: len(v) for t, v in by_topic.items()} == {t: 15 for t in EXPECTED_TYPES}
        images = by_topic[topics.IMAGE]
        stamps = [stamp_ns(m.msg.header) for m in images]
        assert np.all(np.diff(stamps) == 100_000_000)  # 10 Hz
        first_stamps.append(stamps[0])
        for topic in EXPECTED_TYPES:  # every topic carries the frame's stamp
            assert [stamp_ns(m.msg.header) for m in by_topic[topic]] == stamps
        img = images[0].msg
        rgb = to_rgb(img.data, img.height, img.width, img.encoding, img.step)
        assert rgb.shape == (100, 160, 3) and rgb.std() > 10
        info = by_topic[topics.CAMERA_INFO][0].msg
        assert info.k[0] == pytest.approx(80 / math.tan(math.radians(65)))
        for m in by_topic[topics.REFERENCE_COMMAND]:
            assert list(m.msg.name) == list(topics.COMMAND_NAMES)
            steering, throttle = m.msg.position
            assert math.isfinite(steering) and abs(steering) <= 0.55 and -1 <= throttle <= 1
        speeds = [m.msg.twist.linear.x for m in by_topic[topics.VEHICLE_TWIST]]
        assert min(speeds) > 3.0
        # the episode's cruise target, the same in every frame, within config/sim.yaml's range
        targets = {m.msg.twist.linear.x for m in by_topic[topics.TARGET_SPEED]}
        assert len(targets) == 1 and 8.0 <= targets.pop() <= 12.0
        assert all(abs(m.msg.pose.position.y) < 1.8 for m in by_topic[topics.LANE_POSE])
    assert first_stamps[1] > first_stamps[0]  # episodes do not overlap in time


@pytest.mark.parametrize("flat", [False, True])
def test_collect_refuses_to_overwrite(tmp_path, flat):
    out = tmp_path / "drives"
    args = ["collect", "--out", str(out), "--episodes", "1", "--episode-s", "0.3", "--width", "96"] + (["--flat"] if flat else [])
    assert main(args) == 0
    bag = out if flat else out / "episode_00000"
    assert topic_types(bag)[topics.IMAGE] == "sensor_msgs/msg/Image"
    assert (out / "collect.json").is_file()
    with pytest.raises(SystemExit, match="exists"):
        main(args)


def test_collection_layouts_stay_apart_from_evaluation_layouts(tmp_path):
    from sps_driving.sim.collect import episode_seed
    from sps_driving.sim.world import COLLECTION_SEED_BASE

    assert episode_seed(0, 0) == COLLECTION_SEED_BASE and episode_seed(2, 7) == COLLECTION_SEED_BASE + 20_007
    with pytest.raises(SystemExit, match="--seed must be at least 0"):
        main(["collect", "--out", str(tmp_path / "drives"), "--seed", "-1"])
