"""Pricing reproduces POET's per-layer costs (power_computation.py) for the paper's profiles."""

from __future__ import annotations

import numpy as np
import pytest

from host.costs.pricing import price_graph
from host.costs.profile import PlatformProfile, load_profile
from host.graph.training_graph import GraphBuilder, TrainingGraph

# POET chipsets.py RPi (the a72 profile), as published.
RPI_FLOPS_PER_WATT = (16283 * 100 * 1000) / (13.53 * 0.6 * 5)
RPI_FLOPS = 2 * 1000 * 1000 * 1000
RPI_PAGEIN_LATENCY = 0.00509561 * (10 ** (-3))
RPI_PAGEIN_THROUGHPUT = 45.5 * (10 ** (6))
RPI_PAGEOUT_LATENCY = 0.0185314 * (10 ** (-3))
RPI_PAGEOUT_THROUGHPUT = 24.5 * (10 ** (6))
RPI_MEMORY_POWER = 30 * (10 ** (-3)) * 5


_SD_CARD = dict(
    PAGEIN_LATENCY=0.109 * (10 ** (-3)),
    PAGEIN_THROUGHPUT=4616.51 * (10 ** (3)),
    PAGEOUT_LATENCY=0.113 * (10 ** (-3)),
    PAGEOUT_THROUGHPUT=4440 * (10 ** (3)),
    MEMORY_POWER=100 * (10 ** (-3)) * 3.3,
)
_RPI_READ = dict(
    PAGEIN_LATENCY=RPI_PAGEIN_LATENCY, PAGEIN_THROUGHPUT=RPI_PAGEIN_THROUGHPUT, MEMORY_POWER=RPI_MEMORY_POWER
)
POET_CHIPSETS = {  # chipsets.py entries (cost-relevant keys), evaluated as published
    "m0": dict(FLOPS_PER_WATT=2000 / (0.012 * 0.020 * 3.3), FLOPS=2000 / 0.012, **_SD_CARD),
    "m4": dict(
        FLOPS_PER_WATT=(16283 * 100 * 1000) / (255.6237 * 0.003328 * 3.3),
        FLOPS=(16283 * 100 * 1000) / (255.6237),
        **_SD_CARD,
    ),
    "a72": dict(
        FLOPS_PER_WATT=RPI_FLOPS_PER_WATT,
        FLOPS=RPI_FLOPS,
        PAGEOUT_LATENCY=RPI_PAGEOUT_LATENCY,
        PAGEOUT_THROUGHPUT=RPI_PAGEOUT_THROUGHPUT,
        **_RPI_READ,
    ),
    "a72nocache": dict(
        FLOPS_PER_WATT=(16283 * 100 * 1000) / (13.53 * 0.6 * 5),
        FLOPS=(16283 * 100 * 1000) / (13.53),
        PAGEOUT_LATENCY=4.23532 * (10 ** (-3)),
        PAGEOUT_THROUGHPUT=17.1 * (10 ** (6)),
        **_RPI_READ,
    ),
}


def three_node_graph() -> TrainingGraph:
    """input (1,3,32,32) -> conv 3->16 k3 pad1 (1,16,32,32) -> loss (10,); bytes = prod(shape) * 4."""
    builder = GraphBuilder("tiny")
    builder.add("input", "fwd", 1 * 3 * 32 * 32 * 4, 0, op_class="input")
    conv_flops = 2 * (3 * 3 * (1 * 3 * 32 * 32) * 16) + 1 * 16 * 32 * 32  # POET Conv2dLayer.flop
    builder.add("conv", "fwd", 1 * 16 * 32 * 32 * 4, conv_flops, ["input"], op_class="conv")
    builder.add("loss", "loss", 10 * 4, 1 * 16 * 32 * 32 * 10, ["conv"], op_class="loss")
    return builder.build()


def test_three_node_graph_on_a72_matches_hand_computation():
    graph = three_node_graph()
    priced = price_graph(graph, load_profile("a72"))
    assert [n.output_bytes for n in graph.nodes] == [12288, 65536, 40]
    assert [n.flops for n in graph.nodes] == [0, 901120, 163840]

    # By hand: compute_s = flops / 2e9; compute_j = flops * 13.53 * 3 / 1.6283e9;
    # page_in_j = (5.09561e-6 + bytes / 45.5e6) * 0.15; page_out_j = (1.85314e-5 + bytes / 24.5e6) * 0.15.
    hand = {
        "compute_s": [0.0, 4.5056e-4, 8.192e-5],
        "compute_j": [0.0, 0.02246297414, 0.004084177117],
        "page_in_s": [2.751615441e-4, 1.445447258e-3, 5.974730879e-6],
        "page_in_j": [4.127423161e-5, 2.168170888e-4, 8.962096319e-7],
        "page_out_s": [5.200824204e-4, 2.693470176e-3, 2.016405306e-5],
        "page_out_j": [7.801236306e-5, 4.040205263e-4, 3.024607959e-6],
    }
    for field_name, values in hand.items():
        np.testing.assert_allclose(getattr(priced, field_name), values, rtol=1e-9, atol=0, err_msg=field_name)

    # And bit-exact against POET's formulas on chipsets.py's constants.
    for node in graph.nodes:
        i = node.index
        assert priced.compute_s[i] == node.flops / RPI_FLOPS
        assert priced.compute_j[i] == node.flops / RPI_FLOPS_PER_WATT
        page_in_time = RPI_PAGEIN_LATENCY + node.output_bytes / RPI_PAGEIN_THROUGHPUT
        page_out_time = RPI_PAGEOUT_LATENCY + node.output_bytes / RPI_PAGEOUT_THROUGHPUT
        assert priced.page_in_j[i] == page_in_time * RPI_MEMORY_POWER
        assert priced.page_out_j[i] == page_out_time * RPI_MEMORY_POWER
        assert priced.page_in_s[i] == page_in_time
        assert priced.page_out_s[i] == page_out_time

    assert priced.platform == "a72"
    assert priced.cost_model == "analytic"
    assert priced.energy_source == "modelled:poet2022-constants"
    assert priced.base_runtime_s == pytest.approx(4.5056e-4 + 8.192e-5, rel=1e-12)


def _poet_layer_costs(flop: int, out_bytes: int, device: dict) -> tuple[float, float, float, float]:
    """POET's DNNLayer.energy / runtime / energy_sd2ram / energy_ram2sd, restated."""
    energy = flop / device["FLOPS_PER_WATT"]
    runtime = flop / device["FLOPS"]
    page_in = (device["PAGEIN_LATENCY"] + out_bytes / device["PAGEIN_THROUGHPUT"]) * device["MEMORY_POWER"]
    page_out = (device["PAGEOUT_LATENCY"] + out_bytes / device["PAGEOUT_THROUGHPUT"]) * device["MEMORY_POWER"]
    return energy, runtime, page_in, page_out


@pytest.mark.parametrize("name", ["m0", "m4", "a72", "a72nocache"])
def test_bit_exact_against_poet_for_every_paper_profile(name):
    device = POET_CHIPSETS[name]
    rng = np.random.default_rng(7)
    builder = GraphBuilder("random")
    for i in range(200):
        out_bytes = int(rng.integers(0, 1 << 26)) * 4
        flops = int(rng.integers(0, 1 << 40))
        builder.add(f"n{i}", "fwd", out_bytes, flops, [f"n{i - 1}"] if i else [], op_class="conv")
    graph = builder.build()
    priced = price_graph(graph, load_profile(name))
    for node in graph.nodes:
        energy, runtime, page_in, page_out = _poet_layer_costs(node.flops, node.output_bytes, device)
        assert priced.compute_j[node.index] == energy
        assert priced.compute_s[node.index] == runtime
        assert priced.page_in_j[node.index] == page_in
        assert priced.page_out_j[node.index] == page_out


def test_zero_byte_node_still_pays_latency():
    builder = GraphBuilder("z")
    builder.add("empty", "fwd", 0, 0, op_class="other")
    priced = price_graph(builder.build(), load_profile("a72nocache"))
    assert priced.page_out_s[0] == 4.23532 * (10 ** (-3))
    assert priced.page_out_j[0] == 4.23532 * (10 ** (-3)) * 0.15
    assert priced.page_in_s[0] == 0.00509561 * (10 ** (-3))
    assert priced.compute_s[0] == 0.0 and priced.compute_j[0] == 0.0


def _custom_profile(**overrides) -> PlatformProfile:
    data = load_profile("a72").to_dict()
    data["compute"]["flops_per_s"] = {"default": 1.0e9, "matmul": 4.0e9}
    del data["compute"]["energy_per_flop_j"]
    data["compute"]["compute_power_w"] = 10.0
    data["energy_source"] = "modelled:cpu-time×power"
    data["name"] = "custom"
    data.update(overrides)
    return PlatformProfile.from_dict(data)


def test_per_op_class_rates_and_time_times_power_energy():
    builder = GraphBuilder("classes")
    builder.add("mm", "fwd", 400, 8_000_000_000, op_class="matmul")
    builder.add("relu", "fwd", 400, 1_000_000_000, ["mm"], op_class="elementwise")  # falls back to default
    priced = price_graph(builder.build(), _custom_profile())
    np.testing.assert_array_equal(priced.compute_s, [2.0, 1.0])
    np.testing.assert_array_equal(priced.compute_j, [20.0, 10.0])
    assert priced.energy_source == "modelled:cpu-time×power"
    assert priced.platform == "custom"


def test_unknown_cost_model_is_rejected():
    with pytest.raises(ValueError, match="unknown cost model 'calibrated'; supported: analytic"):
        price_graph(three_node_graph(), load_profile("m4"), cost_model="calibrated")


@pytest.mark.parametrize("name", ["m0", "m4", "a72", "a72nocache", "jetsontx2"])
def test_every_shipped_profile_prices_a_graph(name):
    priced = price_graph(three_node_graph(), load_profile(name))
    assert priced.compute_j[1] > 0 and priced.page_in_j[0] > 0 and priced.page_out_j[2] > 0
