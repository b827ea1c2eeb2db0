"""Convert a host-side TracedModel into the device-side Partition the executor runs.

The split itself lives in :mod:`device_agent.executor.split`, so that a board cuts a received program
exactly as the host does; this module only describes the trace as a :class:`PartitionSpec`.
"""

from __future__ import annotations

from device_agent.executor.partition import Partition, PartitionNode
from device_agent.executor.split import GroupSpec, PartitionSpec, partition_from_program
from host.graph.trace import TracedModel


def partition_spec(traced: TracedModel) -> PartitionSpec:
    """The grouping and graph of ``traced``, as both sides split by it."""
    groups = tuple(
        GroupSpec(
            index=group.index,
            name=group.name,
            kind=group.kind,
            ops=group.fx_nodes if group.index else (),
            reads=group.input_values,
            produces=group.output_values,
            param_names=group.param_names,
            buffer_names=group.buffer_names,
            bwd_index=group.bwd_index,
            grad_reads=group.grad_input_values,
            pinned_internals=group.pinned_bytes > 0,
        )
        for group in traced.groups
    )
    nodes = tuple(
        PartitionNode(n.index, n.name, n.kind, tuple(n.deps), n.output_bytes, n.forward_index, n.workspace_bytes)
        for n in traced.graph.nodes
    )
    return PartitionSpec(
        graph_name=traced.graph.name,
        groups=groups,
        nodes=nodes,
        node_flops=tuple(n.flops for n in traced.graph.nodes),
        batch_placeholders=traced.input_names,
        reference_placeholder=traced.label_name,
        loss_value=traced.loss_value,
        granularity=traced.granularity,
    )


def partition_from_traced(traced: TracedModel) -> Partition:
    """One NodeProgram per fwd/loss node (the trace's group modules), plus the graph's nodes and fingerprint."""
    modules = {group.index: traced.group_module(group.index) for group in traced.groups if group.index}
    return partition_from_program(traced.graph_module, partition_spec(traced), modules)
