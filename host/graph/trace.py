"""Trace any ``nn.Module`` + example batch + loss into a :class:`TrainingGraph` (torch.export + fx passes).

Pipeline, fx style (each pass annotates the exported program; nothing is re-traced):

1. :mod:`host.graph.export`: ``torch.export`` of the model with its loss; in-place ops on activations
   rewritten out of place; unused ops dropped.
2. :mod:`host.graph.grouping`: every aten op gets a group (``node.meta[GROUP_META_KEY]``), one per
   TrainingGraph fwd/loss node, at the chosen granularity.
3. :mod:`host.graph.measure`: one Interpreter pass records per group the forward FLOPs and the tensors
   autograd saves; then each group is re-run alone and differentiated for its backward FLOPs, its gradient
   inputs and the forward nodes its backward reads.
4. This module: the groups' interfaces (:class:`NodeGroup`) and the TrainingGraph with its backward DAG.

Op classes and FLOP formulas for the ops torch's counter skips are in :mod:`host.graph.op_tables`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule, Node

from device_agent.executor.split import make_schedulable
from host.graph.export import TraceError, export_program
from host.graph.grouping import GROUP_META_KEY, INPUT_NODE, LOSS_NODE, Grouping, build_group_module, group_program
from host.graph.measure import (
    PINNED_INTERNALS_MAX_FRACTION,
    Backwards,
    ForwardRun,
    attribute_keys,
    measure_backwards,
    measure_forward,
    record_forward,
    release_unused_pins,
)
from host.graph.training_graph import GraphBuilder, TrainingGraph

if TYPE_CHECKING:
    from host.graph.zoo import ModelBundle

__all__ = [
    "GRANULARITIES", "GROUP_META_KEY", "INPUT_NODE", "LOSS_NODE", "PINNED_INTERNALS_MAX_FRACTION", "NodeGroup",
    "TraceError", "TracedModel", "trace_model",
]  # fmt: skip

GRANULARITIES: tuple[str, ...] = ("layer", "block", "op")


# ----------------------------------------------------------------------------- result types
@dataclass
class NodeGroup:
    """The fx nodes behind one fwd/loss node, and what an executor needs to run them on their own.

    Value names are fx node names of :attr:`TracedModel.graph_module`; ``param_names`` and
    ``buffer_names`` are its attribute targets (prefixed ``model.``, the wrapper's attribute).
    ``fx_nodes`` may repeat a view of a parameter/buffer that another group also runs. Running a
    group again (recomputation) re-applies its buffer updates, e.g. BatchNorm running statistics.
    """

    index: int  # TrainingGraph index of the fwd/loss node
    name: str
    kind: str  # "fwd" | "loss"
    module_path: str  # path in the user's module ("" for the input, the loss and top-level ops)
    fx_nodes: tuple[str, ...]  # call nodes run by this group, in program order
    input_values: tuple[str, ...]  # values read from other groups or graph placeholders
    output_values: tuple[str, ...]  # values read by later groups or returned by the graph
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]  # buffers and lifted tensor constants
    op_class: str = "other"
    flops: int = 0
    output_bytes: int = 0  # used outputs + tensors autograd saves that were created here (unless pinned)
    saved_bytes: int = 0  # tensors autograd saves that were created here and are not outputs ("internals")
    pinned_bytes: int = 0  # internals held outside the schedule, as fixed bytes (PINNED_INTERNALS_MAX_FRACTION)
    bwd_index: int | None = None  # TrainingGraph index of bwd:<name>, None when no gradient is needed
    bwd_flops: int = 0
    bwd_output_bytes: int = 0
    grad_input_values: tuple[str, ...] = ()  # inputs that receive a gradient from this group's backward
    bwd_saved_from: tuple[str, ...] = ()  # fwd nodes whose outputs this group's backward reads


@dataclass
class TracedModel:
    """A traced training step: the TrainingGraph plus the runnable program and its grouping.

    ``graph_module(*inputs, labels=labels)`` returns the loss. It shares parameters and buffers with
    the bundle's module. :meth:`group_module` builds one group as a standalone GraphModule.
    """

    graph: TrainingGraph
    graph_module: GraphModule
    groups: list[NodeGroup]
    input_names: tuple[str, ...]  # placeholders fed with bundle.inputs, in order
    label_name: str  # placeholder fed with bundle.labels
    loss_value: str  # fx value holding the scalar loss
    granularity: str
    trace_seconds: float
    value_producer: dict[str, int]  # fx value -> index of the group that produces it (placeholders: input group)
    exported: torch.export.ExportedProgram | None = None  # what a board receives (torch.export.save)
    _group_modules: dict[int, GraphModule] = field(default_factory=dict, repr=False)

    def group_module(self, index: int) -> GraphModule:
        """Group ``index`` alone: ``forward(*input_values) -> tuple(output_values)`` (cached)."""
        if index not in self._group_modules:
            self._group_modules[index] = build_group_module(self.graph_module, self.groups[index])
        return self._group_modules[index]

    def group_named(self, name: str) -> NodeGroup:
        return self.groups[self.graph.index_of(name)]


# ----------------------------------------------------------------------------- entry point
def trace_model(bundle: ModelBundle, granularity: str = "layer", block_depth: int = 1) -> TracedModel:
    """Trace ``bundle`` (module, example batch, labels, loss) into a TrainingGraph and its runnable program.

    ``granularity``: "layer" (one node per leaf module call, plus top-level ops such as residual adds),
    "block" (module path cut to ``block_depth`` levels) or "op" (one node per non-view aten op).
    The module is traced as given: each submodule's own ``training`` flag (a BatchNorm frozen with ``.eval()``
    keeps its running statistics; a dropout in eval mode is the identity). Its buffers, modes and the global
    RNG are left as they were.
    """
    if granularity not in GRANULARITIES:
        raise TraceError(f"unknown granularity {granularity!r}; expected one of {GRANULARITIES}")
    if block_depth < 1:
        raise TraceError(f"block_depth must be at least 1, got {block_depth}")
    started = time.perf_counter()
    module = bundle.module
    modes = [(m, m.training) for m in module.modules()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with torch.random.fork_rng(devices=[]):
            return _trace(bundle, granularity, block_depth, started)
    finally:
        with torch.no_grad():
            for buffer, snapshot in buffers:
                buffer.copy_(snapshot)
        for submodule, training in modes:
            submodule.training = training


def _trace(bundle: ModelBundle, granularity: str, block_depth: int, started: float) -> TracedModel:
    """The passes in order; the forward run and the backward re-runs draw from the RNG in this order."""
    exported = export_program(bundle)
    gm = make_schedulable(exported.module())
    user_inputs, label_node = _split_placeholders(gm, bundle)
    grouping = group_program(gm, user_inputs, bundle.module, granularity, block_depth)
    forward = _run_forward(gm, bundle, grouping)
    producer = {p.name: 0 for p in user_inputs}
    producer.update((node.name, index) for node, index in grouping.group_index.items())
    groups = _node_groups(gm, grouping, user_inputs)
    attr_keys = attribute_keys(gm, forward.values)
    measure_forward(groups, forward.facts, forward.values, attr_keys)
    backwards = measure_backwards(gm, groups, forward.values, producer, attr_keys, forward.facts)
    release_unused_pins(groups, backwards.by_group)
    graph = _training_graph(bundle, groups, producer, backwards, granularity, block_depth)
    return TracedModel(
        graph=graph,
        graph_module=gm,
        groups=groups,
        input_names=tuple(p.name for p in user_inputs),
        label_name=label_node.name,
        loss_value=_loss_node(gm).name,
        granularity=granularity,
        trace_seconds=time.perf_counter() - started,
        value_producer=producer,
        exported=exported,
        _group_modules=backwards.group_modules,
    )


def _split_placeholders(gm: GraphModule, bundle: ModelBundle) -> tuple[list[Node], Node]:
    """The program's placeholders: the model inputs, then the labels."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(bundle.inputs) + 1:
        raise TraceError(
            f"model {bundle.name!r}: expected {len(bundle.inputs)} input placeholders and labels after export, "
            f"got {[p.name for p in placeholders]}"
        )
    return placeholders[:-1], placeholders[-1]


def _run_forward(gm: GraphModule, bundle: ModelBundle, grouping: Grouping) -> ForwardRun:
    """One recorded forward pass on the example batch; the loss must be a scalar that needs a gradient."""
    forward = record_forward(gm, grouping.group_index, len(grouping.drafts), tuple(bundle.inputs), bundle.labels)
    loss = forward.loss
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TraceError(f"model {bundle.name!r}: loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if not loss.requires_grad:
        raise TraceError(f"model {bundle.name!r}: the loss does not depend on any trainable parameter")
    return forward


def _loss_node(gm: GraphModule) -> Node:
    loss_node = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return loss_node[0] if isinstance(loss_node, (tuple, list)) else loss_node


def _node_groups(gm: GraphModule, grouping: Grouping, user_inputs: list[Node]) -> list[NodeGroup]:
    """Each group's interface: the values it reads from other groups, the values others read, its attributes."""
    param_targets = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    group_index, shared_views = grouping.group_index, grouping.shared_views

    def consumers(node: Node) -> list[Node]:
        """The ops reading ``node``, looking through shared views (which every reading group runs itself)."""
        found: list[Node] = []
        for user in node.users:
            found.extend(consumers(user) if user in shared_views else [user])
        return found

    groups: list[NodeGroup] = []
    for index, (draft, name) in enumerate(zip(grouping.drafts, grouping.names, strict=True)):
        members = set(draft.nodes) | (set(user_inputs) if index == 0 else set())
        inputs: list[str] = []
        attrs: list[Node] = []
        for node in draft.nodes:
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":
                    if arg not in attrs:
                        attrs.append(arg)
                elif arg not in members and arg.name not in inputs:
                    inputs.append(arg.name)
        if index == 0:
            inputs = [p.name for p in user_inputs]
        outputs = [
            n.name
            for n in (user_inputs if index == 0 else []) + draft.nodes
            if n not in shared_views
            and any((u.op == "output") or (u in group_index and group_index[u] != index) for u in consumers(n))
        ]
        groups.append(
            NodeGroup(
                index=index,
                name=name,
                kind="loss" if draft.kind == "loss" else "fwd",
                module_path=draft.path,
                fx_nodes=tuple(n.name for n in draft.nodes),
                input_values=tuple(inputs),
                output_values=tuple(outputs),
                param_names=tuple(str(a.target) for a in attrs if a.target in param_targets),
                buffer_names=tuple(str(a.target) for a in attrs if a.target not in param_targets),
            )
        )
    return groups


def _training_graph(
    bundle: ModelBundle,
    groups: list[NodeGroup],
    producer: dict[str, int],
    backwards: Backwards,
    granularity: str,
    block_depth: int,
) -> TrainingGraph:
    """fwd/loss nodes in program order, then bwd nodes from the loss back; records each group's backward."""
    builder = GraphBuilder(bundle.name)
    # The caller holds the batch for the whole step, so it is fixed bytes, not a node the schedule
    # could free and "recompute" for free (which would under-report RAM by the batch).
    batch_bytes, groups[0].output_bytes = groups[0].output_bytes, 0
    for group in groups:
        deps = (
            []
            if group.index == 0
            else list(dict.fromkeys(groups[producer[v]].name for v in group.input_values if v in producer))
        )
        builder.add(group.name, group.kind, group.output_bytes, group.flops, deps, group.op_class,
                    op_count=len(group.fx_nodes))
    for group in reversed(groups[1:]):
        measured = backwards.by_group.get(group.index)
        if measured is None:
            continue
        deps = [f"bwd:{groups[c].name}" for c in backwards.upstream.get(group.index, [])]
        deps += [groups[g].name for g in measured.saved_groups]
        group.bwd_index = builder.add(
            f"bwd:{group.name}", "bwd", measured.grad_bytes, measured.flops, deps, group.op_class, forward_of=group.name,
            op_count=len(group.fx_nodes),
        )
        group.bwd_flops = measured.flops
        group.bwd_output_bytes = measured.grad_bytes
        group.grad_input_values = measured.grad_inputs
        group.bwd_saved_from = tuple(groups[g].name for g in measured.saved_groups)

    trainable_bytes = sum(p.numel() * p.element_size() for p in bundle.module.parameters() if p.requires_grad)
    frozen_bytes = sum(p.numel() * p.element_size() for p in bundle.module.parameters() if not p.requires_grad)
    buffer_bytes = sum(b.numel() * b.element_size() for b in bundle.module.buffers())
    graph = builder.build(
        param_bytes=trainable_bytes,
        param_grad_bytes=trainable_bytes,
        param_tensors=sum(1 for p in bundle.module.parameters() if p.requires_grad),
        other_fixed_bytes=buffer_bytes + frozen_bytes + bundle.labels.numel() * bundle.labels.element_size()
        + batch_bytes + sum(group.pinned_bytes for group in groups),
    )
    batch_size = int(bundle.inputs[0].shape[0]) if bundle.inputs and bundle.inputs[0].dim() > 0 else None
    graph.meta.update({"source": "trace", "granularity": granularity, "batch_size": batch_size, "model": bundle.name})
    if granularity == "block":
        graph.meta["block_depth"] = block_depth
    return graph
