"""`sps-driving bench --train`: FLOPs of a training step from the shapes agree with torch's
counter, and the bench times the trainer's real epochs phase by phase."""

import json

import pytest
import torch

from sps_driving.tools import bench_train
from sps_driving.train.distributed import start_processes
from sps_driving.train.trainer import TrainConfig, TrainingRun

GRID, DIM = (3, 5), 24
SMALL = {"width": 16, "heads": 4, "reduce": 4, "batch_size": 8}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return bench_train.synthetic_cache(tmp_path_factory.mktemp("bench_train") / "cache", GRID, DIM, sources=3,
                                       frames_per_source=12)


@pytest.mark.parametrize("architecture", ["positional_transformer", "mlp"])
@pytest.mark.parametrize("state", [True, False])
def test_flops_from_the_shapes_are_what_torch_counts_in_a_training_step(cache, tmp_path, architecture, state):
    cfg = TrainConfig.from_yaml(cache=str(cache), out=str(tmp_path / "run"), device="cpu", architecture=architecture,
                                depth=2, state_inputs=None if state else [], **SMALL)
    procs = start_processes("cpu")
    try:
        run = TrainingRun(cfg, procs, None, None)
        batch = next(iter(run.loader))
        counted = bench_train.counted_step_flops(run, batch)
    finally:
        procs.close()
    settings = {**vars(cfg)}
    products = bench_train.training_products(settings, GRID[0] * GRID[1], DIM, 2 if state else 0, len(batch[0]))
    assert sum(map(bench_train.product_flops, products)) == counted > 0
    # Left out of the forward-only count: the backward products, which double the forward's but for the input's.
    forward = sum(bench_train.product_flops(p) for p in products if p["pass"] == "forward")
    assert 2 * forward < counted < 4 * forward


@pytest.fixture(scope="module")
def tiny_result():
    cases = (("PT-50", {**bench_train.TRANSFORMER, **SMALL, "rate": 0.5}), ("MLP-100", {"architecture": "mlp", **SMALL, "rate": 1.0}))
    return bench_train.bench_train(repeats=1, threads=(1,), seconds=0.01, cases=cases, grid=GRID, dim=DIM, sources=3,
                                   frames_per_source=16)


def test_bench_train_times_the_trainers_epochs_by_phase(tiny_result):
    result = tiny_result
    text = bench_train.format_train(result)
    assert "| PT-50 | 1 |" in text and "| MLP-100 | 1 |" in text
    json.dumps(result)
    assert [case["label"] for case in result["cases"]] == ["PT-50", "MLP-100"]
    for case in result["cases"]:
        assert case["flops_per_frame"] == case["counted_flops_per_frame"]
        entry = case["by_threads"]["1"]
        best = entry["best"]
        assert best["frames"] == case["train_frames"] == 32
        # Every second of the epoch is in one phase, the rest of Python's included, on either clock.
        assert sum(best["wall"][p] for p in bench_train.PHASES) == pytest.approx(best["epoch_s"])
        assert sum(best["cpu"][p] for p in bench_train.PHASES) == pytest.approx(best["epoch_cpu_s"])
        assert min(best["wall"][p] for p in bench_train.PHASES if p != "python") > 0
        assert entry["frames_per_s"] == pytest.approx(best["frames"] / best["train_s"])
        assert entry["timed_by"] == "cpu"  # one thread
        assert entry["clock_frames_per_s"] == pytest.approx(best["frames"] / best["train_cpu_s"])
        assert entry["fraction_of_bound"] == pytest.approx(entry["clock_frames_per_s"] / entry["bound_frames_per_s"])
        assert entry["bound"]["gflops"] > 0 and all(s["gflops"] > 0 for s in entry["bound"]["shapes"])
    assert torch.get_num_threads() >= 1


def test_attention_rates_are_positive_for_both_passes():
    from sps_driving.tools.peak import attention_rates

    forward, backward = attention_rates((2, 2, 16, 8), threads=1, seconds=0.01)
    assert forward > 0 and backward > 0


def test_the_report_sets_the_fastest_runs_of_two_trainers_against_the_strictest_bound(tiny_result):
    from sps_driving.tools import bench_report

    slower = json.loads(json.dumps(tiny_result))
    for case in slower["cases"]:
        entry = case["by_threads"]["1"]
        entry["clock_frames_per_s"] /= 2
        entry["bound_frames_per_s"] *= 2  # a run that measured a higher bound: every row is held to it
    lines = bench_report.train_section([slower, tiny_result], [tiny_result])
    row = next(line for line in lines if line.startswith("| PT-50 | 1 |"))
    entry = tiny_result["cases"][0]["by_threads"]["1"]
    bound = 2 * entry["bound_frames_per_s"]
    assert f"| {bound:.0f} (" in row and "| 1.00x |" in row  # the faster of the before runs equals the after run
    assert row.endswith(f"| {100 * entry['clock_frames_per_s'] / bound:.0f} | {100 * entry['clock_frames_per_s'] / bound:.0f} |")
    assert any(line.startswith("| MLP-100 | 1 |") and " / " in line for line in lines)
