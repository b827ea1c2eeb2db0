"""Node functions called through torch's bindings: only where the binding reaches the graph's own overload."""

import torch
from torch.fx import Graph, GraphModule

from device_agent.executor.aten_calls import compile_graph

aten = torch.ops.aten


def _graph(build) -> GraphModule:
    graph = Graph()
    x = graph.placeholder("x")
    y = graph.placeholder("y")
    graph.output(build(graph, x, y))
    gm = GraphModule(torch.nn.Module(), graph)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(gm, FakeTensorMode()).propagate(torch.randn(4, 3), torch.randn(3, 5))
    return gm


def _called(function) -> set:
    return {value for value in function.__globals__.values() if callable(value) and not isinstance(value, type)}


def test_ops_with_a_binding_reaching_the_same_overload_use_it_and_give_the_same_bits():
    gm = _graph(lambda g, x, y: (g.call_function(aten.sum.dim_IntList,
                                                  (g.call_function(aten.mm.default, (x, y)), [0], True)),))
    function = compile_graph(gm)
    called = _called(function)
    assert torch._C._VariableFunctions.mm in called and torch._C._VariableFunctions.sum in called
    assert aten.mm.default not in called
    x, y = torch.randn(4, 3), torch.randn(3, 5)
    assert torch.equal(function(x, y)[0], gm(x, y)[0])


def test_an_op_whose_binding_resolves_to_another_overload_keeps_its_op_overload():
    # torch.add(x, 2.5) runs aten.add.Tensor (the scalar wrapped in a tensor), not the graph's aten.add.Scalar
    gm = _graph(lambda g, x, y: (g.call_function(aten.add.Scalar, (x, 2.5)),))
    function = compile_graph(gm)
    called = _called(function)
    assert aten.add.Scalar in called and torch._C._VariableFunctions.add not in called
    x = torch.randn(4, 3)
    assert torch.equal(function(x, torch.randn(3, 5))[0], x + 2.5)


def test_every_value_is_freed_after_its_last_use():
    gm = _graph(lambda g, x, y: (g.call_function(aten.relu.default, (g.call_function(aten.mm.default, (x, y)),)),))
    lines = [line.strip() for line in compile_graph(gm).source.splitlines()[1:]]
    # inputs die once the product is made, the product once relu has read it: a node's peak is fx's own
    assert lines == ["v2 = _f0(v0, v1)", "del v0, v1", "v3 = _f1(v2)", "del v2", "return (v3, )"]


def test_a_boxed_function_frees_an_argument_the_caller_no_longer_holds_at_its_last_use():
    """Called with one list, the function empties it: an argument nobody else holds is freed once read for the last
    time, before the function returns (unboxed, the caller's arguments live until it returns)."""
    import weakref

    seen_alive: list[bool] = []

    def probe(y: torch.Tensor) -> torch.Tensor:  # runs after x's last use
        seen_alive.append(x_ref() is not None)
        return y

    graph = Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    negated = graph.call_function(aten.neg.default, (x,))
    graph.output((negated, graph.call_function(probe, (y,))))
    gm = GraphModule(torch.nn.Module(), graph)
    for boxed in (True, False):
        function = compile_graph(gm, boxed=boxed)
        arguments = [torch.randn(3), torch.randn(3)]
        x_ref = weakref.ref(arguments[0])
        expected = -arguments[0]
        result = function(arguments) if boxed else function(*arguments)
        if boxed:
            assert arguments == []
        else:
            arguments.clear()
        assert torch.equal(result[0], expected)
    assert seen_alive == [False, True]
