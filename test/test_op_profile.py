"""The operator profile of an ONNX graph: real onnxruntime profiles of small graphs built here."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from sps_driving.tools import bench_report, op_profile


def _attention_like_graph(path):
    """Y = softmax(A W) (A W)^T: a Gemm-free MatMul with a weight, a batched MatMul of two
    activations with a transposed second input, and a non-product operator between them."""
    weight = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "W"], ["H"]),
         helper.make_node("Softmax", ["H"], ["S"], axis=-1),
         helper.make_node("Transpose", ["H"], ["HT"], perm=[0, 2, 1]),
         helper.make_node("MatMul", ["S", "HT"], ["Y"])],
        "attention_like",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [3, 5, 8])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 5, 5])],
        [numpy_helper.from_array(weight, "W")],
    )
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())


def test_products_are_counted_from_the_profiled_shapes_and_warmup_runs_left_out(tmp_path):
    graph = tmp_path / "graph.onnx"
    _attention_like_graph(graph)
    inputs = {"A": np.ones((3, 5, 8), np.float32)}
    summary = op_profile.profile_graph(graph, inputs, threads=1, frames=4, warmup=2)
    assert summary["frames"] == 4
    shapes = {(p["batch"], p["m"], p["k"], p["n"]): p for p in summary["products"]}
    # A [3, 5, 8] x W [8, 6] and S [3, 5, 6] x H^T [3, 6, 5] (ORT may fuse the transpose into the product)
    assert set(shapes) == {(3, 5, 8, 6), (3, 5, 6, 5)}
    for (batch, m, k, n), product in shapes.items():
        assert product["nodes_per_frame"] == 1
        assert product["gflop"] == pytest.approx(2 * batch * m * k * n / 1e9)
    assert {entry["op"] for entry in summary["ops"]} >= {"Softmax"}
    assert sum(entry["share"] for entry in summary["ops"]) == pytest.approx(1.0)
    assert 0 < summary["product_share"] < 1


def test_summary_counts_only_the_runs_after_the_warmup():
    def node(ts, op, us):
        return {"cat": "Node", "name": f"n{ts}_kernel_time", "ts": ts, "dur": us,
                "args": {"op_name": op, "input_type_shape": [{"float": [4, 2]}], "output_type_shape": [{"float": [4, 3]}]}}

    events = [{"name": "model_run", "ts": 0, "dur": 100}, node(10, "MatMul", 1000),  # warm-up: a slow first run
              {"name": "model_run", "ts": 200, "dur": 50}, node(210, "MatMul", 20), node(230, "Relu", 20)]
    summary = op_profile.summarize(events, warmup=1)
    assert summary["frames"] == 1 and summary["frame_ms"] == pytest.approx(0.05)
    assert summary["product_share"] == pytest.approx(0.5)
    (product,) = summary["products"]
    assert (product["batch"], product["m"], product["k"], product["n"]) == (1, 4, 2, 3)
    assert product["gflops"] == pytest.approx(2 * 4 * 2 * 3 / 20e-6 / 1e9)
    with pytest.raises(ValueError, match="no timed run"):
        op_profile.summarize(events, warmup=2)


def test_report_puts_each_product_beside_the_calibration_at_its_shape():
    product = {"op": "Gemm", "batch": 1, "m": 289, "k": 384, "n": 1536, "nodes_per_frame": 11, "ms": 20.0, "gflop": 3.75,
               "gflops": 187.5}
    result = {"revision": "abc", "load_average": [0.1, 0.2, 0.3], "threads": 2, "tokens": 289,
              "peak": {"fp32": {"onnxruntime": [{"m": 289, "k": 384, "n": 1536, "gflops": 250.0}]}},
              "profile": {"frames": 20, "frame_ms": 25.0, "product_share": 0.8, "ops": [{"op": "Gemm", "ms": 20.0, "share": 0.8}],
                          "products": [product, {**product, "batch": 6}]}}
    lines = bench_report.ops_section(result)
    assert "| Gemm | 1x289x384x1536 | 11 | 20.0 | 3.75 | 188 | 250 | 0.75 |" in lines
    assert "| Gemm | 6x289x384x1536 | 11 | 20.0 | 3.75 | 188 |  |  |" in lines
