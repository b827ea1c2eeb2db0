"""trace_model: torch.export programs grouped into TrainingGraphs with measured bytes, FLOPs and backward deps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from host.graph.trace import GRANULARITIES, GROUP_META_KEY, TracedModel, TraceError, trace_model
from host.graph.training_graph import TrainingGraph

zoo = pytest.importorskip("host.graph.zoo", reason="host/graph/zoo.py (ModelBundle, model zoo) is not there yet")
ModelBundle = zoo.ModelBundle

BATCH = 4


class TinyResidualNet(nn.Module):
    """conv-bn-relu, a residual branch (conv2-relu2 + skip), dropout, Linear(64, 128), Linear(128, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.drop = nn.Dropout(0.25)
        self.fc1 = nn.Linear(64, 128)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn(self.conv(x)))
        y = self.relu2(self.conv2(y)) + y
        return self.fc2(self.act(self.fc1(self.drop(torch.flatten(y, 1)))))


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.conv(x))
        out += 0.5 * x  # two inline ops: one node per layer, two per op
        return self.relu(out)


class TinyStagedNet(nn.Module):
    """Nested modules (stem / stage.N / head), with in-place ReLU and ``+=`` to exercise the rewrite."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.stage = nn.Sequential(Block(4), Block(4))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stage(self.stem(x)))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return self.fc(-x)


def _bundle(module: nn.Module, input_shape: tuple[int, ...], classes: int = 10, name: str = "tiny") -> ModelBundle:
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(input_shape, generator=generator),)
    labels = torch.randint(0, classes, (input_shape[0],), generator=generator)
    return ModelBundle(name=name, module=module, inputs=inputs, labels=labels, loss_fn=F.cross_entropy)


def _residual() -> ModelBundle:
    torch.manual_seed(0)
    return _bundle(TinyResidualNet(), (BATCH, 3, 4, 4))


def _deps(graph: TrainingGraph, name: str) -> set[str]:
    return {graph.nodes[d].name for d in graph.nodes[graph.index_of(name)].deps}


def _loss_by_groups(traced: TracedModel, bundle: ModelBundle) -> torch.Tensor:
    """Run every group's standalone module in order, like an executor would, and return the loss."""
    values = dict(zip(traced.input_names, bundle.inputs, strict=True))
    values[traced.label_name] = bundle.labels
    for group in traced.groups:
        outputs = traced.group_module(group.index)(*(values[v] for v in group.input_values))
        values.update(zip(group.output_values, outputs, strict=True))
    return values[traced.loss_value]


@pytest.fixture(scope="module")
def residual() -> tuple[ModelBundle, TracedModel]:
    bundle = _residual()
    return bundle, trace_model(bundle)


def test_residual_graph_structure(residual):
    _, traced = residual
    graph = traced.graph
    graph.validate()
    names = [n.name for n in graph.forward_nodes()]
    assert names == ["input", "conv", "bn", "relu", "conv2", "relu2", "add", "drop", "fc1", "act", "fc2", "loss"]
    assert graph.nodes[0].op_class == "input" and graph.nodes[0].flops == 0
    assert graph.nodes[0].output_bytes == 0  # the caller holds the batch: fixed bytes (test_fixed_bytes)
    assert graph.nodes[graph.index_of("loss")].kind == "loss"
    assert "bwd:input" not in {n.name for n in graph.nodes}
    bwd_names = [n.name for n in graph.nodes if n.kind == "bwd"]
    assert bwd_names == ["bwd:" + name for name in reversed(names[1:])]  # reverse order, loss first
    for node in graph.nodes:
        if node.kind == "bwd":
            assert node.forward_index is not None and node.name == "bwd:" + graph.nodes[node.forward_index].name
            assert node.op_class == graph.nodes[node.forward_index].op_class
    assert _deps(graph, "add") == {"relu2", "relu"}
    assert graph.meta == {"source": "trace", "granularity": "layer", "batch_size": BATCH, "model": "tiny"}


def test_residual_backward_dependencies(residual):
    _, traced = residual
    graph = traced.graph
    # relu's output feeds conv2 and the residual add: its gradient accumulates from both backward nodes.
    assert {"bwd:conv2", "bwd:add"} <= _deps(graph, "bwd:relu")
    assert "relu" in _deps(graph, "bwd:relu")  # ReLU's backward reads its own output
    assert "relu" in _deps(graph, "bwd:conv2")  # a convolution's backward reads its input
    assert _deps(graph, "bwd:conv") == {"bwd:bn", "input"}
    assert _deps(graph, "bwd:add") == {"bwd:drop"}  # an add saves nothing
    assert _deps(graph, "bwd:loss") == {"loss"}
    assert _deps(graph, "bwd:fc1") == {"bwd:act", "drop"}
    # bwd output bytes: gradients w.r.t. activation inputs only (none for the first conv: its input is data).
    assert graph.nodes[graph.index_of("bwd:conv")].output_bytes == 0
    # An add passes one gradient tensor to both its inputs: held (and priced) once, as the executor holds it.
    assert graph.nodes[graph.index_of("bwd:add")].output_bytes == BATCH * 4 * 4 * 4 * 4


def test_linear_flops_and_bytes(residual):
    _, traced = residual
    graph = traced.graph
    fc1 = graph.nodes[graph.index_of("fc1")]
    assert fc1.op_class == "matmul"
    assert fc1.flops == 2 * BATCH * 64 * 128  # the counter's addmm: bias adds are not counted
    assert fc1.output_bytes == BATCH * 128 * 4
    bwd = graph.nodes[graph.index_of("bwd:fc1")]
    assert bwd.flops == 2 * fc1.flops  # grad input + grad weight
    assert bwd.output_bytes == BATCH * 64 * 4
    relu = graph.nodes[graph.index_of("act")]
    assert relu.flops == BATCH * 128 and relu.op_class == "elementwise"
    assert graph.nodes[graph.index_of("bwd:act")].flops == 2 * relu.flops  # formula fallback
    bn = graph.nodes[graph.index_of("bn")]
    assert bn.op_class == "norm" and bn.output_bytes == BATCH * 4 * 4 * 4 * 4  # its output alone:
    group = traced.group_named("bn")  # the saved mean / inv-std are pinned (fixed bytes), not part of the node
    assert group.saved_bytes == group.pinned_bytes == 2 * 4 * 4
    # BatchNorm's backward reads its input and the pinned statistics, never its output: as in autograd, the
    # output can be freed once the next layer has run.
    assert _deps(graph, "bwd:bn") == {"bwd:relu", "conv"}


def test_fixed_bytes(residual):
    bundle, traced = residual
    graph = traced.graph
    params = sum(p.numel() * 4 for p in bundle.module.parameters())
    buffers = sum(b.numel() * b.element_size() for b in bundle.module.buffers())
    assert graph.param_bytes == graph.param_grad_bytes == params
    assert graph.optimizer_state_bytes == 0
    pinned = sum(g.pinned_bytes for g in traced.groups)
    assert pinned > 0
    batch_bytes = BATCH * 3 * 4 * 4 * 4
    assert graph.other_fixed_bytes == buffers + BATCH * 8 + batch_bytes + pinned


def test_groups_describe_runnable_pieces(residual):
    bundle, traced = residual
    assert [g.name for g in traced.groups] == [n.name for n in traced.graph.forward_nodes()]
    fc1 = traced.group_named("fc1")
    assert fc1.param_names == ("model.fc1.weight", "model.fc1.bias")
    assert traced.group_named("bn").buffer_names  # running statistics
    assert traced.label_name in traced.groups[-1].input_values
    for node in traced.graph_module.graph.nodes:
        if node.op == "call_function":
            assert isinstance(node.meta.get(GROUP_META_KEY), int)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        whole = traced.graph_module(*bundle.inputs, labels=bundle.labels)
        torch.manual_seed(1)
        pieces = _loss_by_groups(traced, bundle)
    assert torch.allclose(whole, pieces)


def test_trace_leaves_module_state_alone():
    bundle = _residual()
    bundle.module.eval()
    running_mean = bundle.module.bn.running_mean.clone()
    rng = torch.get_rng_state()
    traced = trace_model(bundle)
    assert not bundle.module.training and not bundle.module.bn.training
    assert torch.equal(bundle.module.bn.running_mean, running_mean)
    assert torch.equal(torch.get_rng_state(), rng)
    # traced in training mode all the same: batch norm keeps batch statistics, dropout stays
    targets = [str(n.target) for n in traced.graph_module.graph.nodes]
    assert "aten.dropout.default" in targets and "aten.batch_norm.default" in targets


def test_granularities_and_inplace_rewrite():
    torch.manual_seed(0)
    bundle = _bundle(TinyStagedNet(), (2, 3, 6, 6))
    sizes = {}
    for granularity in GRANULARITIES:
        traced = trace_model(bundle, granularity=granularity)
        sizes[granularity] = traced.graph.size
        assert traced.graph.meta["granularity"] == granularity
    traced_block = trace_model(bundle, granularity="block")
    assert [n.name for n in traced_block.graph.forward_nodes()] == ["input", "stem", "stage", "head", "loss"]
    deeper = trace_model(bundle, granularity="block", block_depth=2)
    assert traced_block.granularity == "block" and deeper.granularity == "block:2"
    # "block:2" is the text users pass (poet solve --granularity block:2): the same nodes
    assert [n.name for n in trace_model(bundle, granularity="block:2").graph.nodes] == [n.name for n in deeper.graph.nodes]
    with pytest.raises(TraceError, match="block:N"):
        trace_model(bundle, granularity="block:0")
    assert [n.name for n in deeper.graph.forward_nodes()][1:-1] == [
        "stem.0",
        "stem.1",
        "stem.2",
        "stage.0",
        "stage.1",
        "head.0",
        "head.2",
    ]
    assert sizes["block"] < deeper.graph.size < sizes["layer"] < sizes["op"]

    layer = trace_model(bundle)
    targets = [str(n.target) for n in layer.graph_module.graph.nodes]
    assert "aten.relu_.default" not in targets and "aten.add_.Tensor" in targets  # only num_batches_tracked stays
    assert [n.name for n in layer.graph.forward_nodes()][4:8] == [
        "stage.0.conv",
        "stage.0.bn",
        "stage.0.mul",
        "stage.0.relu",
    ]
    by_name = {n.name: n for n in layer.graph_module.graph.nodes}
    inline = [str(by_name[name].target) for name in layer.group_named("stage.0.mul").fx_nodes]
    assert inline == ["aten.mul.Tensor", "aten.add.Tensor"]  # `+=` rewritten out of place
    assert {"bwd:stage.1.mul", "bwd:stage.1.conv"} <= _deps(layer.graph, "bwd:stage.0.relu")
    with torch.random.fork_rng(devices=[]):
        expected = F.cross_entropy(bundle.module(*bundle.inputs), bundle.labels)
        got = layer.graph_module(*bundle.inputs, labels=bundle.labels)
        pieces = _loss_by_groups(layer, bundle)
    assert torch.allclose(expected, got) and torch.allclose(expected, pieces)


def test_bad_arguments():
    bundle = _residual()
    with pytest.raises(TraceError, match="granularity"):
        trace_model(bundle, granularity="module")
    with pytest.raises(TraceError, match="block_depth"):
        trace_model(bundle, granularity="block", block_depth=0)


def test_untraceable_model_names_the_problem():
    bundle = _bundle(DataDependent(), (3, 8), classes=2, name="branchy")
    with pytest.raises(TraceError) as caught:
        trace_model(bundle)
    message = str(caught.value)
    assert "'branchy'" in message
    assert "if x.sum() > 0:" in message
    assert "DataDependent" in message
    assert "control flow" in message and "--model factory" in message


# ----------------------------------------------------------------------------- zoo models
def test_zoo_mlp():
    bundle = zoo.get_model_spec("mlp").bundle()
    traced = trace_model(bundle)
    graph = traced.graph
    assert [n.name for n in graph.forward_nodes()] == ["input", "0", "1", "2", "3", "4", "loss"]
    assert graph.size == 13
    assert graph.nodes[graph.index_of("0")].flops == 2 * 8 * 64 * 128
    assert graph.meta["batch_size"] == 8 and graph.meta["model"] == "mlp"


def test_zoo_resnet18_cifar():
    bundle = zoo.get_model_spec("resnet18_cifar").bundle()
    graph = trace_model(bundle).graph
    names = {n.name for n in graph.nodes}
    assert {"stem.0.0", "blocks.0.add", "blocks.2.shortcut.0", "pool", "fc", "loss"} <= names
    # stem output feeds block 0's conv1 and its identity shortcut (the residual add)
    assert {"bwd:blocks.0.add", "bwd:blocks.0.conv1.0"} <= _deps(graph, "bwd:stem.1")
    convs = [n for n in graph.forward_nodes() if n.op_class == "conv"]
    assert len(convs) == 1 + 6 * 2 + 2  # stem, two per block, two projection shortcuts
    assert sum(1 for n in graph.nodes if n.kind == "bwd") == len(graph.forward_nodes()) - 1


def test_zoo_hf_bert():
    pytest.importorskip("transformers", reason="hf_bert needs the transformers package")
    bundle = zoo.get_model_spec("hf_bert").bundle()
    traced = trace_model(bundle)
    graph = traced.graph
    names = {n.name for n in graph.nodes}
    assert {"bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.1.output.LayerNorm", "loss"} <= names
    attention = graph.nodes[graph.index_of("bert.encoder.layer.0.attention.self.matmul")]
    assert attention.op_class == "matmul" and attention.flops > 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        whole = traced.graph_module(*bundle.inputs, labels=bundle.labels)
        torch.manual_seed(3)
        pieces = _loss_by_groups(traced, bundle)
    assert torch.allclose(whole, pieces)


    # BERT's attention mask is built from constants and read by every layer: a node of its own, so that the second
    # layer's attention does not depend on the first's (whose output held it: 2.42 MB, hf_bert's floor)
    mask = graph.index_of("bert.where")
    assert graph.nodes[mask].deps == ()
    second = graph.nodes[graph.index_of("bert.encoder.layer.1.attention.self.matmul")]
    assert mask in second.deps and graph.index_of("bert.encoder.layer.0.attention.self.matmul") not in second.deps


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return x * keep


class _TwoMaskedLayers(nn.Module):
    """A mask computed from constants alone, read by two layers (as BERT's attention mask is)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 4)
        self.gate1, self.gate2 = _Gate(), _Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.arange(16) < 12
        return self.second(self.gate2(torch.relu(self.gate1(self.first(x), keep)), keep))


def test_a_tensor_built_from_constants_and_read_by_two_nodes_is_a_node_of_its_own():
    """Computed once before its first reader; each reader depends on it, not on the other reader; the pieces
    compute the model's loss."""
    torch.manual_seed(0)
    bundle = ModelBundle(name="masked", module=_TwoMaskedLayers(), inputs=(torch.randn(8, 16),),
                         labels=torch.randint(0, 4, (8,)), loss_fn=F.cross_entropy)
    traced = trace_model(bundle)
    graph = traced.graph
    shared = graph.nodes[graph.index_of("lt")]
    assert shared.kind == "fwd" and shared.deps == ()
    readers = [n for n in graph.nodes if n.kind == "fwd" and shared.index in n.deps]
    assert len(readers) == 2 and shared.index < min(r.index for r in readers)
    assert [r.name for r in readers] == ["gate1", "gate2"] and readers[0].index not in readers[1].deps
    assert not any(n.kind == "bwd" and n.forward_index == shared.index for n in graph.nodes)  # nothing to differentiate
    assert torch.allclose(bundle.loss_fn(bundle.module(*bundle.inputs), bundle.labels), _loss_by_groups(traced, bundle))


def test_the_trace_passes_import_their_shared_types_one_way():
    """grouping and measure take their types from host.graph.groups, never from the trace that runs them."""
    import ast
    from pathlib import Path

    import host.graph

    folder = Path(host.graph.__file__).parent
    imported = {}
    for name in ("groups", "grouping", "measure", "trace"):
        tree = ast.parse((folder / f"{name}.py").read_text())
        imported[name] = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported["groups"] if m.startswith("host.")}
    assert "host.graph.trace" not in imported["grouping"] | imported["measure"]
    assert "host.graph.measure" not in imported["grouping"]


def test_node_groups_are_assembled_once_and_not_changed_by_later_passes(residual):
    import dataclasses

    _, traced = residual
    with pytest.raises(dataclasses.FrozenInstanceError):
        traced.groups[1].output_bytes = 0
    assert traced.graph.nodes[0].output_bytes == 0  # the batch: fixed bytes, held by the caller
    for group in traced.groups[1:]:
        assert traced.graph.nodes[group.index].output_bytes == group.output_bytes


def test_tracing_leaves_no_activation_alive():
    """The recorded forward and each group's re-run save tensors through hooks; nothing of them outlives the trace
    (a hook returning the saved tensor itself, or holding it, made cycles through autograd's C++ graph that
    Python's collector never freed: every activation of the example batch stayed in RAM)."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensor

    def live_real_tensors() -> dict[int, torch.Tensor]:
        gc.collect()
        return {id(o): o for o in gc.get_objects()
                if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor) and not o.is_meta}

    bundle = _bundle(TinyResidualNet(), (BATCH, 3, 4, 4))
    before = live_real_tensors()
    traced = trace_model(bundle)
    leaked = [t for key, t in live_real_tensors().items() if key not in before and t.dim() and t.shape[0] == BATCH]
    assert traced.graph.size > 0
    assert leaked == [], [(tuple(t.shape), type(t.grad_fn).__name__) for t in leaked]
