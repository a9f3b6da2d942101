"""`extract`, `eval` and `dagger` under torchrun: two real CPU processes on the gloo backend give
what one process gives, a process killed mid-run resumes (on another number of processes) to the
same cache and results, and processes that disagree on their settings stop with a clear error.
Tiny inputs: a tiny random BLIP-2 of the real architecture, masked DINOv2 on a 2x3 grid, 1 s episodes."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml
from samples import tiny_policy

from sps_driving.cli import main
from sps_driving.core import topics
from sps_driving.core.resources import config_path
from sps_driving.ros import bagio, msgs
from sps_driving.train.cache import PROGRESS_DIR, FeatureCache

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_700_000_000_000_000_000
FRAME_NS = 33_333_333
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def image(i):
    return np.random.default_rng(i).integers(0, 256, size=(60, 96, 3), dtype=np.uint8)


def torchrun(*args, processes=2):
    """Start `sps-driving ARGS` under torchrun on this machine (gloo: CPU processes)."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                             "-m", "sps_driving.cli", *map(str, args)], cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finished(process, timeout=120):
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def rank_pid(parent: int, rank: int) -> int:
    """The process id of torchrun `parent`'s worker of RANK `rank` (its descendants' environments)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    todo = list(children.get(parent, []))
    while todo:
        pid = todo.pop()
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
        todo += children.get(pid, [])
    raise LookupError(f"no rank {rank} under process {parent}")


def wait_for(path: Path, process, timeout=90):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, finished(process)
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def same_cache(a: Path, b: Path, same_inputs=True):
    """The caches hold the same frames, labels, sources, states and descriptors in the same shards
    (and, with `same_inputs`, name the same input paths)."""
    one, other = FeatureCache(a), FeatureCache(b)
    assert len(one) == len(other) > 0
    assert one.sources == other.sources
    np.testing.assert_array_equal(one.source_ids, other.source_ids)
    np.testing.assert_array_equal(one.stamps, other.stamps)
    np.testing.assert_array_equal(one.targets, other.targets)
    np.testing.assert_array_equal(one.state, other.state)
    np.testing.assert_array_equal(one.intervention, other.intervention)
    # The processes may compute on other thread counts: the same descriptors up to float16 rounding.
    np.testing.assert_allclose(one.descriptors(range(len(one))), other.descriptors(range(len(other))), atol=2e-3, rtol=2e-3)
    for key in ("counts", "labels", "shards", "frames", "extractor", *(("inputs",) if same_inputs else ())):
        assert one.meta.get(key) == other.meta.get(key), key
    assert not (a / PROGRESS_DIR).exists() and not (b / PROGRESS_DIR).exists()


# ---- extract ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def extraction(tmp_path_factory):
    """Two bags (one frame without a command, one truncated image), an image folder (a missing
    image, a bad label row), a tiny BLIP-2 saved as a local Hugging Face folder, and units of 2
    camera frames (shard_size 2): 9 units."""
    from sps_driving.core.backbones.blip2 import Blip2Extractor, tiny_blip2_config

    root = tmp_path_factory.mktemp("extraction")
    for name, count in (("drive_a", 7), ("drive_b", 4)):
        with bagio.BagWriter(root / name) as writer:
            for i in range(count):
                stamp = T0 + i * FRAME_NS
                msg = bagio.to_bag(msgs.image_fields(image(100 * count + i), stamp, "camera"))
                if (name, i) == ("drive_a", 4):
                    msg.data = msg.data[:100]
                writer.write(topics.IMAGE, msg, stamp)
                if (name, i) != ("drive_a", 2):
                    writer.write(topics.REFERENCE_COMMAND, msgs.command_fields(0.01 * i, 0.1 * i, stamp), stamp)
    folder = root / "yard"
    folder.mkdir()
    rows = ["filename,steering,throttle,speed_mps"]
    for i in range(4):
        cv2.imwrite(str(folder / f"{i}.png"), image(i))
        rows.append(f"{i}.png,{0.02 * i},0.3,{2.0 + i}")
    rows += ["missing.png,0.0,0.0,", "0.png,x,0.0,"]
    (folder / "labels.csv").write_text("\n".join(rows) + "\n")
    Blip2Extractor.from_hf_config(tiny_blip2_config(), {"dim": 16}).model.save_pretrained(root / "blip2")
    (root / "extractor.yaml").write_text(f"backbone: blip2\nmodel_path: {root / 'blip2'}\ndim: 16\ndevice: cpu\n")
    train = yaml.safe_load(config_path("train.yaml").read_text())
    train["extract"]["shard_size"] = 2
    (root / "train.yaml").write_text(yaml.safe_dump(train))
    inputs = [root / "drive_a", root / "drive_b", folder]
    options = ["--config", root / "train.yaml", "--extractor-config", root / "extractor.yaml"]
    assert main(["extract", "--out", str(root / "one"), *map(str, options), *map(str, inputs)]) == 0
    return root, inputs, options


def test_two_processes_extract_the_cache_one_process_does(extraction, tmp_path):
    root, inputs, options = extraction
    code, out, err = finished(torchrun("extract", "--out", tmp_path / "two", *options, *inputs))
    assert code == 0, err[-3000:]
    assert "13 frames from 3 input(s)" in out and "by 2 processes" in out
    # Each process says what it takes: 9 units of 2 camera frames (an input's last: what remains).
    assert "[rank 0/2] extract: 5 of 9 units" in err and "[rank 1/2] extract: 4 of 9 units" in err
    same_cache(root / "one", tmp_path / "two")
    meta = FeatureCache(tmp_path / "two").meta
    assert meta["counts"]["drive_a"] == {"written": 5, "no_command_in_tolerance": 1, "undecodable_image": 1,
                                         "written_without_speed_mps": 5, "written_without_target_speed_mps": 5}
    assert meta["counts"]["yard"]["bad_label_row"] == 1 and meta["counts"]["yard"]["undecodable_image"] == 1
    assert [s["path"] for s in meta["shards"]][:3] == ["shard_00000_00000", "shard_00000_00001", "shard_00000_00002"]


def test_a_killed_process_resumes_on_another_number_of_processes_to_the_same_cache(extraction, tmp_path):
    """Process 1 writes its first unit (the folder's first two rows), then waits on its next image,
    a named pipe that nobody writes: it is killed there, and torchrun stops process 0. One process
    then finishes the cache, keeping the units already written."""
    root, inputs, options = extraction
    original, folder = inputs[2], tmp_path / "yard"
    folder.mkdir()
    for path in (original / "labels.csv", *sorted(original.glob("*.png"))):
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "2.png").unlink()
    os.mkfifo(folder / "2.png")
    inputs = [*inputs[:2], folder]
    out = tmp_path / "cache"
    run = torchrun("extract", "--out", out, *options, *inputs)
    wait_for(out / PROGRESS_DIR / "00002_00000.json", run)
    os.kill(rank_pid(run.pid, 1), signal.SIGKILL)
    code, _, err = finished(run)
    assert code != 0 and not (out / "meta.json").exists()
    written = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_*")}
    assert "shard_00002_00000" in written and "shard_00002_00001" not in written

    (folder / "2.png").unlink()
    (folder / "2.png").write_bytes((original / "2.png").read_bytes())
    assert main(["extract", "--out", str(out), *map(str, options), *map(str, inputs)]) == 0
    assert {name: (out / name).stat().st_mtime_ns for name in written} == written, "finished units are kept"
    same_cache(root / "one", out, same_inputs=False)  # a copy of the image folder


def test_an_extraction_with_other_settings_is_not_resumed_into_the_cache(extraction, tmp_path):
    root, inputs, options = extraction
    out = tmp_path / "cache"
    (out / PROGRESS_DIR).mkdir(parents=True)
    (out / PROGRESS_DIR / "plan.json").write_text(json.dumps({"units": ["00000_00000"]}))
    assert main(["extract", "--out", str(out), *map(str, options), *map(str, inputs)]) == 2
    assert main(["extract", "--out", str(out), "--overwrite", *map(str, options), *map(str, inputs)]) == 0
    same_cache(root / "one", out)
    assert main(["extract", "--out", str(out), *map(str, options), *map(str, inputs)]) == 2  # complete: not again


def test_two_processes_store_the_orbital_states_one_process_does(extraction, tmp_path):
    """--orbital-every 2 on masked DINOv2 at 28x42 px, units of 3 camera frames: each unit's shard
    holds the states of its rows 0 and 2, whichever process wrote it."""
    root, inputs, _ = extraction
    (tmp_path / "dinov2.yaml").write_text(yaml.safe_dump({"backbone": "dinov2_vits14", "input_size": [28, 42],
                                                          "backend": "torch", "device": "cpu"}))
    train = yaml.safe_load(config_path("train.yaml").read_text())
    train["extract"]["shard_size"] = 3
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(train))
    options = ["--config", tmp_path / "train.yaml", "--extractor-config", tmp_path / "dinov2.yaml", "--orbital-every", "2"]
    assert main(["extract", "--out", str(tmp_path / "one"), *map(str, options), *map(str, inputs)]) == 0
    code, _, err = finished(torchrun("extract", "--out", tmp_path / "two", *options, *inputs))
    assert code == 0, err[-3000:]
    same_cache(tmp_path / "one", tmp_path / "two")
    one, two = FeatureCache(tmp_path / "one"), FeatureCache(tmp_path / "two")
    starts = np.cumsum([0] + [s["frames"] for s in one.meta["shards"]])
    expected = [start + row for start, shard in zip(starts, one.meta["shards"]) for row in range(0, shard["frames"], 2)]
    assert [s["frames"] for s in one.meta["shards"]] == [2, 2, 1, 3, 1, 3, 1]
    assert one.orbital_frames.tolist() == two.orbital_frames.tolist() == expected
    assert one.orbital_meta == two.orbital_meta and one.orbital_meta["frames"] == len(expected) == 9
    np.testing.assert_allclose(one.orbital_states(expected), two.orbital_states(expected), atol=2e-3, rtol=2e-3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_with_own_arguments(arguments: list[list]) -> list[tuple[int, str, str]]:
    """`sps-driving ARGS` in as many processes as `arguments`, each its own, joined by TCP as
    torchrun joins them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): what happens when machines
    run the command with different files."""
    port = free_port()
    started = [subprocess.Popen([sys.executable, "-m", "sps_driving.cli", *map(str, args)], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(arguments)),
                                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
               for rank, args in enumerate(arguments)]
    return [finished(process) for process in started]


def test_processes_that_disagree_on_settings_or_inputs_stop_with_a_clear_error(extraction, tmp_path):
    root, inputs, options = extraction
    out = tmp_path / "cache"
    # One machine's extraction settings file sets a region of interest.
    (tmp_path / "extractor.yaml").write_text((root / "extractor.yaml").read_text() + "roi: [0.0, 0.5, 0.0, 1.0]\n")
    roi = [*options[:3], tmp_path / "extractor.yaml"]
    for code, _, err in processes_with_own_arguments([["extract", "--out", out, *a, *inputs] for a in (options, roi)]):
        assert code == 2 and "the processes disagree on the extraction settings and inputs" in err, err[-2000:]
    # Another input list: one machine lacks a bag.
    results = processes_with_own_arguments([["extract", "--out", out, *options, *inputs],
                                            ["extract", "--out", out, *options, *inputs[1:]]])
    assert all(code == 2 and "ranks 0: " in err and "ranks 1: " in err for code, _, err in results)
    assert not out.exists()


# ---- eval ---------------------------------------------------------------------------------------

EVAL = ["--first-seed", "7", "--episodes", "3", "--episode-s", "1", "--scenarios", "urban-summer-rain-day-animal",
        "rural-winter-snow-day-animal"]


def rows(folder: Path) -> dict:
    found = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    keyed = {(r["scenario"], r["seed"]): r for r in found}
    assert len(keyed) == len(found), "every episode once"
    return keyed


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory):
    """A tiny random policy over masked DINOv2 at 28x42 px (2x3 patches) and its 6 episodes in one process."""
    root = tmp_path_factory.mktemp("evaluation")
    record = {"backbone": "dinov2_vits14", "input_size": [28, 42], "backend": "torch"}
    policy = tiny_policy(root / "policy", rows=2, cols=3, dim=384)
    config = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps({**config, "extractor": record}))
    assert main(["eval", "--policy", str(policy), *EVAL, "--workers", "1", "--out", str(root / "one")]) == 0
    return root, policy, rows(root / "one")


def test_two_processes_evaluate_the_episodes_one_process_does(evaluation, tmp_path):
    root, policy, expected = evaluation
    code, out, err = finished(torchrun("eval", "--policy", policy, *EVAL, "--out", tmp_path))
    assert code == 0, err[-3000:]
    assert "2 torchrun processes" in out and "Table 1" in (tmp_path / "table1.md").read_text()
    assert "[rank 1/2] eval: 3 of 6 episode(s)" in err
    assert rows(tmp_path) == expected and len(expected) == 6
    assert len({(r["distance_m"], r["min_gap_m"]) for r in expected.values()}) == 6, "every episode drove its own way"
    code, _, err = finished(torchrun("eval", "--policy", policy, *EVAL, "--out", tmp_path, "--workers", "2"))
    assert code != 0 and "every process is one worker" in err


def test_a_killed_evaluation_resumes_on_another_number_of_processes(evaluation, tmp_path):
    root, policy, expected = evaluation
    run = torchrun("eval", "--policy", policy, *EVAL, "--out", tmp_path)
    results = tmp_path / "results.jsonl"
    deadline = time.monotonic() + 90
    while not (results.exists() and results.read_text().count("\n") >= 2):  # the first round's two episodes
        assert run.poll() is None and time.monotonic() < deadline, finished(run)
        time.sleep(0.02)
    os.kill(rank_pid(run.pid, 1), signal.SIGKILL)
    code, _, _ = finished(run)
    done = rows(tmp_path)
    assert code != 0 and 2 <= len(done) < 6
    assert main(["eval", "--policy", str(policy), *EVAL, "--workers", "1", "--out", str(tmp_path)]) == 0
    assert rows(tmp_path) == expected
    assert {key: expected[key] for key in done} == done


# ---- dagger -------------------------------------------------------------------------------------


def test_dagger_rollouts_and_development_episodes_on_two_processes(tmp_path):
    """From the same initial policy, two processes roll out the cache and drive the development
    episodes one process does; the round then trains on both (DistributedDataParallel)."""
    (tmp_path / "pixels.yaml").write_text(yaml.safe_dump({"backbone": "pixels", "input_size": [42, 70], "pixel_pool": 7}))
    train = yaml.safe_load(config_path("train.yaml").read_text())
    train["train"].update(epochs=2, width=16, reduce=2, batch_size=16)
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(train))
    assert main(["collect", "--out", str(tmp_path / "drives"), "--episodes", "2", "--seed", "0", "--episode-s", "1",
                 "--width", "64"]) == 0
    bags = sorted(str(p) for p in (tmp_path / "drives").iterdir() if p.is_dir())
    assert main(["extract", "--out", str(tmp_path / "cache0"), "--extractor-config", str(tmp_path / "pixels.yaml"), *bags]) == 0
    assert main(["train", "--cache", str(tmp_path / "cache0"), "--config", str(tmp_path / "train.yaml"),
                 "--out", str(tmp_path / "init")]) == 0
    args = ["dagger", "--init-cache", tmp_path / "cache0", "--init-policy", tmp_path / "init", "--train-config",
            tmp_path / "train.yaml", "--backbone-config", tmp_path / "pixels.yaml", "--episode-s", "1", "--width", "64",
            "--episodes-per-round", "3", "--dev-episodes", "3", "--dev-first-seed", "3", "--rounds", "1", "--workers", "1"]
    assert main([*map(str, args), "--out", str(tmp_path / "one")]) == 0
    code, out, err = finished(torchrun(*args, "--out", tmp_path / "two"))
    assert code == 0, err[-3000:]
    assert "dagger: 1 round(s) run" in out
    assert rows(tmp_path / "one" / "initial" / "dev") == rows(tmp_path / "two" / "initial" / "dev")
    one, two = (tmp_path / run / "round_00" for run in ("one", "two"))
    same_cache(one / "cache_seed_1000", two / "cache_seed_1000")
    assert json.loads((one / "rollouts.json").read_text()) == json.loads((two / "rollouts.json").read_text())
    assert json.loads((two / "policy" / "config.json").read_text())["training"]["world_size"] == 2
    assert len(rows(two / "dev")) == 3
