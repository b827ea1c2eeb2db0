"""The TrainingGraph: forward, loss and backward nodes of one training step, in topological order.

Every schedulable quantity lives here: a node's output bytes (what it occupies while kept in RAM),
its workspace (temporaries held only while it runs), its FLOPs and its dependencies. Weights, weight
gradients and optimizer state are fixed bytes, reported next to the budget and never scheduled. A graph
is traced without an optimizer; the state of the one training uses is added by
:meth:`TrainingGraph.with_optimizer`, from :data:`OPTIMIZER_STATE`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from device_agent.errors import UserError
from device_agent.optimizers import OPTIMIZER_STATE

NodeKind = Literal["fwd", "loss", "bwd"]
NODE_KINDS: tuple[str, ...] = ("fwd", "loss", "bwd")


class GraphError(UserError, ValueError):
    """A TrainingGraph that breaks an invariant (order, dependency, size)."""


@dataclass(frozen=True)
class GraphNode:
    """One schedulable node. ``deps`` index earlier nodes of the same graph."""

    index: int
    name: str
    kind: NodeKind
    output_bytes: int
    flops: int
    deps: tuple[int, ...]
    op_class: str = "other"  # cost-model class: conv, matmul, norm, elementwise, pool, loss, input, other
    forward_index: int | None = None  # for a bwd node, the fwd/loss node whose gradient it computes
    op_count: int = 1  # aten ops it runs (a bwd node: its forward's); a calibrated profile charges each a dispatch
    # Bytes its computation holds for a moment beyond its inputs and output (temporaries, such as a loss's
    # gradient before the log-softmax backward turns it into the logits' gradient): RAM only while it runs.
    workspace_bytes: int = 0


@dataclass
class TrainingGraph:
    """A DAG of fwd/loss/bwd nodes in a valid topological order (deps always point backwards)."""

    name: str
    nodes: list[GraphNode]
    param_bytes: int = 0  # weights
    param_grad_bytes: int = 0  # weight gradients
    optimizer_state_bytes: int = 0  # set by with_optimizer (a traced graph has none: it does not know the optimizer)
    other_fixed_bytes: int = 0  # e.g. the batch and its labels, buffers, pinned statistics
    meta: dict = field(default_factory=dict)
    param_tensors: int = 0  # trainable parameter tensors (param_bytes is their size): per-tensor optimizer state
    optimizer: str | None = None  # whose state optimizer_state_bytes counts (None: none counted)

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------- invariants
    def validate(self) -> None:
        seen_names: set[str] = set()
        for position, node in enumerate(self.nodes):
            if node.index != position:
                raise GraphError(f"node {node.name!r} has index {node.index}, expected {position}")
            if node.kind not in NODE_KINDS:
                raise GraphError(f"node {node.name!r} has kind {node.kind!r}; expected one of {NODE_KINDS}")
            if node.name in seen_names:
                raise GraphError(f"duplicate node name {node.name!r}")
            seen_names.add(node.name)
            if node.output_bytes < 0 or node.flops < 0 or node.workspace_bytes < 0:
                raise GraphError(f"node {node.name!r} has negative bytes or FLOPs")
            for dep in node.deps:
                if not 0 <= dep < position:
                    raise GraphError(
                        f"node {node.name!r} (index {position}) depends on index {dep}; "
                        "dependencies must point to earlier nodes (topological order)"
                    )
            if len(set(node.deps)) != len(node.deps):
                raise GraphError(f"node {node.name!r} lists a dependency twice")

    # ----------------------------------------------------------------- structure
    @property
    def size(self) -> int:
        return len(self.nodes)

    @cached_property
    def edges(self) -> list[tuple[int, int]]:
        """(producer, consumer) pairs, ordered by consumer then producer."""
        return [(dep, node.index) for node in self.nodes for dep in sorted(node.deps)]

    @cached_property
    def successors(self) -> list[tuple[int, ...]]:
        users: list[list[int]] = [[] for _ in self.nodes]
        for producer, consumer in self.edges:
            users[producer].append(consumer)
        return [tuple(sorted(u)) for u in users]

    @cached_property
    def last_use(self) -> list[int]:
        """For each node, the index of its last consumer (itself if it has none)."""
        return [max(users) if users else node.index for node, users in zip(self.nodes, self.successors, strict=True)]

    @property
    def fixed_bytes(self) -> int:
        return self.param_bytes + self.param_grad_bytes + self.optimizer_state_bytes + self.other_fixed_bytes

    def fixed_breakdown_bytes(self) -> dict[str, int]:
        """The fixed bytes by kind: weights, their gradients, the optimizer's state, the rest (batch, buffers...)."""
        return {"params": self.param_bytes, "param_grads": self.param_grad_bytes,
                "optimizer_state": self.optimizer_state_bytes, "other": self.other_fixed_bytes}

    def with_optimizer(self, optimizer: str) -> TrainingGraph:
        """This graph with ``optimizer``'s state in its fixed bytes (a copy; the nodes are shared)."""
        rule = OPTIMIZER_STATE.get(optimizer)
        if rule is None:
            raise GraphError(f"optimizer: {optimizer!r} is not one of {', '.join(OPTIMIZER_STATE)}")
        state = rule.state_bytes(self.param_grad_bytes, self.param_tensors)
        return dataclasses.replace(self, optimizer_state_bytes=state, optimizer=optimizer, meta=dict(self.meta))

    @property
    def total_flops(self) -> int:
        return sum(node.flops for node in self.nodes)

    def index_of(self, name: str) -> int:
        for node in self.nodes:
            if node.name == name:
                return node.index
        raise KeyError(f"no node named {name!r} in graph {self.name!r}")

    def forward_nodes(self) -> list[GraphNode]:
        return [n for n in self.nodes if n.kind != "bwd"]

    def fingerprint(self) -> str:
        """A stable hash of the structure (names, kinds, bytes, FLOPs, deps): detects a changed trace."""
        from device_agent.executor.partition import graph_fingerprint

        return graph_fingerprint(self.name, [(n.name, n.kind, n.output_bytes, n.flops, list(n.deps)) for n in self.nodes])

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "param_bytes": self.param_bytes,
            "param_grad_bytes": self.param_grad_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "other_fixed_bytes": self.other_fixed_bytes,
            **({"param_tensors": self.param_tensors} if self.param_tensors else {}),
            **({"optimizer": self.optimizer} if self.optimizer else {}),
            "nodes": [
                {
                    "name": n.name,
                    "kind": n.kind,
                    "output_bytes": n.output_bytes,
                    "flops": n.flops,
                    "deps": list(n.deps),
                    "op_class": n.op_class,
                    "forward_index": n.forward_index,
                    **({"op_count": n.op_count} if n.op_count != 1 else {}),
                    **({"workspace_bytes": n.workspace_bytes} if n.workspace_bytes else {}),
                }
                for n in self.nodes
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> TrainingGraph:
        nodes = [
            GraphNode(
                index=i,
                name=d["name"],
                kind=d["kind"],
                output_bytes=int(d["output_bytes"]),
                flops=int(d["flops"]),
                deps=tuple(d["deps"]),
                op_class=d.get("op_class", "other"),
                forward_index=d.get("forward_index"),
                op_count=int(d.get("op_count", 1)),
                workspace_bytes=int(d.get("workspace_bytes", 0)),
            )
            for i, d in enumerate(data["nodes"])
        ]
        return cls(
            name=data["name"],
            nodes=nodes,
            param_bytes=int(data.get("param_bytes", 0)),
            param_grad_bytes=int(data.get("param_grad_bytes", 0)),
            optimizer_state_bytes=int(data.get("optimizer_state_bytes", 0)),
            other_fixed_bytes=int(data.get("other_fixed_bytes", 0)),
            param_tensors=int(data.get("param_tensors", 0)),
            optimizer=data.get("optimizer"),
        )


class GraphBuilder:
    """Appends nodes by name; resolves dependency names to indices and checks topological order."""

    def __init__(self, name: str):
        self.name = name
        self._nodes: list[GraphNode] = []
        self._index_by_name: dict[str, int] = {}

    def add(
        self,
        name: str,
        kind: NodeKind,
        output_bytes: int,
        flops: int,
        deps: list[str] | tuple[str, ...] = (),
        op_class: str = "other",
        forward_of: str | None = None,
        op_count: int = 1,
        workspace_bytes: int = 0,
    ) -> int:
        if name in self._index_by_name:
            raise GraphError(f"duplicate node name {name!r}")
        try:
            dep_indices = tuple(dict.fromkeys(self._index_by_name[d] for d in deps))
        except KeyError as missing:
            raise GraphError(f"node {name!r} depends on {missing} which has not been added yet") from None
        index = len(self._nodes)
        forward_index = self._index_by_name[forward_of] if forward_of is not None else None
        self._nodes.append(
            GraphNode(index, name, kind, int(output_bytes), int(flops), dep_indices, op_class, forward_index,
                      max(1, int(op_count)), int(workspace_bytes))
        )
        self._index_by_name[name] = index
        return index

    def build(self, **fixed: int) -> TrainingGraph:
        return TrainingGraph(name=self.name, nodes=list(self._nodes), **fixed)
