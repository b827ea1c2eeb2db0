"""The device-side view of a traced model: one runnable program per fwd/loss node of the TrainingGraph.

The host builds it from its trace (``host.graph.partition``); the executor needs nothing else. Values are
named (the trace's fx value names): a program reads named inputs and returns named outputs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PartitionNode:
    """One TrainingGraph node as the executor sees it."""

    index: int
    name: str
    kind: str  # fwd | loss | bwd
    deps: tuple[int, ...]
    output_bytes: int
    forward_index: int | None = None  # bwd only: the fwd/loss node it differentiates
    workspace_bytes: int = 0  # held only while it is computed: its temporaries beyond inputs and output


@dataclass
class NodeProgram:
    """The computation behind one fwd/loss node.

    ``run(*input_values) -> tuple(output_values)``; ``None`` for the input node, whose outputs are the batch.
    """

    index: int
    name: str
    kind: str  # fwd | loss
    run: Callable[..., tuple] | None
    input_values: tuple[str, ...]
    output_values: tuple[str, ...]
    params: tuple[torch.nn.Parameter, ...] = ()  # trainable parameters it reads (deduplicated)
    buffers: tuple[torch.Tensor, ...] = ()  # state it may update in place (BatchNorm running stats)
    bwd_index: int | None = None
    grad_input_values: tuple[str, ...] = ()  # inputs whose gradient its backward produces
    pinned_internals: bool = False  # saved tensors that are not outputs live with the graph, outside the schedule
    random: bool = False  # draws from the global RNG (dropout)
    mutates_inputs: bool = False  # has an in-place op on an input: fed clones


@dataclass
class Partition:
    """A model split into schedulable nodes, with the graph fingerprint the schedule must match."""

    name: str
    fingerprint: str
    nodes: list[PartitionNode]
    programs: dict[int, NodeProgram]  # fwd/loss node index -> program
    batch_values: tuple[str, ...]  # values fed by the batch inputs, in order (outputs of the input node)
    label_value: str  # value fed by the labels
    loss_value: str
    value_producer: dict[str, int]  # value -> fwd node producing it
    fixed_tensors: tuple[torch.Tensor, ...] = ()  # parameters, buffers, constants: never scheduled
    parameters: tuple[torch.nn.Parameter, ...] = ()
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # value -> consumers whose backward sends it a gradient, latest consumer first (autograd's order)
        senders: dict[str, list[int]] = {}
        for program in self.programs.values():
            for value in program.grad_input_values:
                senders.setdefault(value, []).append(program.index)
        self.grad_senders = {value: tuple(sorted(c, reverse=True)) for value, c in senders.items()}

    @property
    def size(self) -> int:
        return len(self.nodes)

    def program_of(self, index: int) -> NodeProgram:
        """The program of fwd/loss node ``index``, or of the node a bwd node differentiates."""
        node = self.nodes[index]
        return self.programs[node.forward_index if node.kind == "bwd" else index]


def unique_by_identity(items) -> list:
    """``items`` without repeats of the same object (tensors compare elementwise, so ``set`` will not do)."""
    seen: set[int] = set()
    result = []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            result.append(item)
    return result


def graph_fingerprint(graph_name: str, nodes: Sequence[tuple[str, str, int, int, list[int]]]) -> str:
    """A stable hash of a TrainingGraph's structure: (name, kind, output bytes, FLOPs, deps) per node.

    A schedule records it; the executor and a board check it, so a schedule never runs on another trace.
    """
    payload = [[name, kind, int(output_bytes), int(flops), [int(d) for d in deps]]
               for name, kind, output_bytes, flops, deps in nodes]
    return hashlib.sha256(json.dumps([graph_name, payload]).encode()).hexdigest()[:16]
