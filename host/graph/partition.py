"""Convert a host-side TracedModel into the device-side Partition the executor runs."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from device_agent.executor.partition import NodeProgram, Partition, PartitionNode, unique_by_identity
from host.graph.trace import TracedModel


def partition_from_traced(traced: TracedModel) -> Partition:
    """One NodeProgram per fwd/loss node (the trace's group modules), plus the graph's nodes and fingerprint."""
    gm = traced.graph_module
    trainable = unique_by_identity([p for p in gm.parameters() if p.requires_grad])
    buffer_ids = {id(b) for b in gm.buffers()}
    programs: dict[int, NodeProgram] = {}
    for group in traced.groups:
        if group.index == 0:
            programs[0] = NodeProgram(0, group.name, group.kind, None, group.input_values, group.output_values)
            continue
        module = traced.group_module(group.index)
        params = unique_by_identity(
            p for name in group.param_names if (p := gm.get_parameter(name)).requires_grad
        )
        buffers = unique_by_identity(t for name in group.buffer_names if id(t := _get_attr(gm, name)) in buffer_ids)
        programs[group.index] = NodeProgram(
            index=group.index,
            name=group.name,
            kind=group.kind,
            run=module,
            input_values=group.input_values,
            output_values=group.output_values,
            params=tuple(params),
            buffers=tuple(buffers),
            bwd_index=group.bwd_index,
            grad_input_values=group.grad_input_values,
            pinned_internals=group.pinned_bytes > 0,
            random=_draws_random(module),
            mutates_inputs=_mutates_inputs(module),
        )
    fixed = unique_by_identity(
        [*gm.parameters(), *gm.buffers()]
        + [t for n in gm.graph.nodes if n.op == "get_attr" and isinstance(t := _get_attr(gm, n.target), torch.Tensor)]
    )
    nodes = [
        PartitionNode(n.index, n.name, n.kind, tuple(n.deps), n.output_bytes, n.forward_index)
        for n in traced.graph.nodes
    ]
    return Partition(
        name=traced.graph.name,
        fingerprint=traced.graph.fingerprint(),
        nodes=nodes,
        programs=programs,
        batch_values=traced.input_names,
        label_value=traced.label_name,
        loss_value=traced.loss_value,
        value_producer=dict(traced.value_producer),
        fixed_tensors=tuple(fixed),
        parameters=tuple(trainable),
        meta={"granularity": traced.granularity},
    )


def _get_attr(gm: GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _draws_random(module: GraphModule) -> bool:
    return any(
        n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in n.target.tags
        for n in module.graph.nodes
    )


def _mutates_inputs(module: GraphModule) -> bool:
    """True when an op writes in place to a program input (or a view of one)."""
    aliases: set[Node] = {n for n in module.graph.nodes if n.op == "placeholder"}
    for node in module.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        for argument, value in zip(schema.arguments, node.args, strict=False):
            info = argument.alias_info
            if info is not None and info.is_write and isinstance(value, Node) and value in aliases:
                return True
        returns = schema.returns
        if returns and returns[0].alias_info is not None and node.args and node.args[0] in aliases:
            aliases.add(node)  # a view of an input
    return False
