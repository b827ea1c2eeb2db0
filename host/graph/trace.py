"""Trace any ``nn.Module`` + example batch + loss into a :class:`TrainingGraph` (torch.export + fx passes).

Pipeline, fx style (each pass annotates the exported program or returns what it measured; nothing is
re-traced, and no pass changes another's results):

1. :mod:`host.graph.export`: ``torch.export`` of the model with its loss; recurrent layers unrolled per time
   step; in-place ops on activations rewritten out of place; unused ops dropped.
2. :mod:`host.graph.grouping`: every aten op gets a group (``node.meta[GROUP_META_KEY]``), one per
   TrainingGraph fwd/loss node, at the chosen granularity, and each group's :class:`GroupInterface`.
3. :mod:`host.graph.measure`: one Interpreter pass measures per group the forward FLOPs, its output bytes and
   the tensors autograd saves; then each group is re-run alone and differentiated for its backward FLOPs, its
   gradient inputs and the forward nodes its backward reads.
4. This module: the TrainingGraph with its backward DAG, and each group's :class:`NodeGroup`.

The shared types live in :mod:`host.graph.groups`; the FLOP formulas in :mod:`host.graph.flops`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule, Node

from device_agent.executor.split import make_schedulable
from host.graph.export import TraceError, export_program
from host.graph.granularity import GRANULARITIES, granularity_text, parse_granularity
from host.graph.grouping import (
    GROUP_META_KEY,
    INPUT_NODE,
    LOSS_NODE,
    Grouping,
    build_group_module,
    group_interfaces,
    group_program,
)
from host.graph.groups import ForwardMeasure, GroupInterface, NodeGroup
from host.graph.measure import (
    PINNED_INTERNALS_MAX_FRACTION,
    Backwards,
    ForwardRun,
    attribute_keys,
    measure_backwards,
    measure_forward,
    pinned_internals_bytes,
    record_forward,
)
from host.graph.training_graph import GraphBuilder, TrainingGraph

if TYPE_CHECKING:
    from host.graph.zoo import ModelBundle

__all__ = [
    "GRANULARITIES", "GROUP_META_KEY", "INPUT_NODE", "LOSS_NODE", "PINNED_INTERNALS_MAX_FRACTION", "GroupInterface",
    "NodeGroup",
    "TraceError", "TracedModel", "trace_model",
]  # fmt: skip


# ----------------------------------------------------------------------------- result types
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
def trace_model(bundle: ModelBundle, granularity: str = "layer", block_depth: int | None = None) -> TracedModel:
    """Trace ``bundle`` (module, example batch, labels, loss) into a TrainingGraph and its runnable program.

    ``granularity``: "layer" (one node per leaf module call, plus top-level ops such as residual adds),
    "block" (module path cut to ``block_depth`` levels, default 1), "block:N" (cut to N levels) or "op" (one
    node per non-view aten op); see host.graph.granularity.
    The module is traced as given: each submodule's own ``training`` flag (a BatchNorm frozen with ``.eval()``
    keeps its running statistics; a dropout in eval mode is the identity). Its buffers, modes and the global
    RNG are left as they were.
    """
    try:
        granularity, parsed_depth = parse_granularity(granularity)
    except ValueError as error:
        raise TraceError(str(error)) from None
    block_depth = parsed_depth if block_depth is None else block_depth
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
    # A recurrent layer is split per time step only where a node is a layer or an op: a block keeps the fused
    # kernel, and so the bitwise equality with eager that the unrolled cells give up (float rounding).
    exported = export_program(bundle, unroll_recurrent_layers=granularity != "block")
    gm = make_schedulable(exported.module())
    user_inputs, label_node = _split_placeholders(gm, bundle)
    grouping = group_program(gm, user_inputs, bundle.module, granularity, block_depth)
    forward = _run_forward(gm, bundle, grouping)
    producer = {p.name: 0 for p in user_inputs}
    producer.update((node.name, index) for node, index in grouping.group_index.items())
    interfaces = group_interfaces(gm, grouping, user_inputs)
    attr_keys = attribute_keys(gm, forward.values)
    measured = measure_forward(interfaces, forward.facts, forward.values, attr_keys)
    backwards = measure_backwards(gm, interfaces, measured, forward.values, producer, attr_keys, forward.facts)
    graph, groups = _training_graph(bundle, interfaces, measured, producer, backwards, granularity, block_depth)
    return TracedModel(
        graph=graph,
        graph_module=gm,
        groups=groups,
        input_names=tuple(p.name for p in user_inputs),
        label_name=label_node.name,
        loss_value=_loss_node(gm).name,
        granularity=granularity_text(granularity, block_depth),
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


def _training_graph(
    bundle: ModelBundle,
    interfaces: list[GroupInterface],
    forward: list[ForwardMeasure],
    producer: dict[str, int],
    backwards: Backwards,
    granularity: str,
    block_depth: int,
) -> tuple[TrainingGraph, list[NodeGroup]]:
    """fwd/loss nodes in program order, then bwd nodes from the loss back; each group with what was measured."""
    builder = GraphBuilder(bundle.name)
    pinned = pinned_internals_bytes(forward, backwards.by_group)
    # The caller holds the batch for the whole step, so it is fixed bytes, not a node the schedule
    # could free and "recompute" for free (which would under-report RAM by the batch).
    node_bytes = [0] + [m.outputs_bytes + m.saved_bytes - p for m, p in zip(forward[1:], pinned[1:], strict=True)]
    batch_bytes = forward[0].outputs_bytes
    for group, measure, nbytes in zip(interfaces, forward, node_bytes, strict=True):
        deps = (
            []
            if group.index == 0
            else list(dict.fromkeys(interfaces[producer[v]].name for v in group.input_values if v in producer))
        )
        measured = backwards.by_group.get(group.index)  # a group without a backward was not re-run alone
        builder.add(group.name, group.kind, nbytes, measure.flops, deps, measure.op_class,
                    op_count=len(group.fx_nodes),
                    workspace_bytes=measured.forward_workspace_bytes if measured is not None else 0)
    bwd_index: dict[int, int] = {}
    for group in reversed(interfaces[1:]):
        measured = backwards.by_group.get(group.index)
        if measured is None:
            continue
        deps = [f"bwd:{interfaces[c].name}" for c in backwards.upstream.get(group.index, [])]
        deps += [interfaces[g].name for g in measured.saved_groups]
        bwd_index[group.index] = builder.add(
            f"bwd:{group.name}", "bwd", measured.grad_bytes, measured.flops, deps, forward[group.index].op_class,
            forward_of=group.name, op_count=len(group.fx_nodes), workspace_bytes=measured.workspace_bytes,
        )
    groups = []
    for group, measure, nbytes, pinned_bytes in zip(interfaces, forward, node_bytes, pinned, strict=True):
        measured = backwards.by_group.get(group.index)
        groups.append(NodeGroup(
            **{f.name: getattr(group, f.name) for f in fields(GroupInterface)},
            op_class=measure.op_class, flops=measure.flops, output_bytes=nbytes, saved_bytes=measure.saved_bytes,
            pinned_bytes=pinned_bytes, bwd_index=bwd_index.get(group.index),
            **({} if measured is None else dict(
                bwd_flops=measured.flops, bwd_output_bytes=measured.grad_bytes, grad_input_values=measured.grad_inputs,
                bwd_saved_from=tuple(interfaces[g].name for g in measured.saved_groups))),
        ))

    trainable_bytes = sum(p.numel() * p.element_size() for p in bundle.module.parameters() if p.requires_grad)
    frozen_bytes = sum(p.numel() * p.element_size() for p in bundle.module.parameters() if not p.requires_grad)
    buffer_bytes = sum(b.numel() * b.element_size() for b in bundle.module.buffers())
    graph = builder.build(
        param_bytes=trainable_bytes,
        param_grad_bytes=trainable_bytes,
        param_tensors=sum(1 for p in bundle.module.parameters() if p.requires_grad),
        other_fixed_bytes=buffer_bytes + frozen_bytes + bundle.labels.numel() * bundle.labels.element_size()
        + batch_bytes + sum(pinned),
    )
    batch_size = int(bundle.inputs[0].shape[0]) if bundle.inputs and bundle.inputs[0].dim() > 0 else None
    graph.meta.update({"source": "trace", "granularity": granularity, "batch_size": batch_size, "model": bundle.name})
    if granularity == "block":
        graph.meta["block_depth"] = block_depth
    return graph, groups
