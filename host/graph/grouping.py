"""Grouping: every aten op of the exported program gets the TrainingGraph node (group) that runs it.

Groups follow ``nn_module_stack`` at the chosen granularity. View ops join their producer's group; ops that
depend only on constants and buffers (or read a tensor only for its shape, like ``zeros_like``) join their first
consumer's group or, read by several groups (BERT's attention mask), form a group of their own before the first;
views of parameters, buffers and batch inputs (``x.view(-1, 16)``, ``x.transpose(1, 2)``) own no memory and are
replicated into every group that reads them. Groups are
annotated on the fx nodes (``node.meta[GROUP_META_KEY]``), and :func:`build_group_module` cuts one group out
of the program as a standalone GraphModule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from device_agent.executor import split
from device_agent.executor.split import is_guard, is_view, op_name
from host.graph.export import MODEL_ATTR, TraceError
from host.graph.groups import GroupInterface
from host.graph.op_tables import SHAPE_ONLY_OPS
from host.graph.recurrent import RECURRENT_STEP_META_KEY

__all__ = [
    "GROUP_META_KEY", "INPUT_NODE", "LOSS_NODE", "Draft", "Grouping", "assign_groups", "build_group_module",
    "draft_names", "group_interfaces", "group_program", "module_path",
]  # fmt: skip

INPUT_NODE = "input"
LOSS_NODE = "loss"
GROUP_META_KEY = "poet_group"  # fx node meta: index of the group (TrainingGraph node) that runs it


def module_path(node: Node) -> str | None:
    """Innermost module path from ``nn_module_stack`` (wrapper-relative, dotted), or None when absent."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = str(list(stack.values())[-1][0])
    path = path.replace("L['self'].", "").replace("L['self']", "")
    return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path).strip(".")


@dataclass
class Draft:
    key: Any
    kind: str  # "input" | "fwd" | "loss"
    path: str  # module path relative to the user's module
    nodes: list[Node] = field(default_factory=list)  # every node the group runs
    primary: list[Node] = field(default_factory=list)  # the ops that made the group (name it)
    shared_constant: bool = False  # computed from constants alone and read by several groups


def _relative(path: str) -> str | None:
    """Path relative to the user's module, or None for ops outside it (the loss)."""
    if path == MODEL_ATTR:
        return ""
    if path.startswith(MODEL_ATTR + "."):
        return path[len(MODEL_ATTR) + 1 :]
    return None


def _common_prefix(paths: list[str]) -> list[str]:
    """Leading components shared by all paths, leaving at least one component in each."""
    split = [p.split(".") for p in paths]
    if not split or any(p == [""] for p in split):
        return []
    prefix: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    return prefix[: min(len(p) for p in split) - 1]


def _display_parts(rel: str, prefix: list[str]) -> list[str]:
    parts = rel.split(".") if rel else []
    return parts[len(prefix) :] if parts[: len(prefix)] == prefix else parts


def assign_groups(
    gm: GraphModule, user_inputs: list[Node], trainable_targets: set[str], granularity: str, block_depth: int
) -> tuple[list[Draft], list[str], set[Node]]:
    """Drafts in graph order (input, model groups, loss), the module-path prefix dropped from names, shared views.

    Shared views (views of parameters, buffers, constants or batch inputs) own no memory and are replicated
    into every group that reads them, so they never become an edge between groups. The input node runs no
    op, so a view of a batch input must run in the groups that read it.
    """
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module") and not is_guard(n)]
    paths: dict[Node, str] = {}
    previous = ""
    for node in calls:
        path = module_path(node)
        paths[node] = previous if path is None else path
        previous = paths[node]
    prefix = _common_prefix([rel for n in calls if (rel := _relative(paths[n])) is not None])

    input_draft = Draft(INPUT_NODE, "input", "")
    loss_draft = Draft(LOSS_NODE, "loss", "")
    primaries: list[Draft] = []
    group_of: dict[Node, Draft] = dict.fromkeys(user_inputs, input_draft)
    anchored: set[Node] = set(user_inputs)
    anchored.update(n for n in gm.graph.nodes if n.op == "get_attr" and n.target in trainable_targets)
    shared_views: set[Node] = set()
    batch_inputs = set(user_inputs)
    deferred: list[Node] = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in calls:
        if op_name(node) not in SHAPE_ONLY_OPS and any(a in anchored for a in node.all_input_nodes):
            anchored.add(node)
        rel = _relative(paths[node])
        if rel is None:
            group_of[node] = loss_draft
            continue
        if is_view(node):
            base = node.args[0] if node.args and isinstance(node.args[0], Node) else None
            if base is not None and (base.op == "get_attr" or base in batch_inputs or base in shared_views):
                shared_views.add(node)
            elif base is not None and base in group_of:
                group_of[node] = group_of[base]
            else:
                deferred.append(node)  # a view of a constant computed in the graph
            continue
        if node not in anchored:
            deferred.append(node)  # depends only on buffers/constants: runs with its first consumer
            continue
        display = _display_parts(rel, prefix)
        if granularity == "block":
            key: Any = ".".join(display[:block_depth])
        elif granularity == "op":
            key = node
        else:  # a recurrent layer unrolled by host.graph.recurrent: one group per cell (time step)
            step = node.meta.get(RECURRENT_STEP_META_KEY)
            key = rel if step is None else (rel, step)
        if not primaries or primaries[-1].key != key:
            primaries.append(Draft(key, "fwd", rel))
        group_of[node] = primaries[-1]
        primaries[-1].primary.append(node)

    ordered = [input_draft, *primaries, loss_draft]
    position: dict[int, float] = {id(d): float(i) for i, d in enumerate(ordered)}
    anchors = sorted(
        (order[n], position[id(d)]) for n, d in group_of.items() if n.op != "placeholder" and d is not input_draft
    )
    drafts = {id(d): d for d in ordered}
    for node in reversed(deferred):
        owners = {id(group_of[u]) for u in node.users if u in group_of}
        if len(owners) > 1 and not _writes(node):
            # read by several groups (BERT's attention mask, built from constants, read by every layer): a node of
            # its own, before its first reader, so that the others depend on it alone and not on that reader's
            # whole output (which held hf_bert's second attention node at 2.42 MB, its floor)
            shared = Draft(node.name, "fwd", _relative(paths[node]) or "", primary=[node], shared_constant=True)
            position[id(shared)] = min(position[k] for k in owners) - 0.5 + order[node] / (4 * len(order))
            drafts[id(shared)] = group_of[node] = shared
            continue
        if owners:
            owner = drafts[min(owners, key=position.__getitem__)]
        else:  # e.g. a running-statistics update: run it with the next op of the program
            later = [d for o, d in anchors if o > order[node]]
            earlier = [d for o, d in anchors if o < order[node]]
            owner = ordered[int(later[0] if later else (earlier[-1] if earlier else len(ordered) - 1))]
        group_of[node] = owner
    ordered = sorted(drafts.values(), key=lambda d: position[id(d)])
    for node in calls:
        if node in group_of:
            group_of[node].nodes.append(node)
    for draft in ordered:
        needed: set[Node] = set()
        stack = [a for n in draft.nodes for a in n.all_input_nodes if a in shared_views]
        while stack:
            view = stack.pop()
            if view not in needed:
                needed.add(view)
                stack.extend(a for a in view.all_input_nodes if a in shared_views)
        draft.nodes = sorted([*draft.nodes, *needed], key=order.__getitem__)
    if not loss_draft.nodes:
        raise TraceError(
            "no loss ops after the model's output: the loss was computed inside the model (a ModelOutput with its "
            "own 'loss') or loss_fn does not compute it from the output. Return the logits (or a ModelOutput "
            "without a loss) and let loss_fn compute a scalar from output and labels: the loss is a node of its own"
        )
    return ordered, prefix, shared_views


def _writes(node: Node) -> bool:
    """Whether ``node`` may write to one of its arguments (a buffer update; anything but an aten op counts, to be
    safe): such an op stays with its reader."""
    target = node.target
    return not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable


def draft_names(
    drafts: list[Draft], prefix: list[str], module: nn.Module, granularity: str, block_depth: int
) -> list[str]:
    """Node names from module paths (made unique with ``#2``, ``#3``...)."""
    names: list[str] = []
    for draft in drafts:
        if draft.kind != "fwd":
            names.append(draft.key)
            continue
        display = ".".join(_display_parts(draft.path, prefix))
        first_op = op_name(draft.primary[0])
        if granularity == "block" and not draft.shared_constant:
            name = ".".join(display.split(".")[:block_depth]) if display else first_op
        elif granularity == "op" or draft.shared_constant:  # bert.where: BERT's attention mask
            name = f"{display}.{first_op}" if display else first_op
        else:
            try:
                is_leaf = not any(True for _ in module.get_submodule(draft.path).children())
            except AttributeError:
                is_leaf = False
            name = display if (display and is_leaf) else (f"{display}.{first_op}" if display else first_op)
            if isinstance(draft.key, tuple):  # a recurrent cell: rnn.l0.t07
                name = f"{name}.{draft.key[1]}"
        names.append(name)
    unique: list[str] = []
    counts: dict[str, int] = {}
    taken = set(names)
    for name in names:
        counts[name] = counts.get(name, 0) + 1
        candidate = name
        if counts[name] > 1:
            suffix = counts[name]
            while f"{name}#{suffix}" in taken:
                suffix += 1
            candidate = f"{name}#{suffix}"
            taken.add(candidate)
        unique.append(candidate)
    return unique


def build_group_module(gm: GraphModule, group: GroupInterface) -> GraphModule:
    """A GraphModule running only ``group``'s nodes: placeholders are its inputs, it returns its outputs."""
    return split.build_group_module(gm, group.index, group.fx_nodes, group.input_values, group.output_values)


@dataclass
class Grouping:
    """The groups of a program: drafts in graph order (input, model groups, loss) and their unique names."""

    drafts: list[Draft]
    names: list[str]
    shared_views: set[Node]  # replicated views of parameters, buffers and batch inputs: in every group reading them
    group_index: dict[Node, int]  # fx node -> group index (attribute views excluded)


def group_program(
    gm: GraphModule, user_inputs: list[Node], module: nn.Module, granularity: str, block_depth: int
) -> Grouping:
    """Group ``gm``'s ops and annotate each fx node with its group (``node.meta[GROUP_META_KEY]``)."""
    trainable = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    drafts, prefix, shared_views = assign_groups(gm, user_inputs, trainable, granularity, block_depth)
    names = draft_names(drafts, prefix, module, granularity, block_depth)
    # Replicated shared views are left unannotated: they belong to every group that reads them.
    group_index = {node: i for i, draft in enumerate(drafts) for node in draft.nodes if node not in shared_views}
    for node, index in group_index.items():
        node.meta[GROUP_META_KEY] = index
    for node in user_inputs:
        node.meta[GROUP_META_KEY] = 0
    return Grouping(drafts, names, shared_views, group_index)


def group_interfaces(gm: GraphModule, grouping: Grouping, user_inputs: list[Node]) -> list[GroupInterface]:
    """Each group's interface: the values it reads from other groups, the values others read, its attributes."""
    param_targets = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    group_index, shared_views = grouping.group_index, grouping.shared_views

    def consumers(node: Node) -> list[Node]:
        """The ops reading ``node``, looking through shared views (which every reading group runs itself)."""
        found: list[Node] = []
        for user in node.users:
            found.extend(consumers(user) if user in shared_views else [user])
        return found

    groups: list[GroupInterface] = []
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
            GroupInterface(
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
