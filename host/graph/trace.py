"""Trace any ``nn.Module`` + example batch + loss into a :class:`TrainingGraph` (torch.export + an fx pass).

Pipeline, fx style (each step annotates the exported program; nothing is re-traced):

1. ``torch.export.export(strict=False)`` of a wrapper whose forward returns ``loss_fn(model(*inputs), labels)``,
   so the loss is part of the program. The training IR keeps ``batch_norm`` in training mode and
   ``dropout`` as dropout. In-place ops on activations (``relu_``, ``+=``) are rewritten out of place
   when no later op reads the mutated tensor, so every node owns its output; buffer mutations
   (BatchNorm running statistics) stay in place.
2. Grouping: every aten op gets a group (``node.meta["poet_group"]``) from its ``nn_module_stack`` at the
   chosen granularity. View ops join their producer's group; ops that depend only on constants and
   buffers (or read a tensor only for its shape, like ``zeros_like``) join their first consumer's
   group; views of parameters/buffers are replicated into every group that reads them. Ops whose
   results are unused are dropped.
3. One :class:`torch.fx.Interpreter` pass on the example batch records per group the forward FLOPs and
   the tensors autograd saves (``saved_tensors_hooks``); output bytes follow from storages.
4. Each group is re-run alone (inputs detached) and differentiated under ``FlopCounterMode``: backward
   FLOPs, which forward outputs its backward needs, and which inputs receive a gradient.

FLOPs: matmul/conv come from ``torch.utils.flop_counter``; for ops it reports 0 this module uses
elementwise/activation = output numel; norm = 5 x input numel (mean, variance, subtract, scale by
1/std, affine); pooling = kernel elements x output numel; softmax = 5 x numel; loss = 3 x logits numel;
reductions = input numel; attention (sdpa) = 4·B·H·L·S·E; data movement (embedding, cat, copies) = 0.
A backward is the counter's backward FLOPs plus 2 x the forward FLOPs that came from formulas.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import math
import operator
import os
import re
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.fx import GraphModule, Interpreter, Node
from torch.utils.flop_counter import FlopCounterMode

from host.graph.training_graph import GraphBuilder, TrainingGraph

if TYPE_CHECKING:
    from host.graph.zoo import ModelBundle

__all__ = ["GRANULARITIES", "NodeGroup", "TraceError", "TracedModel", "trace_model"]

GRANULARITIES: tuple[str, ...] = ("layer", "block", "op")
# Internals are the tensors a group's backward saves that are not its outputs. When they are at most this
# fraction of the outputs (BatchNorm's and LayerNorm's mean and 1/std), they are pinned: held from the run
# whose graph the backward uses until that backward, outside the schedule, and charged to the fixed bytes.
# The node's schedulable bytes are then its outputs alone, and its backward depends on its own forward node
# only if it reads those outputs, so (for example) a BatchNorm output can be freed once the ReLU after it has
# run, as autograd frees it. Larger internals (dropout masks, a block's intermediates) stay in the node.
PINNED_INTERNALS_MAX_FRACTION = 1 / 8
INPUT_NODE = "input"
LOSS_NODE = "loss"
GROUP_META_KEY = "poet_group"  # fx node meta: index of the group (TrainingGraph node) that runs it

_MODEL_ATTR = "model"  # the wrapper's attribute holding the user's module: module paths start with it
_GUARDS_TARGET = "_guards_fn"  # input-shape guard that ep.module() adds; not part of any group


class TraceError(ValueError):
    """A model that cannot be traced into a TrainingGraph; the message names the op or line and a fix."""


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
    pinned_bytes: int = 0  # internals held outside the schedule, as fixed bytes (see PINNED_INTERNALS_MAX_FRACTION)
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
    _group_modules: dict[int, GraphModule] = field(default_factory=dict, repr=False)

    def group_module(self, index: int) -> GraphModule:
        """Group ``index`` alone: ``forward(*input_values) -> tuple(output_values)`` (cached)."""
        if index not in self._group_modules:
            self._group_modules[index] = _build_group_module(self.graph_module, self.groups[index])
        return self._group_modules[index]

    def group_named(self, name: str) -> NodeGroup:
        return self.groups[self.graph.index_of(name)]


# ----------------------------------------------------------------------------- op tables
_VIEW_OPS = frozenset(
    {
        "view", "_unsafe_view", "view_as", "permute", "transpose", "t", "expand", "expand_as", "unsqueeze",
        "squeeze", "slice", "select", "detach", "alias", "as_strided", "unflatten", "split", "split_with_sizes",
        "chunk", "unbind", "narrow", "movedim", "moveaxis", "swapaxes", "swapdims", "diagonal", "unfold",
        "view_as_real", "view_as_complex", "real", "imag", "numpy_T", "mT", "mH", "adjoint", "_reshape_alias",
        "getitem", "tensor_split", "hsplit", "vsplit", "dsplit",
    }
)  # fmt: skip
_MAYBE_VIEW_OPS = frozenset({"reshape", "reshape_as", "flatten", "contiguous", "to", "type_as"})
_CONV_OPS = frozenset(
    {"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
     "conv_transpose3d", "conv_tbc", "mkldnn_convolution"}
)  # fmt: skip
_SDPA_OPS = frozenset(
    {"scaled_dot_product_attention", "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention",
     "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention"}
)  # fmt: skip
_MATMUL_OPS = _SDPA_OPS | frozenset(
    {"mm", "bmm", "addmm", "matmul", "linear", "baddbmm", "addbmm", "einsum", "addmv", "mv", "dot", "vdot",
     "bilinear", "tensordot", "inner", "outer", "ger", "addr", "_scaled_mm"}
)  # fmt: skip
_NORM_OPS = frozenset(
    {"batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
     "_native_batch_norm_legit_no_training", "_batch_norm_with_update", "_batch_norm_impl_index", "layer_norm",
     "native_layer_norm", "group_norm", "native_group_norm", "instance_norm", "rms_norm", "_fused_rms_norm",
     "local_response_norm"}
)  # fmt: skip
_POOL_PATTERN = re.compile(r"^_?(adaptive_)?(max|avg|lp)_pool(\d)d")
_SOFTMAX_OPS = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"})
_LOSS_OPS = frozenset(
    {"cross_entropy_loss", "nll_loss", "nll_loss2d", "nll_loss_nd", "mse_loss", "l1_loss", "smooth_l1_loss",
     "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss",
     "multilabel_margin_loss", "multi_margin_loss", "hinge_embedding_loss", "margin_ranking_loss",
     "cosine_embedding_loss", "poisson_nll_loss", "triplet_margin_loss", "ctc_loss"}
)  # fmt: skip
_REDUCTION_OPS = frozenset(
    {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "std_mean", "norm",
     "linalg_vector_norm", "prod", "logsumexp", "argmax", "argmin", "all", "any"}
)  # fmt: skip
_ZERO_FLOP_OPS = _VIEW_OPS | _MAYBE_VIEW_OPS | frozenset(
    {"embedding", "embedding_bag", "gather", "scatter", "scatter_add", "index", "index_select", "index_put",
     "index_add", "index_copy", "cat", "concat", "stack", "clone", "copy", "_to_copy", "zeros", "zeros_like",
     "ones", "ones_like", "full", "full_like", "empty", "empty_like", "empty_strided", "arange", "scalar_tensor",
     "new_zeros", "new_ones", "new_full", "new_empty", "constant_pad_nd", "pad", "repeat", "tile", "roll", "flip",
     "masked_select", "nonzero", "lift_fresh_copy", "lift_fresh", "rand", "randn", "rand_like", "randn_like",
     "randint", "randperm", "one_hot", "repeat_interleave", "select_scatter", "slice_scatter",
     "diagonal_scatter", "as_strided_scatter", "sym_size", "_assert_tensor_metadata", "_assert_scalar"}
)  # fmt: skip
# Ops that read their tensor argument only for its shape/dtype: they never tie a group to their input.
_SHAPE_ONLY_OPS = frozenset(
    {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "new_zeros",
     "new_ones", "new_empty", "new_full", "new_empty_strided"}
)  # fmt: skip
# When several classes tie on FLOPs, the first one here names the group.
_CLASS_PRIORITY = ("conv", "matmul", "norm", "pool", "loss", "elementwise", "other")


def _op_name(node: Node) -> str:
    """The op's base name without overload: ``aten.conv2d.default`` -> ``conv2d``."""
    target = node.target
    if isinstance(target, str):
        return target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def _is_guard(node: Node) -> bool:
    return node.op == "call_module" and node.target == _GUARDS_TARGET


def _module_path(node: Node) -> str | None:
    """Innermost module path from ``nn_module_stack`` (wrapper-relative, dotted), or None when absent."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = str(list(stack.values())[-1][0])
    path = path.replace("L['self'].", "").replace("L['self']", "")
    return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path).strip(".")


def _is_view(node: Node) -> bool:
    """True when the op returns an alias of its first argument (so it owns no new memory)."""
    if node.target is operator.getitem:
        return True
    name = _op_name(node)
    if name in _VIEW_OPS:
        return True
    if name not in _MAYBE_VIEW_OPS or not node.args or not isinstance(node.args[0], Node):
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


def _numel(value: Any) -> int:
    return value.numel() if isinstance(value, torch.Tensor) else 0


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a value (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _pool_flops(name: str, match: re.Match, args: tuple, result: Any) -> int:
    """Kernel elements x output numel; an adaptive pool's kernel is ceil(input / output) per dim."""
    dims = int(match.group(3))
    output = next(_tensors(result), None)
    if output is None or not args or not isinstance(args[0], torch.Tensor):
        return 0
    if match.group(1):
        in_sizes = args[0].shape[-dims:]
        out_sizes = output.shape[-dims:]
        kernel = math.prod(math.ceil(i / max(o, 1)) for i, o in zip(in_sizes, out_sizes, strict=True))
    else:
        size = args[1] if len(args) > 1 else 1
        sizes = [size] * dims if isinstance(size, int) else list(size)
        kernel = math.prod(int(s) for s in sizes) if sizes else 1
    return int(kernel * output.numel())


def _classify_op(name: str, args: tuple, result: Any) -> tuple[str, int]:
    """(op_class, formula FLOPs) of one op; the formula is used only when the counter reports 0."""
    first = args[0] if args else None
    if name in _CONV_OPS:
        return "conv", 0
    if name in _SDPA_OPS:
        query, key, value = (a for a in args[:3])
        length, width = query.shape[-2], query.shape[-1]
        batch_heads = query.numel() // max(length * width, 1)
        return "matmul", 2 * batch_heads * length * key.shape[-2] * (width + value.shape[-1])
    if name in _MATMUL_OPS:
        # Only reached for mv/dot-like ops the counter skips: 2 x the largest operand is exact there.
        return "matmul", 2 * max((_numel(a) for a in args), default=0)
    if name in _NORM_OPS:
        return "norm", 5 * _numel(first)
    pool = _POOL_PATTERN.match(name)
    if pool:
        return "pool", _pool_flops(name, pool, args, result)
    if name in _SOFTMAX_OPS:
        return "elementwise", 5 * _numel(first)
    if name in _LOSS_OPS:
        return "loss", 3 * _numel(first)
    if name in _REDUCTION_OPS:
        return "elementwise", _numel(first)
    if name in _ZERO_FLOP_OPS:
        return "other", 0
    return "elementwise", max((t.numel() for t in _tensors(result)), default=0)


# ----------------------------------------------------------------------------- export
class _LossWrapper(nn.Module):
    """``forward(*inputs, labels) -> loss_fn(model(*inputs), labels)``: puts the loss into the exported graph."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(*inputs), labels)


_QUOTED_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def _user_frame(error: BaseException) -> tuple[str, int, str, Any] | None:
    """The deepest traceback frame outside torch, the stdlib and this file: (file, line, function, self)."""
    skip = (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"], __file__)
    found = None
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            filename = tb.tb_frame.f_code.co_filename
            if not filename.startswith("<") and not filename.startswith(skip):
                found = (filename, tb.tb_lineno, tb.tb_frame.f_code.co_name, tb.tb_frame.f_locals.get("self"))
            tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return found


def _export_error(error: Exception, bundle: ModelBundle) -> TraceError:
    """A TraceError naming where export failed (file, line, module) and how to get around it."""
    text = str(error).strip()
    headline = text.splitlines()[0] if text else type(error).__name__
    where = ""
    frame = _user_frame(error)
    # torch.export names the user line in its message ("File ..., line N, in f\n    code"); prefer that.
    quoted = _QUOTED_FRAME.findall(text)
    if quoted:
        filename, line_text, function, source = quoted[-1]
        lineno = int(line_text)
    elif frame is not None:
        filename, lineno, function, _ = frame
        source = linecache.getline(filename, lineno).strip()
    if quoted or frame is not None:
        where = f" at {os.path.basename(filename)}:{lineno} in {function}()"
        owner = frame[3] if frame is not None and frame[:3] == (filename, lineno, function) else None
        if isinstance(owner, nn.Module):
            path = next((p for p, m in bundle.module.named_modules() if m is owner), None)
            where += f" of {type(owner).__name__}" + (f" {path!r}" if path else "")
        if source:
            where += f": `{source.strip()}`"
    if "data-dependent" in text or "GuardOnDataDependent" in type(error).__name__:
        cause = (
            "Python control flow on tensor values (if/while on a tensor, .item(), bool()) cannot be traced; "
            "rewrite it with torch.where/torch.cond or move the decision out of forward()"
        )
    else:
        cause = "simplify that forward (plain tensor ops, no Python-side data-dependent logic)"
    return TraceError(
        f"cannot trace model {bundle.name!r}: torch.export failed{where} ({type(error).__name__}: {headline}). "
        f"Fix: {cause}, or pass a --model factory that returns its own example batch whose shapes trace; "
        "--granularity only changes how traced ops are grouped, not whether export succeeds."
    )


def _export(bundle: ModelBundle) -> GraphModule:
    wrapper = _LossWrapper(bundle.module, bundle.loss_fn)
    # On failure torch logs a warning and prints partial graphs to stderr; the TraceError says it better,
    # so that output is held back and replayed only when export succeeds.
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            program = torch.export.export(wrapper, tuple(bundle.inputs), {"labels": bundle.labels}, strict=False)
    except Exception as error:
        raise _export_error(error, bundle) from error
    finally:
        shapes_log.setLevel(level)
    sys.stderr.write(held.getvalue())
    return program.module()


def _rewrite_inplace(gm: GraphModule) -> None:
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
        if functional is None or not isinstance(mutated, Node) or mutated.op != "call_function" or _is_view(mutated):
            continue
        others = [u for u in mutated.users if u is not node]
        if any(_is_view(u) or order[u] > order[node] for u in others):
            continue
        node.target = functional
        changed = True
    if changed:
        gm.recompile()


# ----------------------------------------------------------------------------- grouping
@dataclass
class _Draft:
    key: Any
    kind: str  # "input" | "fwd" | "loss"
    path: str  # module path relative to the user's module
    nodes: list[Node] = field(default_factory=list)  # every node the group runs
    primary: list[Node] = field(default_factory=list)  # the ops that made the group (name it)


def _relative(path: str) -> str | None:
    """Path relative to the user's module, or None for ops outside it (the loss)."""
    if path == _MODEL_ATTR:
        return ""
    if path.startswith(_MODEL_ATTR + "."):
        return path[len(_MODEL_ATTR) + 1 :]
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


def _assign_groups(
    gm: GraphModule, user_inputs: list[Node], trainable_targets: set[str], granularity: str, block_depth: int
) -> tuple[list[_Draft], list[str], set[Node]]:
    """Drafts in graph order (input, model groups, loss), the module-path prefix dropped from names, attribute views.

    Attribute views (views of parameters, buffers or constants) own no memory and are replicated into
    every group that reads them, so they never become an edge between groups.
    """
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module") and not _is_guard(n)]
    paths: dict[Node, str] = {}
    previous = ""
    for node in calls:
        path = _module_path(node)
        paths[node] = previous if path is None else path
        previous = paths[node]
    prefix = _common_prefix([rel for n in calls if (rel := _relative(paths[n])) is not None])

    input_draft = _Draft(INPUT_NODE, "input", "")
    loss_draft = _Draft(LOSS_NODE, "loss", "")
    primaries: list[_Draft] = []
    group_of: dict[Node, _Draft] = dict.fromkeys(user_inputs, input_draft)
    anchored: set[Node] = set(user_inputs)
    anchored.update(n for n in gm.graph.nodes if n.op == "get_attr" and n.target in trainable_targets)
    attr_views: set[Node] = set()
    deferred: list[Node] = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in calls:
        if _op_name(node) not in _SHAPE_ONLY_OPS and any(a in anchored for a in node.all_input_nodes):
            anchored.add(node)
        rel = _relative(paths[node])
        if rel is None:
            group_of[node] = loss_draft
            continue
        if _is_view(node):
            base = node.args[0] if node.args and isinstance(node.args[0], Node) else None
            if base is not None and (base.op == "get_attr" or base in attr_views):
                attr_views.add(node)
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
        else:
            key = rel
        if not primaries or primaries[-1].key != key:
            primaries.append(_Draft(key, "fwd", rel))
        group_of[node] = primaries[-1]
        primaries[-1].primary.append(node)

    ordered = [input_draft, *primaries, loss_draft]
    position = {id(d): i for i, d in enumerate(ordered)}
    anchors = sorted(
        (order[n], position[id(d)]) for n, d in group_of.items() if n.op != "placeholder" and d is not input_draft
    )
    for node in reversed(deferred):
        users = [position[id(group_of[u])] for u in node.users if u in group_of]
        if users:
            owner = min(users)
        else:  # e.g. a running-statistics update: run it with the next op of the program
            later = [d for o, d in anchors if o > order[node]]
            earlier = [d for o, d in anchors if o < order[node]]
            owner = later[0] if later else (earlier[-1] if earlier else len(ordered) - 1)
        group_of[node] = ordered[owner]
    for node in calls:
        if node in group_of:
            group_of[node].nodes.append(node)
    for draft in ordered:
        needed: set[Node] = set()
        stack = [a for n in draft.nodes for a in n.all_input_nodes if a in attr_views]
        while stack:
            view = stack.pop()
            if view not in needed:
                needed.add(view)
                stack.extend(a for a in view.all_input_nodes if a in attr_views)
        draft.nodes = sorted([*draft.nodes, *needed], key=order.__getitem__)
    if not loss_draft.nodes:
        raise TraceError(
            "the loss_fn added no ops after the model output: return a scalar computed from output and labels"
        )
    return ordered, prefix, attr_views


def _draft_names(
    drafts: list[_Draft], prefix: list[str], module: nn.Module, granularity: str, block_depth: int
) -> list[str]:
    """Node names from module paths (made unique with ``#2``, ``#3``...)."""
    names: list[str] = []
    for draft in drafts:
        if draft.kind != "fwd":
            names.append(draft.key)
            continue
        display = ".".join(_display_parts(draft.path, prefix))
        first_op = _op_name(draft.primary[0])
        if granularity == "block":
            name = ".".join(display.split(".")[:block_depth]) if display else first_op
        elif granularity == "op":
            name = f"{display}.{first_op}" if display else first_op
        else:
            try:
                is_leaf = not any(True for _ in module.get_submodule(draft.path).children())
            except AttributeError:
                is_leaf = False
            name = display if (display and is_leaf) else (f"{display}.{first_op}" if display else first_op)
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


def _build_group_module(gm: GraphModule, group: NodeGroup) -> GraphModule:
    """A GraphModule running only ``group``'s nodes: placeholders are its inputs, it returns its outputs."""
    by_name = {n.name: n for n in gm.graph.nodes}
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for name in group.input_values:
        env[by_name[name]] = graph.placeholder(name)
    for name in group.fx_nodes:
        node = by_name[name]
        for arg in node.all_input_nodes:
            if arg not in env and arg.op == "get_attr":
                env[arg] = graph.node_copy(arg)
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[by_name[v]] for v in group.output_values))
    return GraphModule(gm, graph, class_name=f"Group{group.index}")


# ----------------------------------------------------------------------------- measurement
@dataclass
class _Facts:
    """What one forward pass tells about a group."""

    counted_flops: int = 0  # FLOPs the counter reported
    formula_flops: int = 0  # FLOPs from this module's formulas (ops the counter reports as 0)
    class_flops: dict[str, int] = field(default_factory=dict)
    first_class: str | None = None
    saved: list[torch.Tensor] = field(default_factory=list)


class _GroupRecorder(Interpreter):
    """Runs the traced program once on the example batch, recording per group its FLOPs and saved tensors."""

    def __init__(self, gm: GraphModule, group_index: dict[Node, int], num_groups: int, counter: FlopCounterMode):
        super().__init__(gm, garbage_collect_values=False)
        self.group_index = group_index
        self.counter = counter
        self.facts = [_Facts() for _ in range(num_groups)]
        self._current: int | None = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._current is not None:
            self.facts[self._current].saved.append(tensor)
        return tensor

    def run_node(self, n: Node) -> Any:
        self._current = self.group_index.get(n)
        before = self.counter.get_total_flops()
        try:
            result = super().run_node(n)
        except Exception as error:
            raise TraceError(
                f"running traced op {n.name} ({n.target}, module {_module_path(n) or 'top level'!r}) failed: {error}"
            ) from error
        if self._current is not None:
            counted = self.counter.get_total_flops() - before
            args, _ = self.fetch_args_kwargs_from_env(n)
            op_class, formula = _classify_op(_op_name(n), args, result)
            facts = self.facts[self._current]
            flops = counted if counted > 0 else formula
            if counted > 0:
                facts.counted_flops += counted
            else:
                facts.formula_flops += formula
            facts.class_flops[op_class] = facts.class_flops.get(op_class, 0) + flops
            if facts.first_class is None and op_class != "other":
                facts.first_class = op_class
        self._current = None
        return result


def _storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """Identifies a live tensor's storage; None for empty storages."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if storage.nbytes() == 0:
        return None
    return storage.data_ptr(), storage.nbytes()


def _dominant_class(facts: _Facts) -> str:
    if any(facts.class_flops.values()):
        top = max(facts.class_flops.values())
        return next(c for c in _CLASS_PRIORITY if facts.class_flops.get(c) == top)
    return facts.first_class or "other"


@dataclass
class _Backward:
    flops: int
    grad_bytes: int
    grad_inputs: tuple[str, ...]
    saved_groups: tuple[int, ...]


def _measure_backward(
    module: GraphModule,
    group: NodeGroup,
    values: dict[str, Any],
    producer: dict[str, int],
    attr_keys: set[tuple[int, int]],
    receiving: set[str] | None,
    formula_flops: int,
    *,
    pin_internals: bool = False,
) -> _Backward | None:
    """Re-run one group alone on detached inputs and differentiate it; None when it needs no gradient.

    ``receiving``: the output values a gradient flows back into (None: all, for the loss).
    ``pin_internals``: the group's internals are pinned, so only its saved outputs make the backward
    depend on the group's own node.
    """
    # An in-place op left on an activation (not a buffer update) must not hit a leaf: feed clones then.
    mutates = any(
        isinstance(n.target, torch._ops.OpOverload)
        and n.target._schema.is_mutable
        and not (n.args and isinstance(n.args[0], Node) and n.args[0].op == "get_attr")
        for n in module.graph.nodes
        if n.op == "call_function"
    )
    leaves: list[tuple[str, torch.Tensor]] = []
    fed: list[Any] = []
    key_to_value: dict[tuple[int, int], str] = {}
    for name in group.input_values:
        value = values[name]
        if isinstance(value, torch.Tensor):
            leaf = value.detach()
            if value.requires_grad:
                leaf.requires_grad_(True)
                leaves.append((name, leaf))
            feed = leaf.clone() if mutates else leaf  # an in-place op must not hit a leaf
            for tensor in (leaf, feed):
                key = _storage_key(tensor)
                if key is not None:
                    key_to_value[key] = name
            fed.append(feed)
        else:
            fed.append(value)
    params: list[torch.Tensor] = []
    for name in group.param_names:
        param = module.get_parameter(name)
        if param.requires_grad and not any(param is p for p in params):
            params.append(param)
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = module(*fed)
    differentiable = [
        t
        for name, output in zip(group.output_values, outputs, strict=True)
        if receiving is None or name in receiving
        for t in _tensors(output)
        if t.requires_grad
    ]
    if not differentiable or not (leaves or params):
        return None
    with FlopCounterMode(display=False) as counter:
        grads = torch.autograd.grad(
            differentiable,
            [leaf for _, leaf in leaves] + params,
            grad_outputs=[torch.ones_like(t) for t in differentiable],
            allow_unused=True,
        )
    input_grads = grads[: len(leaves)]
    output_keys = {k for output in outputs for t in _tensors(output) if (k := _storage_key(t)) is not None}
    saved_groups: list[int] = []
    for tensor in saved:
        key = _storage_key(tensor)
        if key is None or key in attr_keys:
            continue
        source = key_to_value.get(key)
        if source is not None and source not in producer:
            continue  # the labels: fixed bytes
        if source is None and pin_internals and key not in output_keys:
            continue  # a pinned internal: not part of the node
        owner = group.index if source is None else producer[source]
        if owner not in saved_groups:
            saved_groups.append(owner)
    return _Backward(
        flops=counter.get_total_flops() + 2 * formula_flops,
        grad_bytes=sum(g.numel() * g.element_size() for g in input_grads if g is not None),
        grad_inputs=tuple(name for (name, _), g in zip(leaves, input_grads, strict=True) if g is not None),
        saved_groups=tuple(saved_groups),
    )


# ----------------------------------------------------------------------------- entry point
def trace_model(bundle: ModelBundle, granularity: str = "layer", block_depth: int = 1) -> TracedModel:
    """Trace ``bundle`` (module, example batch, labels, loss) into a TrainingGraph and its runnable program.

    ``granularity``: "layer" (one node per leaf module call, plus top-level ops such as residual adds),
    "block" (module path cut to ``block_depth`` levels) or "op" (one node per non-view aten op).
    The module's buffers, train/eval modes and the global RNG are left as they were.
    """
    if granularity not in GRANULARITIES:
        raise TraceError(f"unknown granularity {granularity!r}; expected one of {GRANULARITIES}")
    if block_depth < 1:
        raise TraceError(f"block_depth must be at least 1, got {block_depth}")
    started = time.perf_counter()
    module = bundle.module
    modes = [(m, m.training) for m in module.modules()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    module.train()
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
    gm = _export(bundle)
    _rewrite_inplace(gm)
    # Export keeps ops whose results are unused (e.g. Hugging Face mask helpers): drop them.
    if gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or _is_guard(n)):
        gm.recompile()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(bundle.inputs) + 1:
        raise TraceError(
            f"model {bundle.name!r}: expected {len(bundle.inputs)} input placeholders and labels after export, "
            f"got {[p.name for p in placeholders]}"
        )
    user_inputs, label_node = placeholders[:-1], placeholders[-1]
    param_targets = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    trainable = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    drafts, prefix, attr_views = _assign_groups(gm, user_inputs, trainable, granularity, block_depth)
    names = _draft_names(drafts, prefix, bundle.module, granularity, block_depth)
    # Replicated attribute views are left unannotated: they belong to every group that reads them.
    group_index = {node: i for i, draft in enumerate(drafts) for node in draft.nodes if node not in attr_views}
    for node, index in group_index.items():
        node.meta[GROUP_META_KEY] = index
    for node in user_inputs:
        node.meta[GROUP_META_KEY] = 0

    # ---- one forward pass: FLOPs and saved tensors per group
    recorder = _GroupRecorder(gm, group_index, len(drafts), FlopCounterMode(display=False))
    with torch.enable_grad(), recorder.counter, torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        loss = recorder.run(*(x.detach() for x in bundle.inputs), bundle.labels.detach())
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TraceError(f"model {bundle.name!r}: loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if not loss.requires_grad:
        raise TraceError(f"model {bundle.name!r}: the loss does not depend on any trainable parameter")
    values = {node.name: value for node, value in recorder.env.items()}
    loss_node = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    loss_node = loss_node[0] if isinstance(loss_node, (tuple, list)) else loss_node

    # ---- group interfaces
    producer: dict[str, int] = {p.name: 0 for p in user_inputs}
    producer.update((node.name, index) for node, index in group_index.items())
    groups: list[NodeGroup] = []
    for index, (draft, name) in enumerate(zip(drafts, names, strict=True)):
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
            if n not in attr_views
            and any((u.op == "output") or (u in group_index and group_index[u] != index) for u in n.users)
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

    # ---- forward facts: FLOPs, class, output bytes
    attr_keys = {
        key
        for n in gm.graph.nodes
        if n.op == "get_attr"
        for t in _tensors(values.get(n.name))
        if (key := _storage_key(t))
    }
    for group, facts in zip(groups, recorder.facts, strict=True):
        group.flops = facts.counted_flops + facts.formula_flops
        group.op_class = "input" if group.index == 0 else ("loss" if group.kind == "loss" else _dominant_class(facts))
        excluded = set(attr_keys)
        if group.index != 0:
            excluded.update(k for v in group.input_values for t in _tensors(values[v]) if (k := _storage_key(t)))
        counted: set[tuple[int, int]] = set()
        totals = [0, 0]  # used outputs, saved internals
        for part, tensors in (
            (0, (t for v in group.output_values for t in _tensors(values[v]))),
            (1, iter(facts.saved)),
        ):
            for tensor in tensors:
                key = _storage_key(tensor)
                if key is None or key in excluded or key in counted:
                    continue
                counted.add(key)
                totals[part] += key[1]
        group.output_bytes = totals[0] + totals[1]
        group.saved_bytes = totals[1]
        if group.index != 0 and 0 < totals[1] <= PINNED_INTERNALS_MAX_FRACTION * totals[0]:
            group.pinned_bytes = totals[1]  # kept only if the group turns out to have a backward (below)

    # ---- backward facts: each group alone, last to first; a group needs a gradient only if one reaches it
    consumers: dict[str, list[int]] = {}
    for group in groups:
        for value in group.input_values:
            consumers.setdefault(value, []).append(group.index)
    backward: dict[int, _Backward] = {}
    upstream: dict[int, list[int]] = {}
    group_modules: dict[int, GraphModule] = {}
    for group in reversed(groups[1:]):
        receiving: set[str] | None = None
        if group.kind != "loss":
            edges = [
                (v, c)
                for v in group.output_values
                for c in consumers.get(v, [])
                if c in backward and v in backward[c].grad_inputs
            ]
            if not edges:
                continue
            receiving = {v for v, _ in edges}
            upstream[group.index] = sorted({c for _, c in edges}, reverse=True)
        group_modules[group.index] = _build_group_module(gm, group)
        measured = _measure_backward(
            group_modules[group.index],
            group,
            values,
            producer,
            attr_keys,
            receiving,
            recorder.facts[group.index].formula_flops,
            pin_internals=group.pinned_bytes > 0,
        )
        if measured is not None:
            backward[group.index] = measured
    for group in groups:  # pinned internals leave the node's bytes; without a backward nothing is saved
        if group.index in backward and group.pinned_bytes:
            group.output_bytes -= group.pinned_bytes
        else:
            group.pinned_bytes = 0

    # ---- the TrainingGraph
    builder = GraphBuilder(bundle.name)
    for group in groups:
        deps = (
            []
            if group.index == 0
            else list(dict.fromkeys(groups[producer[v]].name for v in group.input_values if v in producer))
        )
        builder.add(group.name, group.kind, group.output_bytes, group.flops, deps, group.op_class)
    for group in reversed(groups[1:]):
        measured = backward.get(group.index)
        if measured is None:
            continue
        deps = [f"bwd:{groups[c].name}" for c in upstream.get(group.index, [])]
        deps += [groups[g].name for g in measured.saved_groups]
        group.bwd_index = builder.add(
            f"bwd:{group.name}", "bwd", measured.grad_bytes, measured.flops, deps, group.op_class, forward_of=group.name
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
        optimizer_state_bytes=0,
        other_fixed_bytes=buffer_bytes + frozen_bytes + bundle.labels.numel() * bundle.labels.element_size()
        + sum(group.pinned_bytes for group in groups),
    )
    batch_size = int(bundle.inputs[0].shape[0]) if bundle.inputs and bundle.inputs[0].dim() > 0 else None
    graph.meta.update({"source": "trace", "granularity": granularity, "batch_size": batch_size, "model": bundle.name})
    if granularity == "block":
        graph.meta["block_depth"] = block_depth
    return TracedModel(
        graph=graph,
        graph_module=gm,
        groups=groups,
        input_names=tuple(p.name for p in user_inputs),
        label_name=label_node.name,
        loss_value=loss_node.name,
        granularity=granularity,
        trace_seconds=time.perf_counter() - started,
        value_producer=producer,
        _group_modules=group_modules,
    )
