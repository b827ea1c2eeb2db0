"""Small training graphs for solver tests: hand-made chains and random DAGs with a backward pass."""

from __future__ import annotations

import random

import numpy as np

from host.costs.priced_graph import PricedGraph
from host.graph.training_graph import GraphBuilder, TrainingGraph


def training_graph_from_forward(name: str, forward_deps: list[list[int]], out_bytes: list[int], flops: list[int]) -> TrainingGraph:
    """Forward DAG (node 0 is the input) + loss on the last node + one bwd node per non-input node.

    A bwd node depends on the bwd nodes of all consumers (gradient accumulation), on its own
    forward output and on its inputs' outputs (what a typical backward saves).
    """
    builder = GraphBuilder(name)
    count = len(forward_deps)
    for i in range(count):
        builder.add(f"f{i}", "fwd", out_bytes[i], flops[i], [f"f{d}" for d in forward_deps[i]],
                    op_class="input" if i == 0 else "conv")
    builder.add("loss", "loss", 4, 10, [f"f{count - 1}"], op_class="loss")
    consumers: dict[int, list[int]] = {i: [] for i in range(count)}
    for i, deps in enumerate(forward_deps):
        for d in deps:
            consumers[d].append(i)
    builder.add("bwd:loss", "bwd", out_bytes[count - 1], 20, ["loss", f"f{count - 1}"], forward_of="loss")
    for i in reversed(range(1, count)):
        upstream = [f"bwd:f{c}" for c in consumers[i]] or ["bwd:loss"]
        if i == count - 1:
            upstream = ["bwd:loss"] + upstream[:-1] if consumers[i] else ["bwd:loss"]
        saved = [f"f{i}"] + [f"f{d}" for d in forward_deps[i]]
        in_bytes = sum(out_bytes[d] for d in forward_deps[i])
        builder.add(f"bwd:f{i}", "bwd", in_bytes, 2 * flops[i], list(dict.fromkeys(upstream + saved)),
                    forward_of=f"f{i}")
    return builder.build(param_bytes=1000, param_grad_bytes=1000)


def chain_graph(length: int = 6, bytes_each: int = 100, flops_each: int = 1000) -> TrainingGraph:
    deps = [[]] + [[i - 1] for i in range(1, length)]
    return training_graph_from_forward("chain", deps, [bytes_each] * length, [0] + [flops_each] * (length - 1))


def random_training_graph(seed: int, size: int) -> TrainingGraph:
    rng = random.Random(seed)
    deps: list[list[int]] = [[]]
    for i in range(1, size):
        chosen = {i - 1}
        if i > 2 and rng.random() < 0.35:
            chosen.add(rng.randrange(0, i - 1))
        deps.append(sorted(chosen))
    out_bytes = [rng.choice([64, 128, 256, 512]) for _ in range(size)]
    flops = [0] + [rng.choice([100, 1000, 10000, 100000]) for _ in range(size - 1)]
    return training_graph_from_forward(f"random{seed}", deps, out_bytes, flops)


def price_simply(graph: TrainingGraph, page_j_per_byte: float = 1e-6, flop_j: float = 1e-6) -> PricedGraph:
    """A transparent price list: joules per FLOP and per byte paged, seconds alike."""
    flops = np.array([n.flops for n in graph.nodes], dtype=float)
    out = np.array([n.output_bytes for n in graph.nodes], dtype=float)
    paging = 1e-4 + out * page_j_per_byte
    return PricedGraph(graph, "test", "analytic", "modelled:test", flops * 1e-9, flops * flop_j, paging, paging,
                       paging, paging)
