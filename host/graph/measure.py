"""Measurement passes: per group the FLOPs, the bytes it holds for backward, and what its backward needs.

1. One :class:`torch.fx.Interpreter` pass (:class:`GroupRecorder`) on the example batch records per group the
   forward FLOPs and the tensors autograd saves (``saved_tensors_hooks``); output bytes follow from storages.
2. Each group is re-run alone (inputs detached) and differentiated under ``FlopCounterMode``
   (:func:`measure_backward`): backward FLOPs, which forward outputs its backward needs, and which inputs
   receive a gradient; and, from torch's allocator events (:class:`AllocationTimeline`), the workspace of
   its forward and its backward: the temporaries each holds for a moment.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from bisect import bisect_left, bisect_right
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.utils.flop_counter import FlopCounterMode

from device_agent.executor.in_place import InPlaceBackward
from device_agent.executor.ram_store import storage_key
from host.graph.export import TraceError
from host.graph.flops import flop_counter
from host.graph.grouping import build_group_module, module_path
from host.graph.groups import BackwardMeasure, ForwardMeasure, GroupInterface
from host.graph.op_tables import CLASS_PRIORITY, classify_op, op_name, tensors

__all__ = [
    "PINNED_INTERNALS_MAX_FRACTION", "Backwards", "Facts", "ForwardRun", "GroupRecorder", "attribute_keys",
    "dominant_class", "measure_backward", "measure_backwards", "measure_forward", "pinned_internals_bytes",
    "record_forward",
]  # fmt: skip

# Internals are the tensors a group's backward saves that are not its outputs. When they are at most this
# fraction of the outputs (BatchNorm's and LayerNorm's mean and 1/std), they are pinned: held from the run
# whose graph the backward uses until that backward, outside the schedule, and charged to the fixed bytes.
# The node's schedulable bytes are then its outputs alone, and its backward depends on its own forward node
# only if it reads those outputs, so (for example) a BatchNorm output can be freed once the ReLU after it has
# run, as autograd frees it. Larger internals (dropout masks, a block's intermediates) stay in the node.
PINNED_INTERNALS_MAX_FRACTION = 1 / 8


@dataclass
class Facts:
    """What one forward pass tells about a group."""

    counted_flops: int = 0  # FLOPs the counter reported
    formula_flops: int = 0  # FLOPs from the op_tables formulas (ops the counter reports as 0)
    class_flops: dict[str, int] = field(default_factory=dict)
    first_class: str | None = None
    saved: list[torch.Tensor] = field(default_factory=list)


class GroupRecorder(Interpreter):
    """Runs the traced program once on the example batch, recording per group its FLOPs and saved tensors."""

    def __init__(self, gm: GraphModule, group_index: dict[Node, int], num_groups: int, counter: FlopCounterMode):
        super().__init__(gm, garbage_collect_values=False)
        self.group_index = group_index
        self.counter = counter
        self.facts = [Facts() for _ in range(num_groups)]
        self._current: int | None = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._current is not None:
            self.facts[self._current].saved.append(tensor)
        # Not the tensor itself: an output saved by its own node would hold its node, which holds it, a cycle
        # through C++ that Python's collector cannot see. Nothing runs this graph's backward.
        return tensor.detach()

    def run_node(self, n: Node) -> Any:
        self._current = self.group_index.get(n)
        before = self.counter.get_total_flops()
        try:
            result = super().run_node(n)
        except Exception as error:
            raise TraceError(
                f"running traced op {n.name} ({n.target}, module {module_path(n) or 'top level'!r}) failed: {error}"
            ) from error
        if self._current is not None:
            counted = self.counter.get_total_flops() - before
            args, _ = self.fetch_args_kwargs_from_env(n)
            op_class, formula = classify_op(op_name(n), args, result)
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


class AllocationTimeline:
    """Every allocation and free of torch's CPU allocator while active (torch.profiler's memory events), and
    named regions of it: what a region held at its peak beyond what it kept at its end is its workspace.

    These events see inside kernels: a convolution's backward allocates twice its input's bytes of buffers
    it frees before returning, which neither the outputs nor the ops' own tensors show.
    """

    _PREFIX = "poet.workspace:"
    _ONE_AT_A_TIME = threading.Lock()  # the profiler is one per process: traces on other threads wait

    def __init__(self) -> None:
        self._profiler = None
        self._ranges: dict[str, tuple[int, int]] = {}
        self._times_ns: list[int] = []
        self._deltas: list[int] = []

    def __enter__(self) -> AllocationTimeline:
        from torch.profiler import ProfilerActivity, profile

        self._ONE_AT_A_TIME.acquire()
        if torch.autograd._profiler_enabled():  # the caller's: a second session would end it and lose its events
            self._ONE_AT_A_TIME.release()
            warnings.warn("workspaces not measured: torch.profiler is already running, and a second session would "
                          "end it; every node's workspace is taken as 0 bytes, so RAM peaks inside kernels are not "
                          "counted. Trace outside torch.profiler to measure them.", RuntimeWarning, stacklevel=2)
            return self
        profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        try:
            with _quiet_stderr():  # the profiler's library announces its start on stderr
                profiler.__enter__()
        except BaseException:
            self._ONE_AT_A_TIME.release()
            raise
        self._profiler = profiler
        return self

    def __exit__(self, *exc) -> None:
        if self._profiler is None:
            return
        try:
            with _quiet_stderr():
                self._profiler.__exit__(*exc)
        finally:
            self._ONE_AT_A_TIME.release()
        if exc[0] is not None:
            self._profiler = None
            return
        events = self._profiler.profiler.kineto_results.events()
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        self._times_ns = [t for t, _ in memory]
        self._deltas = [b for _, b in memory]
        self._ranges = {e.name()[len(self._PREFIX):]: (e.start_ns(), e.end_ns())
                        for e in events if e.name().startswith(self._PREFIX)}
        self._profiler = None

    def region(self, name: str):
        """A context that marks a region (allocations made within it are its own)."""
        return torch.profiler.record_function(self._PREFIX + name)

    def workspace_bytes(self, name: str) -> int:
        """Bytes ``name`` held at its peak beyond what it still held at its end (0 for an unknown region).

        A free of memory allocated before the region counts against it: regions that free what they did not
        allocate (autograd releasing saved tensors) must keep it (``retain_graph=True``)."""
        peak, held = self._peak_and_end_bytes(name)
        return max(0, peak - held)

    def peak_bytes(self, name: str) -> int:
        """Bytes ``name`` held at its peak beyond what was allocated when it began (0 for an unknown region). As for
        :meth:`workspace_bytes`, a free of memory allocated before the region lowers what it holds."""
        return self._peak_and_end_bytes(name)[0]

    def _peak_and_end_bytes(self, name: str) -> tuple[int, int]:
        if name not in self._ranges:
            return 0, 0
        start_ns, end_ns = self._ranges[name]
        held = peak = 0
        for delta in self._deltas[bisect_left(self._times_ns, start_ns):bisect_right(self._times_ns, end_ns)]:
            held += delta
            peak = max(peak, held)
        return peak, held


@contextmanager
def _quiet_stderr():
    """File descriptor 2 sent to /dev/null for the duration (the profiler's C++ library writes there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def dominant_class(facts: Facts) -> str:
    if any(facts.class_flops.values()):
        top = max(facts.class_flops.values())
        return next(c for c in CLASS_PRIORITY if facts.class_flops.get(c) == top)
    return facts.first_class or "other"


def measure_backward(
    module: GraphModule,
    group: GroupInterface,
    values: dict[str, Any],
    producer: dict[str, int],
    attr_keys: set[tuple[int, int]],
    receiving: set[str] | None,
    formula_flops: int,
    *,
    pin_internals: bool = False,
    region=lambda name: nullcontext(),
) -> BackwardMeasure | None:
    """Re-run one group alone on detached inputs and differentiate it; None when it needs no gradient.

    ``receiving``: the output values a gradient flows back into (None: all, for the loss).
    ``pin_internals``: the group's internals are pinned, so only its saved outputs make the backward
    depend on the group's own node. ``region(name)`` marks the forward (``fwd:<index>``) and the backward
    (``bwd:<index>``) for an :class:`AllocationTimeline`.
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
                key = storage_key(tensor)
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
    saved_keys: list[tuple[int, int] | None] = []  # keys, not tensors: a hook holding them would be a cycle

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved_keys.append(storage_key(tensor))  # the graph keeps the storage alive while the key is used
        return tensor.detach()  # not the tensor itself: see GroupRecorder.pack

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            region(f"fwd:{group.index}"):
        outputs = module(*fed)
    differentiable = [
        t
        for name, output in zip(group.output_values, outputs, strict=True)
        if receiving is None or name in receiving
        for t in tensors(output)
        if t.requires_grad
    ]
    if not differentiable or not (leaves or params):
        return None
    grad_outputs = [torch.ones_like(t) for t in differentiable]
    # eager autograd writing over dead gradients as the executor's backward functions do (its accounting)
    with flop_counter() as counter, region(f"bwd:{group.index}"), InPlaceBackward():
        grads = torch.autograd.grad(
            differentiable,
            [leaf for _, leaf in leaves] + params,
            grad_outputs=grad_outputs,
            allow_unused=True,
            retain_graph=True,  # the executor frees saved tensors after the backward, not within it
        )
    input_grads = grads[: len(leaves)]
    output_keys = {k for output in outputs for t in tensors(output) if (k := storage_key(t)) is not None}
    saved_groups: list[int] = []
    for key in saved_keys:
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
    return BackwardMeasure(
        flops=counter.get_total_flops() + 2 * formula_flops,
        # Storages, as the executor holds them: a stack/cat backward returns views of one gradient storage.
        grad_bytes=sum(k[1] for k in {storage_key(g) for g in input_grads if g is not None} if k is not None),
        grad_inputs=tuple(name for (name, _), g in zip(leaves, input_grads, strict=True) if g is not None),
        saved_groups=tuple(saved_groups),
    )


# ----------------------------------------------------------------------------- the forward pass
@dataclass
class ForwardRun:
    """The traced program run once on the example batch."""

    loss: Any
    values: dict[str, Any]  # fx value name -> its value (every node's, kept alive for the passes that follow)
    facts: list[Facts]  # per group


def record_forward(
    gm: GraphModule,
    group_index: dict[Node, int],
    num_groups: int,
    inputs: tuple[torch.Tensor, ...],
    labels: torch.Tensor,
) -> ForwardRun:
    """Run ``gm`` on detached ``inputs`` and ``labels`` with a GroupRecorder: FLOPs and saved tensors per group."""
    recorder = GroupRecorder(gm, group_index, num_groups, flop_counter())
    with torch.enable_grad(), recorder.counter, torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        loss = recorder.run(*(x.detach() for x in inputs), labels.detach())
    run = ForwardRun(loss, {node.name: value for node, value in recorder.env.items()}, recorder.facts)
    # The autograd graph keeps the pack hook, so the recorder lives as long as any value's graph does, and the
    # recorder holds every value: a cycle through C++ that Python's collector cannot see. Without this, the
    # whole forward's activations outlived the trace (155 MB of resnet18_cifar's at batch 64).
    recorder.env, recorder.facts = {}, []
    return run


def attribute_keys(gm: GraphModule, values: dict[str, Any]) -> set[tuple[int, int]]:
    """Storages of parameters, buffers and constants: fixed bytes, never a group's."""
    return {
        key
        for n in gm.graph.nodes
        if n.op == "get_attr"
        for t in tensors(values.get(n.name))
        if (key := storage_key(t))
    }


def measure_forward(
    groups: list[GroupInterface], facts: list[Facts], values: dict[str, Any], attr_keys: set[tuple[int, int]]
) -> list[ForwardMeasure]:
    """Each group's FLOPs, op class and bytes: its used outputs and the internals autograd saves in it.

    Whether small internals are pinned is settled once backward is known (:func:`pinned_internals_bytes`).
    """
    measures: list[ForwardMeasure] = []
    for group, group_facts in zip(groups, facts, strict=True):
        # An output that is an input's storage (dropout with p=0 returns its input) counts here too: the
        # input's node may be freed while this output lives on, and the storage with it. Saved inputs do not.
        inputs = set() if group.index == 0 else {
            k for v in group.input_values for t in tensors(values[v]) if (k := storage_key(t))
        }
        counted: set[tuple[int, int]] = set()
        totals = [0, 0]  # used outputs, saved internals
        for part, found, excluded in (
            (0, (t for v in group.output_values for t in tensors(values[v])), attr_keys),
            (1, iter(group_facts.saved), attr_keys | inputs),
        ):
            for tensor in found:
                key = storage_key(tensor)
                if key is None or key in excluded or key in counted:
                    continue
                counted.add(key)
                totals[part] += key[1]
        measures.append(ForwardMeasure(
            flops=group_facts.counted_flops + group_facts.formula_flops,
            op_class="input" if group.index == 0 else ("loss" if group.kind == "loss" else dominant_class(group_facts)),
            outputs_bytes=totals[0],
            saved_bytes=totals[1],
            pinnable=group.index != 0 and 0 < totals[1] <= PINNED_INTERNALS_MAX_FRACTION * totals[0],
        ))
    return measures


# ----------------------------------------------------------------------------- the backward passes
@dataclass
class Backwards:
    """Every group's backward, measured from the loss back."""

    by_group: dict[int, BackwardMeasure]  # group index -> its backward (absent: no gradient reaches the group)
    upstream: dict[int, list[int]]  # group index -> groups whose backward sends it a gradient, latest first
    group_modules: dict[int, GraphModule]  # the standalone group modules built on the way


def measure_backwards(
    gm: GraphModule,
    groups: list[GroupInterface],
    forward: list[ForwardMeasure],
    values: dict[str, Any],
    producer: dict[str, int],
    attr_keys: set[tuple[int, int]],
    facts: list[Facts],
) -> Backwards:
    """Each group alone, last to first; a group needs a gradient only if one reaches it."""
    consumers: dict[str, list[int]] = {}
    for group in groups:
        for value in group.input_values:
            consumers.setdefault(value, []).append(group.index)
    backward: dict[int, BackwardMeasure] = {}
    upstream: dict[int, list[int]] = {}
    group_modules: dict[int, GraphModule] = {}
    timeline = AllocationTimeline()
    with timeline:
        _measure_each(gm, groups, forward, values, producer, attr_keys, facts, consumers, backward, upstream,
                      group_modules, timeline.region)
    for index, measured in backward.items():  # each pass's workspace, from the allocator's own events
        backward[index] = replace(measured, forward_workspace_bytes=timeline.workspace_bytes(f"fwd:{index}"),
                                  workspace_bytes=measured.workspace_bytes + timeline.workspace_bytes(f"bwd:{index}"))
    return Backwards(backward, upstream, group_modules)


def _measure_each(gm, groups, forward, values, producer, attr_keys, facts, consumers, backward, upstream,
                  group_modules, region) -> None:
    """The loop of :func:`measure_backwards`: fills ``backward``, ``upstream`` and ``group_modules``."""
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
            summing = _gradient_sum_bytes(edges, values)
        else:
            summing = 0
        group_modules[group.index] = build_group_module(gm, group)
        measured = measure_backward(
            group_modules[group.index],
            group,
            values,
            producer,
            attr_keys,
            receiving,
            facts[group.index].formula_flops,
            pin_internals=forward[group.index].pinnable,
            region=region,
        )
        if measured is not None:
            backward[group.index] = replace(measured, workspace_bytes=summing)


def _gradient_sum_bytes(edges: list[tuple[str, int]], values: dict[str, Any]) -> int:
    """The temporaries of summing an output's gradients from several consumers before its backward runs: one
    sum for two senders, two at once (the running sum and the next) for more."""
    senders: dict[str, int] = {}
    for value, _ in edges:
        senders[value] = senders.get(value, 0) + 1
    return sum(min(count - 1, 2) * sum(t.numel() * t.element_size() for t in tensors(values[value]))
               for value, count in senders.items() if count > 1)


def pinned_internals_bytes(forward: list[ForwardMeasure], backward: dict[int, BackwardMeasure]) -> list[int]:
    """Per group, the internals held outside the schedule: small ones of a group with a backward (without a
    backward nothing is saved, so nothing is pinned)."""
    return [m.saved_bytes if m.pinnable and index in backward else 0 for index, m in enumerate(forward)]
