"""The groups of a traced program: what each fwd/loss node runs, and what was measured of it.

The trace's passes share these types and import them from here, one way: :mod:`host.graph.grouping` makes the
:class:`GroupInterface` of every group, :mod:`host.graph.measure` returns a :class:`ForwardMeasure` and a
:class:`BackwardMeasure` per group (torch.fx style: each pass returns what it found; nothing is mutated), and
:mod:`host.graph.trace` assembles them, with the TrainingGraph's indices, into a :class:`NodeGroup`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BackwardMeasure", "ForwardMeasure", "GroupInterface", "NodeGroup"]


@dataclass(frozen=True)
class GroupInterface:
    """The fx nodes behind one fwd/loss node, and what an executor needs to run them on their own.

    Value names are fx node names of the traced program; ``param_names`` and ``buffer_names`` are its
    attribute targets (prefixed ``model.``, the wrapper's attribute). ``fx_nodes`` may repeat a shared view
    (of a parameter, buffer or batch input) that another group also runs.
    """

    index: int  # TrainingGraph index of the fwd/loss node (0: the input)
    name: str
    kind: str  # "fwd" | "loss"
    module_path: str  # path in the user's module ("" for the input, the loss and top-level ops)
    fx_nodes: tuple[str, ...]  # call nodes run by this group, in program order
    input_values: tuple[str, ...]  # values read from other groups or graph placeholders
    output_values: tuple[str, ...]  # values read by later groups or returned by the graph
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]  # buffers and lifted tensor constants


@dataclass(frozen=True)
class ForwardMeasure:
    """One group's forward, measured on the example batch."""

    flops: int
    op_class: str
    outputs_bytes: int  # storages of its used outputs (an output on its input's storage included)
    saved_bytes: int  # tensors autograd saves that were created here and are not outputs ("internals")
    pinnable: bool  # internals small enough to be held outside the schedule, if the group has a backward


@dataclass(frozen=True)
class BackwardMeasure:
    """One group re-run alone and differentiated."""

    flops: int
    grad_bytes: int  # storages of the gradients it returns for its inputs
    grad_inputs: tuple[str, ...]  # inputs that receive a gradient
    saved_groups: tuple[int, ...]  # groups whose outputs its backward reads
    # Temporaries beyond what each pass keeps (the bytes of storages it made, at their peak, less those alive
    # at its end): held only while the group's forward, or its backward, runs.
    forward_workspace_bytes: int = 0
    workspace_bytes: int = 0


@dataclass(frozen=True)
class NodeGroup(GroupInterface):
    """A group with its measurements and TrainingGraph indices: what the executor's partition is cut from.

    Running a group again (recomputation) re-applies its buffer updates, e.g. BatchNorm running statistics.
    """

    op_class: str = "other"
    flops: int = 0
    output_bytes: int = 0  # the node's bytes: used outputs + internals created here (unless pinned)
    saved_bytes: int = 0  # internals: tensors autograd saves that were created here and are not outputs
    pinned_bytes: int = 0  # internals held outside the schedule, as fixed bytes (PINNED_INTERNALS_MAX_FRACTION)
    bwd_index: int | None = None  # TrainingGraph index of bwd:<name>, None when no gradient is needed
    bwd_flops: int = 0
    bwd_output_bytes: int = 0
    grad_input_values: tuple[str, ...] = ()  # inputs that receive a gradient from this group's backward
    bwd_saved_from: tuple[str, ...] = ()  # fwd nodes whose outputs this group's backward reads
