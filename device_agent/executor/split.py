"""Split an exported training program into node programs by a grouping: the one way host and board do it.

The host traces a model (``host.graph.trace``), decides the grouping and solves the schedule on it. A board
receives the same program as a ``torch.export`` archive plus the grouping, and must cut it exactly as the
host did, or the schedule's node indices would name other tensors. Both sides therefore use this module:

1. :func:`make_schedulable`: in-place ops on activations rewritten out of place (so every node owns its
   output) and unused ops dropped. Deterministic: the same program gives the same node names.
2. :func:`build_group_module`: one group alone as a GraphModule, ``forward(*reads) -> tuple(produces)``.
3. :func:`partition_from_program`: every group's module, parameters and buffers, as the executor's
   :class:`~device_agent.executor.partition.Partition`.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from device_agent.executor.partition import (
    NodeProgram,
    Partition,
    PartitionNode,
    graph_fingerprint,
    unique_by_identity,
)

__all__ = [
    "GroupSpec", "PartitionSpec", "SplitError", "VIEW_OPS", "MAYBE_VIEW_OPS", "build_group_module", "draws_random",
    "drop_unused_ops", "get_attr", "is_guard", "is_view", "make_schedulable", "op_name", "partition_from_program", "program_call_nodes",
    "rewrite_inplace",
]  # fmt: skip

_GUARDS_TARGET = "_guards_fn"  # input-shape guard that ep.module() adds; not part of any group

VIEW_OPS = frozenset(
    {
        "view", "_unsafe_view", "view_as", "permute", "transpose", "t", "expand", "expand_as", "unsqueeze",
        "squeeze", "slice", "select", "detach", "alias", "as_strided", "unflatten", "split", "split_with_sizes",
        "chunk", "unbind", "narrow", "movedim", "moveaxis", "swapaxes", "swapdims", "diagonal", "unfold",
        "view_as_real", "view_as_complex", "real", "imag", "numpy_T", "mT", "mH", "adjoint", "_reshape_alias",
        "getitem", "tensor_split", "hsplit", "vsplit", "dsplit",
    }
)  # fmt: skip
MAYBE_VIEW_OPS = frozenset({"reshape", "reshape_as", "flatten", "contiguous", "to", "type_as"})


class SplitError(ValueError):
    """A grouping that does not fit the program (another trace, another torch version, or a damaged job)."""


# ----------------------------------------------------------------------------------------- op facts
def op_name(node: Node) -> str:
    """The op's base name without overload: ``aten.conv2d.default`` -> ``conv2d``."""
    target = node.target
    if isinstance(target, str):
        return target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def is_view(node: Node) -> bool:
    """True when the op returns an alias of its first argument (so it owns no new memory)."""
    if node.target is operator.getitem:
        return True
    name = op_name(node)
    if name in VIEW_OPS:
        return True
    if name not in MAYBE_VIEW_OPS or not node.args or not isinstance(node.args[0], Node):
        return False
    # reshape/flatten/contiguous/to alias only for some strides: replay the op on a meta tensor.
    value = node.args[0].meta.get("val")
    if not isinstance(value, torch.Tensor) or any(isinstance(a, Node) for a in node.args[1:]):
        return False
    try:
        probe = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        result = node.target(probe, *node.args[1:], **node.kwargs)
    except Exception:
        return False
    return isinstance(result, torch.Tensor) and (result is probe or result._is_view())


def is_guard(node: Node) -> bool:
    """The input-shape guard call that ``ep.module()`` adds: it belongs to no group and is never dropped."""
    return node.op == "call_module" and node.target == _GUARDS_TARGET


def program_call_nodes(gm: GraphModule) -> list[Node]:
    """The program's ops (calls), without the input-shape guard."""
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_module") and not is_guard(n)]


def get_attr(gm: GraphModule, target: str):
    """The attribute ``target`` (dotted) of ``gm``."""
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


# ----------------------------------------------------------------------------------------- passes
def rewrite_inplace(gm: GraphModule) -> None:
    """Make in-place ops on activations out of place when nothing reads the mutated tensor afterwards."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    changed = False
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        schema = target._schema
        if not schema.arguments or not schema.is_mutable:
            continue
        alias = schema.arguments[0].alias_info
        if (
            alias is None
            or not alias.is_write
            or sum(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments) != 1
        ):
            continue
        base_name = target._schema.name.split("::")[-1]
        if not base_name.endswith("_"):
            continue
        functional_packet = getattr(torch.ops.aten, base_name[:-1], None)
        functional = getattr(functional_packet, target._overloadname, None) if functional_packet else None
        mutated = node.args[0] if node.args else None
        if functional is None or not isinstance(mutated, Node) or mutated.op != "call_function" or is_view(mutated):
            continue
        others = [u for u in mutated.users if u is not node]
        if any(is_view(u) or order[u] > order[node] for u in others):
            continue
        node.target = functional
        changed = True
    if changed:
        gm.recompile()


def drop_unused_ops(gm: GraphModule) -> None:
    """Export keeps ops whose results are unused (e.g. Hugging Face mask helpers): drop them."""
    if gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or is_guard(n)):
        gm.recompile()


def make_schedulable(gm: GraphModule) -> GraphModule:
    """The passes every exported program goes through before it is grouped or split (in place; returns ``gm``)."""
    rewrite_inplace(gm)
    drop_unused_ops(gm)
    return gm


def build_group_module(gm: GraphModule, index: int, ops: Sequence[str], reads: Sequence[str],
                       produces: Sequence[str]) -> GraphModule:
    """A GraphModule running only the ops ``ops`` of ``gm``: placeholders are ``reads``, it returns ``produces``."""
    by_name = {n.name: n for n in gm.graph.nodes}
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for name in reads:
        env[by_name[name]] = graph.placeholder(name)
    for name in ops:
        node = by_name[name]
        for arg in node.all_input_nodes:
            if arg not in env and arg.op == "get_attr":
                env[arg] = graph.node_copy(arg)
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[by_name[v]] for v in produces))
    return GraphModule(gm, graph, class_name=f"Group{index}")


# ----------------------------------------------------------------------------------------- partition
@dataclass(frozen=True)
class GroupSpec:
    """One fwd/loss node of the grouping: its ops and interface (value names are fx node names)."""

    index: int
    name: str
    kind: str  # fwd | loss
    ops: tuple[str, ...]
    reads: tuple[str, ...]
    produces: tuple[str, ...]
    param_names: tuple[str, ...] = ()
    buffer_names: tuple[str, ...] = ()
    bwd_index: int | None = None
    grad_reads: tuple[str, ...] = ()
    pinned_internals: bool = False


@dataclass(frozen=True)
class PartitionSpec:
    """What splitting a program needs besides the program: the grouping and the TrainingGraph's nodes."""

    graph_name: str
    groups: tuple[GroupSpec, ...]  # index = TrainingGraph index of the fwd/loss node; group 0 is the input
    nodes: tuple[PartitionNode, ...]
    node_flops: tuple[int, ...]
    batch_placeholders: tuple[str, ...]
    reference_placeholder: str  # the labels
    loss_value: str
    granularity: str = "layer"

    def fingerprint(self) -> str:
        return graph_fingerprint(self.graph_name, [
            (n.name, n.kind, n.output_bytes, flops, list(n.deps)) for n, flops in zip(self.nodes, self.node_flops,
                                                                                      strict=True)
        ])


def check_split(gm: GraphModule, spec: PartitionSpec) -> None:
    """The grouping names this program's ops, covers every one of them, and its values exist (SplitError)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    calls = {n.name for n in program_call_nodes(gm)}
    grouped: set[str] = set()
    for group in spec.groups:
        missing = [op for op in group.ops if op not in calls]
        missing += [v for v in (*group.reads, *group.produces) if v not in by_name]
        missing += [a for a in (*group.param_names, *group.buffer_names) if not _has_attr(gm, a)]
        if missing:
            raise SplitError(
                f"node {group.index} ({group.name}) names {len(missing)} op(s), value(s) or attribute(s) the "
                f"program does not have, e.g. {missing[0]!r}: the grouping was made for another program (or "
                "another torch version); solve and send the job again"
            )
        grouped.update(group.ops)
    ungrouped = sorted(calls - grouped)
    if ungrouped:
        raise SplitError(
            f"{len(ungrouped)} op(s) of the program belong to no node, e.g. {ungrouped[0]!r}: the grouping was "
            "made for another program; solve and send the job again"
        )
    for name in (*spec.batch_placeholders, spec.reference_placeholder, spec.loss_value):
        if name not in by_name:
            raise SplitError(f"the program has no value {name!r} that the grouping names as its batch, labels or "
                             "loss: the grouping was made for another program")


def partition_from_program(gm: GraphModule, spec: PartitionSpec,
                           group_modules: Mapping[int, GraphModule] | None = None) -> Partition:
    """One NodeProgram per fwd/loss node of ``spec``, cut out of ``gm`` (already :func:`make_schedulable`).

    ``group_modules`` may supply modules already built for some groups (the host's trace keeps them).
    """
    trainable = unique_by_identity([p for p in gm.parameters() if p.requires_grad])
    buffer_ids = {id(b) for b in gm.buffers()}
    programs: dict[int, NodeProgram] = {}
    producer: dict[str, int] = {name: 0 for name in spec.batch_placeholders}
    for group in spec.groups:
        if group.index == 0:
            programs[0] = NodeProgram(0, group.name, group.kind, None, group.reads, group.produces)
            continue
        producer.update((name, group.index) for name in group.produces)
        module = (group_modules or {}).get(group.index) or build_group_module(
            gm, group.index, group.ops, group.reads, group.produces
        )
        params = unique_by_identity(
            p for name in group.param_names if (p := gm.get_parameter(name)).requires_grad
        )
        buffers = unique_by_identity(t for name in group.buffer_names if id(t := get_attr(gm, name)) in buffer_ids)
        programs[group.index] = NodeProgram(
            index=group.index,
            name=group.name,
            kind=group.kind,
            run=module,
            input_values=group.reads,
            output_values=group.produces,
            params=tuple(params),
            buffers=tuple(buffers),
            bwd_index=group.bwd_index,
            grad_input_values=group.grad_reads,
            pinned_internals=group.pinned_internals,
            random=draws_random(module),
            mutates_inputs=_mutates_inputs(module),
        )
    fixed = unique_by_identity(
        [*gm.parameters(), *gm.buffers()]
        + [t for n in gm.graph.nodes if n.op == "get_attr" and isinstance(t := get_attr(gm, n.target), torch.Tensor)]
    )
    return Partition(
        name=spec.graph_name,
        fingerprint=spec.fingerprint(),
        nodes=list(spec.nodes),
        programs=programs,
        batch_values=spec.batch_placeholders,
        label_value=spec.reference_placeholder,
        loss_value=spec.loss_value,
        value_producer=producer,
        fixed_tensors=tuple(fixed),
        parameters=tuple(trainable),
        meta={"granularity": spec.granularity},
    )


def _has_attr(gm: GraphModule, target: str) -> bool:
    try:
        get_attr(gm, target)
    except AttributeError:
        return False
    return True


def draws_random(module: GraphModule) -> bool:
    """Whether an op of ``module`` draws from the global RNG (dropout, bernoulli, rand...)."""
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
