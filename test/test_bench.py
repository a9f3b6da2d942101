"""`sps-driving bench`: its FLOP accounting proves the fast Q-Former does the shared work once.

BLIP-2 here is a tiny random config of the real classes; no timing is asserted (timings on a
shared CPU say nothing), only structure, FLOP counts and memory accounting."""

import json

import numpy as np
import pytest
import torch
from samples import tiny_dinov2_policy
from torch.utils.flop_counter import FlopCounterMode

from sps_driving import cli
from sps_driving.core.backbones.blip2 import Blip2Extractor, tiny_blip2_config
from sps_driving.tools import bench, bench_report


def qformer_flops(config, patches: int, fast: bool) -> int:
    """Matmul FLOPs of the per-patch Q-Former for `patches` patches, written out from the architecture."""
    q_cfg = config.qformer_config
    queries, hidden, inter = config.num_query_tokens, q_cfg.hidden_size, q_cfg.intermediate_size
    tokens = (config.vision_config.image_size // config.vision_config.patch_size) ** 2 + 1
    enc = config.vision_config.hidden_size
    layers = q_cfg.num_hidden_layers
    cross = len(range(0, layers, q_cfg.cross_attention_frequency))
    self_attention = 4 * 2 * queries * hidden * hidden + 2 * 2 * queries * queries * hidden
    feed_forward = 2 * 2 * queries * hidden * inter
    keys_values = 2 * 2 * tokens * enc * hidden
    cross_query_side = 2 * 2 * queries * hidden * hidden + 2 * 2 * queries * tokens * hidden  # q, out; logits, weights
    per_patch = layers * (self_attention + feed_forward) + cross * (keys_values + cross_query_side)
    if not fast:
        return patches * per_patch
    # layer 0 up to its cross-attention logits is the same for every patch
    query_side_once = self_attention + 2 * queries * hidden * hidden + 2 * queries * tokens * hidden
    return cross * keys_values + query_side_once + patches * (per_patch - cross * keys_values - query_side_once)


@pytest.fixture(scope="module")
def blip2():
    bench._count_cpu_attention_flops()
    return Blip2Extractor.from_hf_config(tiny_blip2_config(), {"dim": 16, "suppression": -100.0}, seed=0)


@pytest.mark.parametrize("patches", [1, 16])
def test_fast_qformer_does_keys_and_values_once_per_frame(blip2, patches):
    naive = Blip2Extractor(blip2.model, {**blip2.options, "implementation": "naive"})
    tokens = blip2.image_tokens(np.zeros((56, 56, 3), np.uint8))
    bias = blip2.token_bias(np.arange(patches))
    counted = {}
    for name, extractor in (("fast", blip2), ("naive", naive)):
        with FlopCounterMode(display=False) as counter:
            extractor.query_outputs(extractor.prepare_frame(tokens), bias)
        counted[name] = counter.get_total_flops()
    config = blip2.model.config
    assert counted["naive"] == qformer_flops(config, patches, fast=False)
    assert counted["fast"] == qformer_flops(config, patches, fast=True)


def test_bench_json_reports_rows_speedups_and_flops(capsys):
    argv = ["bench", "--blip2", "tiny", "--dinov2", "none", "--repeats", "1", "--rates", "1.0", "0.5", "0.3", "--json",
            "--calibration-seconds", "0.01"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the machine's measured peak, on torch's threads: the best of its products
    peak = result["peak"]
    assert peak["threads"] == result["threads"] and peak["fp32"]["peak_gflops"] > 0 and peak["int8"]["peak_gops"] > 0
    assert peak["fp32"]["peak_gflops"] == max(e["gflops"] for e in peak["fp32"]["onnxruntime"] + peak["fp32"]["torch"])
    blip2 = result["blip2"]
    assert [(r["impl"], r["rate"], r["k"]) for r in blip2["rows"]] == [
        ("naive", 1.0, 16), ("ours", 1.0, 16), ("ours", 0.5, 8), ("ours", 0.3, 5)
    ]
    for key in ("speedup_vs_naive_rate1", "speedup_sps50_vs_dense", "speedup_sps30_vs_dense"):
        assert blip2[key] is not None and blip2[key] > 0
    assert blip2["speedup_sps70_vs_dense"] is None  # 0.7 was not run
    naive, dense, half, third = blip2["rows"]
    for row in blip2["rows"]:
        assert row["total_ms"] == pytest.approx(sum(row[f"{c}_ms"] for c in bench.COMPONENTS))
        assert row["backbone_ms"] == naive["backbone_ms"]  # one backbone measurement serves every row
        assert set(row["gflops_per_s"]) == {"backbone", "per_patch", "projection", "policy"}
    # the work itself: the naive path does more, and ours scales with the kept patches
    assert naive["gflop"]["per_patch"] > 1.5 * dense["gflop"]["per_patch"]
    assert dense["gflop"]["per_patch"] > half["gflop"]["per_patch"] > third["gflop"]["per_patch"]
    assert half["gflop"]["projection"] == pytest.approx(dense["gflop"]["projection"] / 2)
    # the policy column is the shipped policy's architecture, a transformer over the kept patches:
    # less work at every lower rate
    assert result["policy_architecture"] == {
        "checkpoint": "models/spps30pt_dinov2", "architecture": "positional_transformer",
        "policy": {"width": 64, "depth": 2, "heads": 4, "mlp_ratio": 2.0, "dropout": 0.1, "reduce": 16},
        "max_steering_rad": 0.5, "selection": {"variant": "spps", "rate": 0.3, "seed": 0, "keep_probability": None}}
    assert dense["gflop"]["policy"] > half["gflop"]["policy"] > third["gflop"]["policy"] > 0
    for row in blip2["rows"]:
        assert row["per_patch_peak_fraction"] == pytest.approx(row["gflops_per_s"]["per_patch"] / peak["fp32"]["peak_gflops"])


def test_bench_times_the_architecture_of_the_policy_it_is_given(tmp_path, capsys):
    checkpoint = tiny_dinov2_policy(tmp_path / "spps", variant="spps")
    argv = ["bench", "--blip2", "tiny", "--dinov2", "none", "--repeats", "1", "--rates", "1.0", "0.3",
            "--naive-rates", "--policy", str(checkpoint), "--json", "--peak-gflops", "100"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["policy_architecture"]["checkpoint"] == "spps"  # outside the repository: its name only
    assert result["policy_architecture"]["architecture"] == "positional_transformer"
    assert result["policy_architecture"]["selection"]["variant"] == "spps"
    dense, sparse = result["blip2"]["rows"]
    # a sequence policy reads only the kept patches: less work at a lower rate
    assert 0 < sparse["gflop"]["policy"] < 0.6 * dense["gflop"]["policy"]


def test_bench_policy_forward_times_each_checkpoint_and_an_ensemble_beside_the_stock_path(tmp_path, capsys):
    from samples import tiny_policy

    heads = [tiny_policy(tmp_path / f"pt{seed}", variant="spps", seed=seed) for seed in (0, 1)]
    grid_mlp = tiny_policy(tmp_path / "mlp")
    assert cli.main(["ensemble", "--out", str(tmp_path / "ens"), *map(str, heads)]) == 0
    capsys.readouterr()
    assert cli.main(["bench", "--policy-forward", str(heads[0]), str(tmp_path / "ens"), str(grid_mlp), "--frames", "20"]) == 0
    timed = json.loads(capsys.readouterr().out)["policy_forward_ms"]
    # The transformers also on PyTorch's stock path; the grid MLP has no encoder layer to compare.
    assert list(timed) == ["pt0", "pt0 (stock fast path)", "ens", "ens (stock fast path)", "mlp"]
    assert all(0 < row["p50"] <= row["p99"] and row["kept_patches"] == 32 for row in timed.values())  # half of 8 x 8
    # The graph bench counts an ensemble's FLOPs on a timing copy with every head.
    from sps_driving.core.grid import PatchGrid

    copy = bench.timed_policy(PatchGrid(8, 8), 16, "cpu", tmp_path / "ens")
    assert len(copy.policy.module.heads) == 2 and copy.policy.config["architecture"] == "ensemble"


def test_tables_print_like_table_4(blip2, capsys):
    result = {"device": "cpu", "dtype": "float32", "threads": 2, "repeats": 1, "peak": bench.given_peak(190.0, 2),
              "load_average": [1.0, 1.0, 1.0]}
    image = np.random.default_rng(0).integers(0, 256, (60, 80, 3), dtype=np.uint8)
    naive = Blip2Extractor(blip2.model, {**blip2.options, "implementation": "naive"})
    result["blip2"] = bench.bench_blip2(blip2, naive, image, [1.0, 0.5], [1.0], repeats=1, seed=0)
    bench.add_efficiency(result)
    text = bench.format_tables(result)
    for label in ("naive-100%", "ours-100%", "ours-50%", "per-patch", "proj+norm", "speedup_vs_naive_rate1", "pp % peak",
                  "GEMM peak given (--peak-gflops): 190"):
        assert label in text


def test_dinov2_paths_side_by_side_with_flops_from_the_shapes_and_efficiency(capsys):
    """The car's DINOv2 on the shipped policy's road band: onnxruntime dense, token dropping and
    token dropping in int8, at the same rates; FLOPs from the model's shapes. No speed asserted."""
    from sps_driving.core.flops import ViTShape, dinov2_flops

    paths = ["onnxruntime", "onnxruntime-kept", "onnxruntime-kept-int8"]
    argv = ["bench", "--blip2", "none", "--dinov2-paths", *paths, "--rates", "1.0", "0.5", "--repeats", "1",
            "--peak-gflops", "100", "--json"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    dinov2 = result["dinov2"]
    assert dinov2["grid"] == [12, 24] and [facts["precision"] for facts in dinov2["runtimes"].values()] == ["fp32", "fp32", "int8"]
    rows = {(row["path"], row["rate"]): row for row in dinov2["rows"]}
    assert set(rows) == {(path, rate) for path in paths for rate in (1.0, 0.5)}
    shape = ViTShape(hidden=384, layers=12, mlp_hidden=1536, patch=14)
    for (_, rate), row in rows.items():
        counted = dinov2_flops(shape, 288, row["k"], -1, row["tokens"])
        assert row["gflop"]["encode"] == pytest.approx(counted["encode"] / 1e9)
        assert row["gflop"]["descriptors"] == pytest.approx(counted["descriptors"] / 1e9)
        assert row["extractor_ms"] == pytest.approx(row["encode_ms"] + row["descriptors_ms"])
        assert row["peak_fraction"]["extractor"] == pytest.approx(row["gflops_per_s"]["extractor"] / 100)
        reference = rows[("onnxruntime", rate)]
        assert row["extractor_speedup"] == pytest.approx(reference["extractor_ms"] / row["extractor_ms"])
    # token dropping at half the patches: about half the work; dense: the same encode at every rate
    assert rows[("onnxruntime-kept", 0.5)]["gflop"]["extractor"] < 0.52 * rows[("onnxruntime", 0.5)]["gflop"]["extractor"]
    assert rows[("onnxruntime", 0.5)]["gflop"]["encode"] == rows[("onnxruntime", 1.0)]["gflop"]["encode"]
    assert rows[("onnxruntime-kept", 1.0)]["gflop"]["extractor"] == pytest.approx(rows[("onnxruntime", 1.0)]["gflop"]["extractor"])
    assert bench.stage_precisions(rows[("onnxruntime-kept-int8", 0.5)])["descriptors"] == "int8"
    text = bench.format_tables(result)
    assert "onnxruntime-kept-int8 50%" in text and "% peak enc/desc/extr" in text
    assert "| onnxruntime-kept-int8 | 0.5 | 144 |" in bench_report.render(result, None, None)


def test_speedups_are_ratios_of_the_per_patch_medians():
    rows = [
        {"impl": "naive", "rate": 1.0, "per_patch_ms": 300.0, "total_ms": 400.0},
        {"impl": "ours", "rate": 1.0, "per_patch_ms": 100.0, "total_ms": 200.0},
        {"impl": "ours", "rate": 0.5, "per_patch_ms": 50.0, "total_ms": 150.0},
        {"impl": "ours", "rate": 0.3, "per_patch_ms": 25.0, "total_ms": 125.0},
    ]
    ratios = bench.speedups(rows)
    assert ratios["speedup_vs_naive_rate1"] == 3.0
    assert ratios["speedup_sps50_vs_dense"] == 2.0
    assert ratios["speedup_sps30_vs_dense"] == 4.0
    assert ratios["total_speedup_sps50_vs_naive_dense"] == pytest.approx(400 / 150)


@pytest.mark.parametrize("interval_s", [0.002, 60.0])
def test_peak_memory_sees_a_large_allocation(interval_s):
    """Also one made and freed between two samples (a 60 s interval: none is taken): the kernel's peak counts it."""
    with bench.PeakMemory("cpu", interval_s=interval_s) as memory:
        block = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
        block.sum()
        del block
    assert memory.peak_mib >= 48
    with bench.PeakMemory("cpu") as quiet:
        torch.zeros(4).sum()
    assert quiet.peak_mib < 48


@pytest.mark.ros
def test_bench_graph_times_the_same_extractor_standalone_and_in_the_graph(tmp_path, capsys):
    """`bench --graph --tokens all kept` on a 4-frame drive (DINOv2 at 112 px, a tiny policy): for
    the checkpoint itself and a token-dropping timing copy of it, both sides ran the same backend,
    and the ratios are the graph's and a 1 s evaluation episode's extractor time over standalone's;
    FLOPs and efficiency against the given peak. No speed asserted."""
    from ood_samples import calibration_of
    from samples import tiny_policy

    from sps_driving.core import topics
    from sps_driving.core.flops import ViTShape, dinov2_flops
    from sps_driving.ros import msgs
    from sps_driving.ros.bagio import BagWriter

    ckpt = tiny_policy(tmp_path / "ckpt", rows=8, cols=8, dim=384)
    calibration_of(ckpt)  # made for its own descriptors (all tokens): the kept copy must not carry it
    (tmp_path / "extraction.yaml").write_text("input_size: [112, 112]\n")
    rng = np.random.default_rng(0)
    with BagWriter(tmp_path / "drive", "sqlite3") as bag:
        for i in range(4):
            t = 1_700_000_000_000_000_000 + i * 33_333_333
            bag.write(topics.IMAGE, msgs.image_fields(rng.integers(0, 256, (120, 200, 3), dtype=np.uint8), t, "camera"), t)
    argv = ["bench", "--graph", "--bag", str(tmp_path / "drive"), "--checkpoint", str(ckpt), "--backbone-config",
            str(tmp_path / "extraction.yaml"), "--repeats", "1", "--tokens", "all", "kept", "--peak-gflops", "50", "--json",
            "--episode-s", "1", "--first-seed", "3", "--out", str(tmp_path / "graph.json")]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "graph.json").read_text())
    assert str(tmp_path) not in (tmp_path / "graph.json").read_text()  # the checkpoint and bag by their names
    dense, kept = result["configurations"]
    assert (dense["tokens"], dense["timing_copy"], kept["tokens"], kept["timing_copy"]) == ("all", False, "kept", True)
    shape = ViTShape(hidden=384, layers=12, mlp_hidden=1536, patch=14)
    for configuration in (dense, kept):
        (run,) = configuration["runs"]
        assert run["frames_in"] == run["frames_out"] == result["frames"] == 4
        standalone = configuration["standalone_extractor"]
        assert standalone["backend"] == "onnxruntime" and standalone["choice"].startswith("auto")
        assert not standalone["export_dir"].startswith("/")  # the export cache names no folder of this machine
        assert {k: run["graph_extractor"][k] for k in ("backend", "runtime", "precision")} == {
            k: str(standalone[k]) for k in ("backend", "runtime", "precision")}
        assert run["graph_over_standalone"] == pytest.approx(run["graph_extractor_ms"] / run["standalone_ms"])
        assert run["eval_worker_extractor_ms"] > 0
        assert run["eval_worker_over_standalone"] == pytest.approx(run["eval_worker_extractor_ms"] / run["standalone_ms"])
        assert run["camera_to_command_p99_ms"] >= run["camera_to_command_p50_ms"] > 0
        assert run["policy_p99_ms"] >= run["policy_ms"] > 0
        assert configuration["summary"]["graph_over_standalone"]["median"] == pytest.approx(run["graph_over_standalone"])
        counted = dinov2_flops(shape, 64, 32, tokens=configuration["tokens"])
        assert configuration["flops"]["extractor"] == counted["encode"] + counted["descriptors"]
        efficiency = configuration["efficiency"]
        assert efficiency["standalone_peak_fraction"] == pytest.approx(
            configuration["flops"]["extractor"] / (run["standalone_ms"] / 1e3) / 1e9 / 50)
    assert kept["flops"]["extractor"] < 0.6 * dense["flops"]["extractor"]
    assert result["eval_worker_episode"] == {"scenario": "rural-summer-dry-day-car", "layout": 3, "episode_s": 1.0}
    text = bench.format_graph(result)
    assert "graph / standalone" in text and "camera->command p99" in text and "a timing copy" in text
    assert "eval worker / standalone" in text and "in an eval worker" in text
    assert "FLOPs per frame: extractor" in text and "% of the fp32 peak" in text
    report = bench_report.render(None, result, None)
    assert "| 0.5 | kept | fp32 |" in report and "rural-summer-dry-day-car, layout 3, 1 s" in report
    (row,) = [line for line in report.splitlines() if line.startswith("| 0.5 | all | fp32 |")]
    assert row.split(" | ")[7] == f"{dense['summary']['eval_worker_over_standalone']['median']:.2f}"


def test_run_to_run_table_has_a_row_per_run_with_its_own_speedups():
    def run(revision, dense_ms, kept_ms):
        rows = [{"path": "onnxruntime", "rate": 1.0, "extractor_ms": dense_ms, "extractor_speedup": 1.0,
                 "peak_fraction": {"extractor": 100 / dense_ms}},
                {"path": "onnxruntime-kept", "rate": 0.5, "extractor_ms": kept_ms, "extractor_speedup": dense_ms / kept_ms,
                 "peak_fraction": {"extractor": 0.5}}]
        return {"revision": revision, "load_average": [0.5, 1.0, 1.5], "peak": {"fp32": {"peak_gflops": 210.0}},
                "dinov2": {"rows": rows}}

    lines = bench_report.run_to_run_section([run("aaa", 120.0, 60.0), run("bbb", 140.0, 56.0)])
    table = [line for line in lines if line.startswith("| aaa") or line.startswith("| bbb")]
    assert table[0] == ("| aaa | 0.50 | 210 | 120.0 | 83 |  | 2.00x |  |  |  |")
    assert table[1] == ("| bbb | 0.50 | 210 | 140.0 | 71 |  | 2.50x |  |  |  |")
    assert "run 2 times" in lines[2]
