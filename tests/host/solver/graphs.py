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


def residual_graph(blocks: int, out_bytes: list[int]) -> TrainingGraph:
    """A ResNet as traced: conv -> bn -> relu, then per block conv -> bn -> add(., block input) -> relu.

    Each backward reads what torch saves: a ReLU's its output, a BatchNorm's its input, an add's nothing. So a
    BatchNorm's and an add's outputs have no reader after the next forward node: recomputing a ReLU needs a
    chain of them. ``out_bytes``: one per forward node after the input (3 + 4 per block).
    """
    builder = GraphBuilder(f"residual{blocks}")
    conv_flops, cheap_flops = 100_000, 100
    sizes = iter(out_bytes)
    builder.add("x", "fwd", 0, 0, [], op_class="input")
    builder.add("conv0", "fwd", next(sizes), conv_flops, ["x"], op_class="conv")
    builder.add("bn0", "fwd", next(sizes), cheap_flops, ["conv0"], op_class="norm")
    builder.add("relu0", "fwd", next(sizes), cheap_flops, ["bn0"], op_class="act")
    for k in range(1, blocks + 1):
        block_input = f"relu{k - 1}"
        builder.add(f"conv{k}", "fwd", next(sizes), conv_flops, [block_input], op_class="conv")
        builder.add(f"bn{k}", "fwd", next(sizes), cheap_flops, [f"conv{k}"], op_class="norm")
        builder.add(f"add{k}", "fwd", next(sizes), cheap_flops, [f"bn{k}", block_input], op_class="add")
        builder.add(f"relu{k}", "fwd", next(sizes), cheap_flops, [f"add{k}"], op_class="act")
    last = f"relu{blocks}"
    builder.add("loss", "loss", 4, 10, [last], op_class="loss")
    builder.add("bwd:loss", "bwd", 4, 20, ["loss", last], forward_of="loss")
    upstream = "bwd:loss"
    for k in range(blocks, 0, -1):
        builder.add(f"bwd:relu{k}", "bwd", 8, cheap_flops, [upstream, f"relu{k}"], forward_of=f"relu{k}")
        builder.add(f"bwd:add{k}", "bwd", 8, cheap_flops, [f"bwd:relu{k}"], forward_of=f"add{k}")
        builder.add(f"bwd:bn{k}", "bwd", 8, cheap_flops, [f"bwd:add{k}", f"conv{k}"], forward_of=f"bn{k}")
        builder.add(f"bwd:conv{k}", "bwd", 8, 2 * conv_flops, [f"bwd:bn{k}", f"relu{k - 1}"], forward_of=f"conv{k}")
        upstream = f"bwd:conv{k}"
    builder.add("bwd:relu0", "bwd", 8, cheap_flops, [upstream, "bwd:add1", "relu0"], forward_of="relu0")
    builder.add("bwd:bn0", "bwd", 8, cheap_flops, ["bwd:relu0", "conv0"], forward_of="bn0")
    builder.add("bwd:conv0", "bwd", 0, 2 * conv_flops, ["bwd:bn0", "x"], forward_of="conv0")
    return builder.build(param_bytes=1000, param_grad_bytes=1000)


def inverted_residual_graph(out_bytes: list[int]) -> TrainingGraph:
    """A MobileNetV2 block as traced: expand conv -> bn -> relu6 -> pad -> depthwise conv -> bn -> relu6 -> project conv.

    Each backward reads what torch saves: a convolution's its input, a BatchNorm's its input, a ReLU6's its input
    (the BatchNorm's output), a padding's nothing. So the first ReLU6's output has no reader after the padding:
    recomputing the padding for the depthwise backward recomputes it from the BatchNorm's output, which the
    expand convolution's output gives. ``out_bytes``: one per forward node after the input (8).
    """
    builder = GraphBuilder("inverted_residual")
    sizes = iter(out_bytes)
    conv_flops, cheap_flops = 100_000, 100
    forward = [("c1", "x", conv_flops), ("b1", "c1", cheap_flops), ("r1", "b1", cheap_flops), ("p1", "r1", cheap_flops),
               ("d1", "p1", conv_flops), ("b2", "d1", cheap_flops), ("r2", "b2", cheap_flops), ("c2", "r2", conv_flops)]
    builder.add("x", "fwd", 0, 0, [], op_class="input")
    for name, dep, flops in forward:
        builder.add(name, "fwd", next(sizes), flops, [dep], op_class="conv" if flops == conv_flops else "act")
    builder.add("loss", "loss", 4, 10, ["c2"], op_class="loss")
    builder.add("bwd:loss", "bwd", 4, 20, ["loss", "c2"], forward_of="loss")
    upstream = "bwd:loss"
    saved = {"c2": "r2", "r2": "b2", "b2": "d1", "d1": "p1", "p1": None, "r1": "b1", "b1": "c1", "c1": "x"}
    for name, _, flops in reversed(forward):
        reads = [upstream] + ([saved[name]] if saved[name] else [])
        builder.add(f"bwd:{name}", "bwd", 8, 2 * flops, reads, forward_of=name)
        upstream = f"bwd:{name}"
    return builder.build(param_bytes=1000, param_grad_bytes=1000)


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
