"""Price a TrainingGraph on a platform profile: the POET (ICML 2022) analytic cost model.

Per node i (power_computation.py of POET):

* compute_s  = flops / flops_per_s[op_class]   (falls back to flops_per_s["default"]); a calibrated
  profile prices backward nodes at their own rates, and adds a fixed overhead per node and per aten op
  it runs, and its tensor traffic (output + input bytes) over a memory rate
* compute_j  = flops / (1 / energy_per_flop_j) when the profile has energy_per_flop_j (POET's
  ``flop / FLOPS_PER_WATT``; dividing by the FLOP-per-joule figure, rather than multiplying by its
  reciprocal, reproduces the paper's floats bit for bit), else compute_s x compute_power_w
* page_out_s = page_out_latency_s + output_bytes / page_out_throughput_bytes_per_s
  (+ page_out_compute_thread_s, a calibrated profile's time of the compute thread per transfer)
  page_out_j = page_out_s x memory_power_w (its compute-thread part at compute_power_w), and page_in
  likewise. A node with 0 output bytes still pays the latency, as in the paper.
"""

from __future__ import annotations

import numpy as np

from host.costs.priced_graph import PricedGraph
from host.costs.profile import PlatformProfile
from host.graph.training_graph import TrainingGraph

COST_MODELS: tuple[str, ...] = ("analytic",)


def node_traffic_bytes(graph: TrainingGraph) -> np.ndarray:
    """Per node: the bytes its compute reads and writes, its output plus its dependencies' outputs."""
    return np.array([node.output_bytes + sum(graph.nodes[d].output_bytes for d in node.deps)
                     for node in graph.nodes], dtype=np.float64)


def price_graph(graph: TrainingGraph, profile: PlatformProfile, cost_model: str = "analytic") -> PricedGraph:
    """Per-node compute / page-in / page-out seconds and joules of ``graph`` on ``profile``."""
    if cost_model not in COST_MODELS:
        raise ValueError(f"unknown cost model {cost_model!r}; supported: {', '.join(COST_MODELS)}")
    flops = np.array([node.flops for node in graph.nodes], dtype=np.float64)
    output_bytes = np.array([node.output_bytes for node in graph.nodes], dtype=np.float64)
    flops_per_s = np.array([profile.flops_per_s_for(node.op_class, node.kind) for node in graph.nodes],
                           dtype=np.float64)
    overhead_s = np.array([profile.node_overhead_s_for(node.kind, node.op_count, node.op_class) for node in graph.nodes],
                          dtype=np.float64)
    memory_s_per_byte = np.array([(1.0 / rate if (rate := profile.memory_bytes_per_s_for(node.kind)) else 0.0)
                                  + profile.class_seconds_per_byte_for(node.kind, node.op_class)
                                  for node in graph.nodes], dtype=np.float64)

    compute_s = overhead_s + flops / flops_per_s + node_traffic_bytes(graph) * memory_s_per_byte
    if profile.energy_per_flop_j is not None:
        compute_j = flops / (1.0 / profile.energy_per_flop_j)
    else:
        compute_j = compute_s * profile.compute_power_w

    page_out_s = (profile.page_out_latency_s + output_bytes / profile.page_out_throughput_bytes_per_s
                  + profile.page_out_compute_thread_s)
    page_in_s = (profile.page_in_latency_s + output_bytes / profile.page_in_throughput_bytes_per_s
                 + profile.page_in_compute_thread_s)
    return PricedGraph(
        graph=graph,
        platform=profile.name,
        cost_model=cost_model,
        energy_source=profile.energy_source,
        compute_s=compute_s,
        compute_j=compute_j,
        page_in_s=page_in_s,
        page_in_j=_transfer_j(page_in_s, profile.page_in_compute_thread_s, profile),
        page_out_s=page_out_s,
        page_out_j=_transfer_j(page_out_s, profile.page_out_compute_thread_s, profile),
        transfer_overlap=profile.transfer_overlap,
        page_in_compute_thread_s=profile.page_in_compute_thread_s,
        page_out_compute_thread_s=profile.page_out_compute_thread_s,
    )


def _transfer_j(transfer_s: np.ndarray, compute_thread_s: float, profile: PlatformProfile) -> np.ndarray:
    """A transfer's energy: its I/O time at the paging power, its compute thread's part at the compute power."""
    return (transfer_s - compute_thread_s) * profile.memory_power_w + compute_thread_s * profile.compute_power_w
