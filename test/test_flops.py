"""FLOPs per frame counted from the model's shapes (sps_driving.core.flops) equal torch's FLOP
counter on the real DINOv2 ViT-S/14 architecture (random weights: the count does not depend on
them) at the shipped road band's input, 168x336 px (12x24 patches): dense, token dropping, a masked
earlier layer, I-ViT; and the measured GEMM peak (sps_driving.tools.peak) is what its products ran at."""

import numpy as np
import pytest
from torch.utils.flop_counter import FlopCounterMode

from sps_driving.core.backbones import resolve_config
from sps_driving.core.backbones.dinov2 import random_dinov2
from sps_driving.core.flops import ViTShape, dinov2_flops
from sps_driving.tools import bench
from sps_driving.tools.peak import _matmul_model, _quantized, measure_peak, vit_gemm_shapes

ROAD_BAND = {"backbone": "dinov2_vits14", "backend": "torch", "input_size": [168, 336], "roi": [0.4, 0.65, 0.125, 0.875]}


@pytest.mark.parametrize("settings, kept", [
    ({}, 144), ({}, 288), ({"tokens": "kept"}, 144), ({"tokens": "kept"}, 87), ({"masked_layer": 9}, 3),
    ({"masked_layer": 5, "tokens": "kept"}, 20), ({"falloff": "none"}, 144),
], ids=["dense-50", "dense-100", "kept-50", "kept-30", "masked-9", "kept-masked-5", "ivit"])
def test_shape_count_equals_the_profilers(settings, kept):
    bench._count_cpu_attention_flops()  # the CPU's fused attention kernel, as the bench counts it
    config = resolve_config({**ROAD_BAND, **settings})
    extractor = random_dinov2("real", config)
    extractor.model.requires_grad_(False)
    image = np.random.default_rng(0).integers(0, 256, (280, 448, 3), dtype=np.uint8)
    indices = np.sort(np.random.default_rng(1).choice(extractor.grid.n, kept, replace=False))
    with FlopCounterMode(display=False) as encode:
        state = extractor.encode(image)
    with FlopCounterMode(display=False) as descriptors:
        extractor.descriptors(state, indices)
    shape = ViTShape.of(extractor.model)
    assert (shape.hidden, shape.layers, shape.mlp_hidden, shape.patch) == (384, 12, 1536, 14)
    counted = dinov2_flops(shape, extractor.grid.n, kept, config["masked_layer"], config["tokens"], config["falloff"] == "none")
    assert counted == {"encode": encode.get_total_flops(), "descriptors": descriptors.get_total_flops()}


def test_the_road_band_frame_costs_what_the_issue_says_and_dropping_scales_with_the_rate():
    shape = ViTShape(hidden=384, layers=12, mlp_hidden=1536, patch=14)
    dense = dinov2_flops(shape, 288, 144)
    # 289 tokens: about 12 GFLOP of Linear layers and 1.5 of attention
    assert sum(dense.values()) / 1e9 == pytest.approx(13.45, abs=0.01)
    for rate, kept in ((1.0, 288), (0.5, 144), (0.3, 87)):
        dropped = sum(dinov2_flops(shape, 288, kept, tokens="kept").values())
        assert dropped / sum(dinov2_flops(shape, 288, 288).values()) == pytest.approx(rate, abs=0.03)


def test_the_measured_peak_is_the_best_product_and_int8_runs_integer_products():
    shapes = vit_gemm_shapes(20, 64, 256)
    peak = measure_peak(1, shapes, seconds=0.01)
    rates = [entry["gflops"] for entry in peak["fp32"]["onnxruntime"] + peak["fp32"]["torch"]]
    assert len(rates) == 2 * len(shapes) and min(rates) > 0 and peak["fp32"]["peak_gflops"] == max(rates)
    assert peak["int8"]["peak_gops"] == max(e["gflops"] for e in peak["int8"]["onnxruntime"]) > 0
    ops = {node.op_type for node in _quantized(_matmul_model(64, 256)).graph.node}
    assert "MatMul" not in ops and ops & {"MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"}
