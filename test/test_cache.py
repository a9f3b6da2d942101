import json

import numpy as np
import pytest
import torch

from sps_driving.train.cache import FeatureCache, FeatureCacheWriter

META = {"backbone": "test-random", "grid": {"rows": 2, "cols": 3}, "descriptor_dim": 4, "extractor": {"name": "x"}}


def frames(count, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(6, 4)).astype(np.float32), float(rng.uniform(-0.3, 0.3)), float(rng.uniform(-1, 1)),
             1_000_000 + i * 33_333_333, "episode_a" if i < 4 else "episode_b") for i in range(count)]


def write(directory, data, shard_size=3, table=True):
    table_values = np.arange(12, dtype=np.float32).reshape(6, 2) if table else None
    with FeatureCacheWriter(directory, META, table_values, shard_size=shard_size) as writer:
        for frame in data:
            writer.add(*frame)
    return table_values


def test_round_trip_across_shards(tmp_path):
    data = frames(7)
    table = write(tmp_path / "c", data)
    cache = FeatureCache(tmp_path / "c")
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    assert [s["frames"] for s in meta["shards"]] == [3, 3, 1]
    assert meta["dtype"] == "float16" and meta["frames"] == 7 and meta["extractor"] == {"name": "x"}
    assert len(cache) == 7 and cache.sources == ["episode_a", "episode_b"]
    assert cache.grid.rows == 2 and cache.grid.cols == 3 and cache.descriptor_dim == 4
    for i, (desc, steering, throttle, stamp, source) in enumerate(data):
        frame = cache[i]
        assert frame.descriptors.dtype == np.float16
        np.testing.assert_array_equal(frame.descriptors, desc.astype(np.float16))
        assert frame.steering == pytest.approx(steering) and frame.throttle == pytest.approx(throttle)
        assert frame.stamp_ns == stamp and frame.source == source
    assert isinstance(cache._shards[0], np.memmap), "descriptors are memory-mapped"
    np.testing.assert_array_equal(cache.descriptors([6, 0]), np.stack([data[6][0], data[0][0]]).astype(np.float16))
    np.testing.assert_array_equal(cache.position_table(), table)
    np.testing.assert_array_equal(cache.source_ids, [0, 0, 0, 0, 1, 1, 1])
    grid, target, stamp, index = cache.dataset([5, 2])[0]
    assert grid.dtype == torch.float32 and grid.shape == (6, 4) and int(index) == 5 and int(stamp) == data[5][3]
    assert target.tolist() == pytest.approx([data[5][1], data[5][2]])
    with pytest.raises(IndexError):
        cache[7]


def test_bad_frames_are_rejected_and_nothing_of_them_is_written(tmp_path):
    good = frames(1)[0]
    with FeatureCacheWriter(tmp_path / "c", META, shard_size=2) as writer:
        bad_cases = [
            ((np.full((6, 4), np.nan, np.float32),) + good[1:], "NaN"),
            ((np.ones((5, 4), np.float32),) + good[1:], "must be"),
            ((np.full((6, 4), 1e6, np.float32),) + good[1:], "float16 range"),
            ((good[0], float("nan"), 0.0, 1, "a"), "finite"),
            ((good[0], 0.0, 0.0, -1, "a"), "stamp"),
        ]
        for args, match in bad_cases:
            with pytest.raises(ValueError, match=match):
                writer.add(*args)
        writer.add(*good)
    cache = FeatureCache(tmp_path / "c")
    assert len(cache) == 1 and cache.position_table() is None


def test_an_aborted_write_leaves_no_cache(tmp_path):
    with pytest.raises(RuntimeError):
        with FeatureCacheWriter(tmp_path / "c", META, shard_size=2) as writer:
            for frame in frames(3):
                writer.add(*frame)
            raise RuntimeError("extraction failed")
    with pytest.raises(FileNotFoundError, match="sps-driving extract"):
        FeatureCache(tmp_path / "c")


def test_existing_directory_is_not_overwritten_by_accident(tmp_path):
    write(tmp_path / "c", frames(2))
    with pytest.raises(FileExistsError):
        FeatureCacheWriter(tmp_path / "c", META)
    write_again = FeatureCacheWriter(tmp_path / "c", META, overwrite=True)
    write_again.close()
    assert len(FeatureCache(tmp_path / "c")) == 0


def test_damaged_caches_give_clear_errors(tmp_path):
    write(tmp_path / "c", frames(7))
    (tmp_path / "c" / "shard_00001" / "targets.npy").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="shard_00001/targets.npy"):
        FeatureCache(tmp_path / "c")

    write(tmp_path / "d", frames(4))
    np.save(tmp_path / "d" / "shard_00000" / "descriptors.npy", np.zeros((3, 6, 5), np.float16))
    with pytest.raises(ValueError, match="meta.json says"):
        FeatureCache(tmp_path / "d")

    with pytest.raises(ValueError, match="meta needs"):
        FeatureCacheWriter(tmp_path / "e", {"backbone": "x"})


def test_several_caches_read_as_one_with_distinct_sources(tmp_path):
    first, second = frames(7, seed=0), frames(5, seed=1)
    write(tmp_path / "day1", first)
    write(tmp_path / "day2", second, shard_size=2)
    cache = FeatureCache([tmp_path / "day1", tmp_path / "day2"])
    assert len(cache) == 12 and cache.meta["frames"] == 12
    # equal bag names in two caches stay two sources each (the validation split goes by source)
    assert cache.sources == ["day1/episode_a", "day1/episode_b", "day2/episode_a", "day2/episode_b"]
    for i, (desc, _steering, _, stamp, source) in enumerate(first + second):
        frame = cache[i]
        np.testing.assert_array_equal(frame.descriptors, desc.astype(np.float16))
        assert frame.stamp_ns == stamp and frame.source == ("day1/" if i < 7 else "day2/") + source
    np.testing.assert_array_equal(cache.descriptors([8, 2]), np.stack([second[1][0], first[2][0]]).astype(np.float16))
    # caches of different extractors cannot be mixed
    other = dict(META, descriptor_dim=5)
    with FeatureCacheWriter(tmp_path / "other", other, None) as writer:
        writer.add(np.zeros((6, 5), np.float32), 0.0, 0.0, 1, "episode_a")
    with pytest.raises(ValueError, match="differ in"):
        FeatureCache([tmp_path / "day1", tmp_path / "other"])


def test_state_inputs_round_trip_and_unknown_ones_are_nan(tmp_path):
    data = frames(5)
    states = [{"speed_mps": 5.0 + i, "target_speed_mps": 9.0} for i in range(4)] + [{"target_speed_mps": float("nan")}]
    with FeatureCacheWriter(tmp_path / "c", META, shard_size=2) as writer:
        for frame, state in zip(data, states):
            writer.add(*frame, state=state)
        with pytest.raises(ValueError, match="unknown state inputs"):
            writer.add(*data[0], state={"gear": 3})
        with pytest.raises(ValueError, match="finite or NaN"):
            writer.add(*data[0], state={"speed_mps": float("inf")})
    cache = FeatureCache(tmp_path / "c")
    assert len(cache) == 5 and json.loads((tmp_path / "c" / "meta.json").read_text())["state"] == ["speed_mps", "target_speed_mps"]
    np.testing.assert_array_equal(cache.state_values(["speed_mps"])[:, 0], [5, 6, 7, 8, np.nan])
    np.testing.assert_array_equal(cache.state_values(["target_speed_mps", "speed_mps"])[1], [9, 6])
    assert cache[2].state == {"speed_mps": 7.0, "target_speed_mps": 9.0}
    assert np.isnan(cache[4].state["speed_mps"]) and np.isnan(cache[4].state["target_speed_mps"])


def test_caches_from_before_state_inputs_read_with_the_state_unknown(tmp_path):
    write(tmp_path / "old", frames(4))
    meta_path = tmp_path / "old" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["state"]  # as written before state inputs existed: no "state" key, no state.npy
    meta_path.write_text(json.dumps(meta))
    for shard in meta["shards"]:
        (tmp_path / "old" / shard["path"] / "state.npy").unlink()
    with FeatureCacheWriter(tmp_path / "new", META, shard_size=2) as writer:
        for i, frame in enumerate(frames(3)):
            writer.add(*frame, state={"speed_mps": float(i), "target_speed_mps": 8.0})
    old = FeatureCache(tmp_path / "old")
    assert len(old) == 4 and np.isnan(old.state_values(["speed_mps", "target_speed_mps"])).all()
    both = FeatureCache([tmp_path / "old", tmp_path / "new"])
    assert both.state.shape == (7, 2) and np.isnan(both.state[:4]).all()
    np.testing.assert_array_equal(both.state[4:], [[0, 8], [1, 8], [2, 8]])
