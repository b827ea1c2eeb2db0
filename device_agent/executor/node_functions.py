"""A node's forward and backward as two plain aten programs, taken from its joint forward-backward graph.

The way ExecuTorch captures training: AOTAutograd traces the node's program together with the backward
autograd would run (the same derivative formulas, so the same aten kernels), and a partitioner cuts the
joint graph in two:

- ``forward(*params, *buffers, *constants, *inputs) -> (*outputs, *new_buffers, *saved)``: the node's outputs, the new
  values of the buffers it updates (BatchNorm statistics, returned instead of written in place), and the
  tensors its backward reads;
- ``backward(*saved, *output_grads) -> grads``: one gradient per forward argument (None where there is none),
  for the outputs that carry a gradient (``differentiable_outputs``).

Both run without autograd: no graph is built, no saved-tensor hooks fire, and the executor holds every saved
tensor itself (in the node's RAM entry, or read from the entry that produced it). Buffer updates are applied
by the caller, and not on a recompute. Capturing runs the node once on real tensors (forward and backward) on
detached copies, with the global RNG state put back afterwards, so capture changes nothing the step computes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule

from device_agent.executor.aten_calls import compile_graph
from device_agent.executor.errors import ExecutorError
from device_agent.executor.in_place import write_over_dead_gradients
from device_agent.executor.inductor import InductorFunction
from device_agent.executor.partition import NodeProgram
from device_agent.executor.split import draws_random

__all__ = ["NodeFunctions", "NodeCaptureError", "capture_node_functions"]


class NodeCaptureError(ExecutorError):
    """AOTAutograd could not split a node's program into forward and backward functions."""


@dataclass(frozen=True)
class NodeFunctions:
    """One fwd/loss node as explicit functions (see the module docstring for their signatures)."""

    forward: GraphModule
    backward: GraphModule | None  # None when no output carries a gradient
    params: tuple[torch.Tensor, ...]  # the forward's first arguments, in order: the program's parameters ...
    buffers: tuple[torch.Tensor, ...]  # ... then the buffers it updates (their new values are returned) ...
    constants: tuple[torch.Tensor, ...]  # ... then every other tensor it reads (frozen weights, constants)
    output_count: int
    differentiable_outputs: tuple[int, ...]  # output positions whose gradient the backward takes, in order
    saved_count: int
    gradient_strides: tuple[tuple[int, ...], ...] = ()  # the layout the backward was traced with, per gradient
    # saved position -> buffer index: a saved tensor that is a BatchNorm's updated running statistic, which its
    # training-mode backward receives but never reads. The buffer itself is passed instead (as eager autograd
    # saves it), so the copy the forward returned is not held until the backward.
    saved_buffers: dict[int, int] = field(default_factory=dict)
    # ``forward`` and ``backward`` as plain functions calling torch's bindings of the same op overloads (see
    # device_agent.executor.aten_calls): what the step runs; the GraphModules stay the exportable record
    call_forward: Callable = field(init=False, repr=False, compare=False)
    call_backward: Callable | None = field(init=False, repr=False, compare=False)
    # ``call_backward`` taking one list of its arguments, which it empties: each argument the caller holds nowhere
    # else is freed at its last use (the lowered step's call; see device_agent.executor.aten_calls.compile_graph)
    call_backward_boxed: Callable | None = field(init=False, repr=False, compare=False)
    # inductor: both functions run inductor's fused kernels instead, compiled at their first call (``poet train
    # --compile``, not bitwise eager: see device_agent.executor.inductor); ``log`` hears of a graph it cannot compile
    inductor: bool = field(default=False, compare=False)
    name: str = field(default="node", compare=False)
    log: Callable[[str], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        forward = compile_graph(self.forward, "node_forward")
        backward = boxed = None
        if self.inductor:
            forward = InductorFunction(self.forward, forward, f"{self.name!r}'s forward", self.log)
            if self.backward is not None:
                backward = InductorFunction(self.backward, compile_graph(self.backward, "node_backward"),
                                            f"{self.name!r}'s backward", self.log)
                boxed = _unboxing(backward)
        elif self.backward is not None:  # compiled once, boxed; called unboxed through a list
            boxed = compile_graph(self.backward, "node_backward", boxed=True)
            backward = _boxing(boxed)
        object.__setattr__(self, "call_forward", forward)
        object.__setattr__(self, "call_backward", backward)
        object.__setattr__(self, "call_backward_boxed", boxed)

    @property
    def arguments(self) -> tuple[torch.Tensor, ...]:
        """The forward's leading arguments (before the node's inputs)."""
        return (*self.params, *self.buffers, *self.constants)


def _boxing(boxed: Callable) -> Callable:
    """A boxed function called with positional arguments (they live until it returns, held by the caller)."""
    def unboxed(*args):
        return boxed(list(args))
    return unboxed


def _unboxing(function: Callable) -> Callable:
    """``function`` called with one list of its arguments, which is emptied (the arguments live until it returns)."""
    def boxed(args: list):
        arguments = tuple(args)
        args.clear()
        return function(*arguments)
    return boxed


def capture_node_functions(program: NodeProgram, inputs: Sequence[torch.Tensor],
                           receiving: Collection[str] | None = None, *, inductor: bool = False,
                           log: Callable[[str], None] | None = None) -> NodeFunctions:
    """Trace ``program`` on ``inputs`` (the tensors it is about to be fed) into forward and backward functions.

    ``receiving``: the outputs a gradient flows back into (a consumer's backward sends one, or the loss); the
    others leave the backward as autograd leaves them, not as zero gradients (None: every output).
    ``inductor``: the functions run inductor's kernels (see NodeFunctions); ``log`` hears of a graph it cannot
    compile."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import default_partition

    module = program.run
    lifted, targets = _lift_attributes(module)
    values = {target: _get_attr(module, target) for target in targets}
    written = _written_attributes(module)
    param_targets = tuple(t for t in targets if isinstance(values[t], torch.nn.Parameter) and values[t].requires_grad
                          and t not in written)
    buffer_targets = tuple(t for t in targets if t in written)  # updated in place: their new values are returned
    constant_targets = tuple(t for t in targets if t not in param_targets and t not in buffer_targets)
    params = tuple(values[t] for t in param_targets)
    buffers = tuple(values[t] for t in buffer_targets)
    constants = tuple(values[t] for t in constant_targets)
    position = {t: i for i, t in enumerate((*param_targets, *buffer_targets, *constant_targets))}
    order = [position[t] for t in targets]
    output_count = len(program.output_values)
    mutates_inputs = program.mutates_inputs
    detached = frozenset(i for i, name in enumerate(program.output_values)
                         if receiving is not None and name not in receiving)

    def joint(param_values, buffer_values, constant_values, *input_values):
        # fresh buffers and (for in-place programs) inputs: their updates are outputs, not input mutations
        buffer_values = [b.clone() for b in buffer_values]
        if mutates_inputs:
            input_values = tuple(x.clone() for x in input_values)
        attributes = (*param_values, *buffer_values, *constant_values)
        outputs = lifted(*(attributes[i] for i in order), *input_values)
        outputs = tuple(out.detach() if i in detached else out for i, out in enumerate(outputs))
        return (*outputs, *buffer_values)

    graphs: dict[str, GraphModule] = {}

    def keep(kind: str):
        def compiler(gm: GraphModule, example_inputs) -> GraphModule:
            graphs[kind] = gm
            return gm
        return compiler

    grad_inputs = set(program.grad_input_values)
    example = [x.detach().requires_grad_(name in grad_inputs and x.is_floating_point())
               for name, x in zip(program.input_values, inputs, strict=True)]
    example_params = [p.detach().requires_grad_(True) for p in params]
    example_buffers = [b.detach() for b in buffers]
    example_constants = [c.detach() for c in constants]
    rng = torch.get_rng_state()
    try:
        with warnings.catch_warnings(), torch.enable_grad():
            warnings.simplefilter("ignore")  # AOTAutograd asks for boxed compilers; these run unboxed
            traced = aot_function(joint, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                  partition_fn=default_partition)
            outputs = traced(example_params, example_buffers, example_constants, *example)
            differentiable = tuple(i for i, out in enumerate(outputs[:output_count]) if out.requires_grad)
            if differentiable:
                torch.autograd.backward([outputs[i] for i in differentiable],
                                        [torch.ones_like(outputs[i]) for i in differentiable])
    except Exception as error:  # noqa: BLE001 - any tracing failure is reported with the node's name
        raise NodeCaptureError(f"cannot split {program.name!r} into forward and backward functions: "
                               f"{type(error).__name__}: {error}") from error
    finally:
        torch.set_rng_state(rng)
    forward = graphs["forward"]
    backward = graphs.get("backward") if differentiable else None
    if backward is not None:
        _drop_dead_ops(backward)
        if not inductor:  # inductor plans its own buffers (and fuses a cross-entropy's backward into one kernel)
            write_over_dead_gradients(backward)
    if backward is not None and draws_random(backward):
        # the partitioner moved a random op into the backward: it would draw again, not replay the forward's mask
        raise NodeCaptureError(f"{program.name!r}: the split puts a random op in the backward, which would draw "
                               "new random numbers")
    returned = _output_count(forward)
    saved_count = returned - output_count - len(buffers)
    if backward is not None:
        expected = _placeholder_count(backward) - len(differentiable)
        if expected != saved_count:
            raise NodeCaptureError(
                f"{program.name!r}: the forward returns {returned} values but the backward reads {expected} saved "
                f"tensors besides {len(differentiable)} gradients (an input mutation AOTAutograd kept outside?)")
    strides = ()
    if backward is not None:
        placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"][saved_count:]
        strides = tuple(tuple(n.meta["val"].stride()) for n in placeholders)
    saved_buffers = _saved_running_statistics(forward, backward, output_count, len(buffers)) if backward else {}
    return NodeFunctions(forward, backward, params, buffers, constants, output_count, differentiable,
                         saved_count if backward is not None else 0, strides, saved_buffers,
                         inductor=inductor, name=program.name, log=log)


def _saved_running_statistics(forward: GraphModule, backward: GraphModule, output_count: int,
                              buffer_count: int) -> dict[int, int]:
    """Saved positions that are updated buffers read only as the unused running statistics of a training-mode
    batch-norm backward, with the buffer each one is (see ``NodeFunctions.saved_buffers``)."""
    (output,) = (n for n in forward.graph.nodes if n.op == "output")
    returned = output.args[0]
    new_buffers = {node: i for i, node in enumerate(returned[output_count:output_count + buffer_count])}
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    found: dict[int, int] = {}
    for k, node in enumerate(returned[output_count + buffer_count:]):
        if node not in new_buffers or k >= len(placeholders):
            continue
        users = placeholders[k].users
        if users and all(_ignores_running_statistics(user, placeholders[k]) for user in users):
            found[k] = new_buffers[node]
    return found


def _ignores_running_statistics(user: torch.fx.Node, value: torch.fx.Node) -> bool:
    if user.target is not torch.ops.aten.native_batch_norm_backward.default:
        return False
    args = user.args
    training = len(args) > 7 and args[7] is True
    return training and all(a is not value for i, a in enumerate(args) if i not in (3, 4))


def _drop_dead_ops(module: GraphModule) -> None:
    """Remove the ops whose results nothing reads. The partitioner may leave a forward chain recomputed in the
    backward for nothing (hf_bert's attention: bmm, softmax and a dropout whose mask is never read); fx keeps
    the dropout as impure, and it would draw random numbers eager's backward never draws. Ops that write to an
    argument are kept."""
    removed = False
    for node in reversed(list(module.graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and any(
                a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments):
            continue
        module.graph.erase_node(node)
        removed = True
    if removed:
        module.recompile()


def _lift_attributes(module: GraphModule) -> tuple[GraphModule, list[str]]:
    """``module`` as a pure function: each tensor attribute it reads becomes a leading placeholder (in the
    returned order), so tracing sees every tensor as an argument."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    targets: list[str] = []
    for node in module.graph.nodes:
        if node.op == "get_attr" and node.target not in targets:
            targets.append(node.target)
    by_target = {target: graph.placeholder(f"attr_{i}") for i, target in enumerate(targets)}
    for node in module.graph.nodes:
        if node.op == "get_attr":
            env[node] = by_target[node.target]
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return GraphModule(torch.nn.Module(), graph), targets


def _get_attr(module: torch.nn.Module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _written_attributes(module: GraphModule) -> set[str]:
    """Targets of the module's get_attr nodes that an op writes in place (directly or through a view)."""
    aliases: dict[torch.fx.Node, str] = {n: n.target for n in module.graph.nodes if n.op == "get_attr"}
    written: set[str] = set()
    for node in module.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        for argument, value in zip(schema.arguments, node.args, strict=False):
            info = argument.alias_info
            if info is not None and info.is_write and value in aliases:
                written.add(aliases[value])
        statistics = _RUNNING_STATISTICS.get(node.target)
        if statistics is not None and node.args[statistics[0]]:  # in training: the running statistics move
            written.update(aliases[node.args[i]] for i in statistics[1:] if node.args[i] in aliases)
        returns = schema.returns
        if returns and returns[0].alias_info is not None and node.args and node.args[0] in aliases:
            aliases[node] = aliases[node.args[0]]  # a view of an attribute
    return written


# Composite norms whose schema does not mark the running statistics they update: op -> (position of the
# training / use_input_stats flag, positions of running_mean and running_var)
_RUNNING_STATISTICS = {
    torch.ops.aten.batch_norm.default: (5, 3, 4),
    torch.ops.aten.instance_norm.default: (5, 3, 4),
}


def _output_count(gm: GraphModule) -> int:
    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    return len(output.args[0])


def _placeholder_count(gm: GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "placeholder")

