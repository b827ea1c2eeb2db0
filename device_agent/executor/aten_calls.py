"""An fx graph of aten ops as a plain Python function that calls each op through torch's own Python binding.

A node function's graph calls ``torch.ops.aten.<op>.<overload>``: an ``OpOverload``, whose ``__call__`` matches the
Python arguments against the op's schema on every call. Eager PyTorch calls the same ops through the generated
bindings (``torch.mm``, ``Tensor.view``), which parse arguments several times faster: measured on this machine,
``aten.addmm.default`` 7.8 us against ``torch.addmm`` 4.8 us, ``aten.view.default`` 5.4 us against
``Tensor.view`` 2.8 us. A small model's step runs dozens of such ops, so this is most of what a lowered step costs
beyond eager.

Exactness: a binding is used for an op only when calling it, on meta tensors shaped like the graph's values,
reaches exactly that op overload (checked once per op and argument pattern, under a dispatch mode that records
what runs). The same overload runs the same kernel on the same arguments, so results are bitwise those of the
graph. Any op whose binding resolves elsewhere (another overload, a decomposition) or cannot be checked is called
through its ``OpOverload``, as the graph does.

The generated function frees each value after its last use, as fx's own code does, so a node's peak memory is
unchanged; called boxed (one list of arguments, emptied on entry), it frees its arguments at their last use too.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["RecordOps", "compile_graph"]

_PLAIN = (int, float, bool, str, type(None))
_BINDING_CACHE: dict[tuple, Callable | None] = {}


def compile_graph(gm: GraphModule, name: str = "graph", *, boxed: bool = False) -> Callable:
    """``gm``'s forward as a function of its placeholders, with checked bindings (see the module docstring).

    ``boxed``: the function takes one list of the placeholders' values and empties it, so that a value the caller
    no longer holds is freed at its last use inside the function (a block's backward then releases each layer's
    saved tensors as that layer's gradient is done, as eager autograd does), not when the function returns."""
    namespace: dict[str, Any] = {}
    constants: dict[int, str] = {}

    def const(value: Any, hint: str) -> str:
        key = id(value)
        if key not in constants:
            constants[key] = f"_{hint}{len(constants)}"
            namespace[constants[key]] = value
        return constants[key]

    nodes = list(gm.graph.nodes)
    local = {node: f"v{i}" for i, node in enumerate(nodes)}
    last_use: dict[Node, Node] = {}
    for node in nodes:
        for used in node.all_input_nodes:
            last_use[used] = node
    dying: dict[Node, list[Node]] = {}
    for used, user in last_use.items():
        dying.setdefault(user, []).append(used)

    def render(value: Any) -> str:
        if isinstance(value, Node):
            return local[value]
        if isinstance(value, tuple):
            return "(" + "".join(f"{render(v)}, " for v in value) + ")"
        if isinstance(value, list):
            return "[" + ", ".join(render(v) for v in value) + "]"
        if isinstance(value, _PLAIN) and not (isinstance(value, float) and (value != value or abs(value) == float("inf"))):
            return repr(value)
        return const(value, "c")

    params: list[str] = []
    lines: list[str] = []
    for node in nodes:
        if node.op == "placeholder":
            params.append(local[node])
            continue
        if node.op == "output":
            lines.append(f"return {render(node.args[0])}")
            break
        if node.op == "get_attr":
            lines.append(f"{local[node]} = {const(_attribute(gm, node.target), 'a')}")
        elif node.op == "call_function" and node.target is operator.getitem:
            lines.append(f"{local[node]} = {render(node.args[0])}[{render(node.args[1])}]")
        elif node.op == "call_function":
            target = node.target
            call = _binding(node) if isinstance(target, torch._ops.OpOverload) else None
            function = const(call if call is not None else target, "f")
            arguments = [render(a) for a in node.args] + [f"{k}={render(v)}" for k, v in node.kwargs.items()]
            lines.append(f"{local[node]} = {function}({', '.join(arguments)})")
        else:
            raise ValueError(f"{name}: cannot compile a {node.op!r} node ({node.name})")
        freed = [local[n] for n in dying.get(node, ())]
        if not node.users:
            freed.append(local[node])
        if freed:
            lines.append(f"del {', '.join(freed)}")
    if boxed:
        unused = [local[node] for node in nodes if node.op == "placeholder" and not node.users]
        lines[:0] = [f"{', '.join(params)}{',' if len(params) == 1 else ''} = args" if params else "pass",
                     "args.clear()"] + ([f"del {', '.join(unused)}"] if unused else [])
        params = ["args"]
    source = f"def {name}({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in lines)
    exec(compile(source, f"<{name}>", "exec"), namespace)  # noqa: S102 - generated here from the graph
    function = namespace[name]
    function.source = source
    return function


def _attribute(gm: GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _binding(node: Node) -> Callable | None:
    """torch's Python binding of ``node``'s op when calling it with ``node``'s arguments reaches that very overload;
    else None (call the OpOverload)."""
    target: torch._ops.OpOverload = node.target
    pattern = (target, _pattern(node.args), tuple((k, _pattern(v)) for k, v in node.kwargs.items()))
    try:
        hash(pattern)
    except TypeError:
        return None
    if pattern in _BINDING_CACHE:
        return _BINDING_CACHE[pattern]
    found = None
    for candidate in _candidates(target):
        if _reaches(candidate, target, node):
            found = candidate
            break
    _BINDING_CACHE[pattern] = found
    return found


def _pattern(value: Any) -> Any:
    """What decides which overload a binding picks: the kinds of the arguments, not their values."""
    if isinstance(value, Node):
        meta = value.meta.get("val")
        if isinstance(meta, torch.Tensor):
            return ("tensor", meta.dtype, meta.dim())
        if isinstance(meta, (list, tuple)):
            return ("values", type(meta).__name__, len(meta))
        return ("value", type(meta).__name__)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_pattern(v) for v in value))
    if isinstance(value, _PLAIN):
        return type(value).__name__
    return ("object", type(value).__name__, repr(value))


def _candidates(target: torch._ops.OpOverload) -> list[Callable]:
    if target.namespace != "aten":
        return []
    name = target._schema.name.split("::")[-1]
    found = []
    for home in (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase):
        binding = getattr(home, name, None)
        if binding is not None and callable(binding):
            found.append(binding)
    return found


class RecordOps(TorchDispatchMode):
    """Records the op overloads that reach the dispatcher (``.ops``), in order, and runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _meta(value: Any) -> Any:
    if isinstance(value, Node):
        value = value.meta.get("val")
        if value is None:
            raise LookupError("an argument without a traced value")
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="meta")
    if isinstance(value, tuple):
        return tuple(_meta(v) for v in value)
    if isinstance(value, list):
        return [_meta(v) for v in value]
    if isinstance(value, torch.SymInt):
        raise LookupError("a symbolic size")
    return value


def _reaches(binding: Callable, target: torch._ops.OpOverload, node: Node) -> bool:
    try:
        args = _meta(tuple(node.args))
        kwargs = {k: _meta(v) for k, v in node.kwargs.items()}
        with torch.no_grad(), RecordOps() as record:
            binding(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a binding that does not take these arguments is simply not used
        return False
    return record.ops == [target]
