"""poet2022 graphs: structure, invariants and reference numbers derived by hand from the paper code."""

from __future__ import annotations

import pytest

from host.graph.poet2022 import POET2022_MODELS, UnknownPoet2022ModelError, build_poet2022_graph
from host.graph.training_graph import TrainingGraph


@pytest.fixture(scope="module")
def graphs() -> dict[str, TrainingGraph]:
    return {name: build_poet2022_graph(name) for name in POET2022_MODELS}


def _vfwd_bytes(graph: TrainingGraph) -> int:
    """The paper's ``sum(g.cost_ram[i] for i in g.vfwd)``: every non-GradientLayer node, loss included."""
    return sum(n.output_bytes for n in graph.nodes if n.kind != "bwd")


def _heights(graph: TrainingGraph) -> list[int]:
    """Longest path from each node to a sink: the level at which ``toposort`` emits it."""
    heights = [0] * graph.size
    for idx in range(graph.size - 1, -1, -1):
        users = graph.successors[idx]
        heights[idx] = 1 + max(heights[u] for u in users) if users else 0
    return heights


def test_models_tuple():
    assert POET2022_MODELS == (
        "linear",
        "vgg16",
        "vgg16_cifar",
        "resnet18",
        "resnet18_cifar",
        "resnet50",
        "bert",
        "transformer",
    )


def test_unknown_name_lists_valid_names():
    with pytest.raises(UnknownPoet2022ModelError) as info:
        build_poet2022_graph("alexnet")
    assert isinstance(info.value, KeyError)
    for name in POET2022_MODELS:
        assert name in str(info.value)


def test_prefix_accepted_and_bad_batch_rejected():
    assert build_poet2022_graph("poet2022:linear").fingerprint() == build_poet2022_graph("linear").fingerprint()
    with pytest.raises(ValueError):
        build_poet2022_graph("vgg16_cifar", batch_size=0)


@pytest.mark.parametrize("name", POET2022_MODELS)
def test_structure_follows_the_paper(graphs, name):
    graph = graphs[name]
    kinds = [n.kind for n in graph.nodes]
    n_fwd = kinds.count("fwd")
    # Layer list + loss, then one GradientLayer per layer except the loss: 2 * (n_fwd + 1) - 1 nodes.
    assert kinds.count("loss") == 1
    assert kinds.count("bwd") == n_fwd
    assert kinds == ["fwd"] * n_fwd + ["loss"] + ["bwd"] * n_fwd
    assert graph.nodes[0].name == "layer0_InputLayer"
    assert graph.meta["source"] == "poet2022"
    assert graph.meta["batch_size"] == 1
    assert graph.param_grad_bytes == graph.optimizer_state_bytes == 0
    assert "only parameter bytes" in graph.meta["param_bytes_note"]
    assert all(type(n.flops) is int and type(n.output_bytes) is int for n in graph.nodes)

    # make_graph's order: toposort levels (longest path to the sink), longest first.
    heights = _heights(graph)
    assert heights == sorted(heights, reverse=True)
    assert heights[-1] == 0 and graph.last_use[-1] == graph.size - 1

    loss = n_fwd
    chain = list(range(loss + 1, graph.size))
    for pos, idx in enumerate(chain):
        node = graph.nodes[idx]
        fwd = graph.nodes[node.forward_index]
        assert node.name.endswith("_GradientLayer")
        assert node.flops == 2 * fwd.flops
        assert node.op_class == fwd.op_class
        # deps = {output, inputs[0], grad_outputs}; the first one's inputs[0] and grad_outputs are both the loss.
        prev = loss if pos == 0 else idx - 1
        assert prev in node.deps and node.forward_index in node.deps
        assert len(node.deps) == (2 if pos == 0 else 3)
    # The chain visits the layer list backwards: the gradient of the input layer is last.
    assert graph.nodes[-1].forward_index == 0 and graph.nodes[-1].flops == 0


@pytest.mark.parametrize("name", [m for m in POET2022_MODELS if m != "resnet18_cifar"])
def test_order_is_unique_and_equals_layer_list(graphs, name):
    """Without ties, the paper's topological order is unique, and here it is the layer list itself."""
    graph = graphs[name]
    heights = _heights(graph)
    assert all(a > b for a, b in zip(heights, heights[1:], strict=False))
    assert [n.name.split("_")[0] for n in graph.nodes] == [f"layer{i}" for i in range(graph.size)]


def test_resnet18_cifar_ties_are_broken_by_layer_index(graphs):
    """Shortcut conv3/bn3 tie with bn2/relu2 (random order in the paper code); ties go by list index."""
    names = [n.name for n in graphs["resnet18_cifar"].nodes]
    assert names[3:13] == [
        "layer3_Conv2dLayer",  # conv1
        "layer4_BatchNorm2d",
        "layer5_ReLULayer",
        "layer6_Conv2dLayer",  # conv2
        "layer7_BatchNorm2d",  # bn2      } same level
        "layer9_Conv2dLayer",  # conv3    }
        "layer8_ReLULayer",  # relu2      } same level
        "layer10_BatchNorm2d",  # bn3     }
        "layer11_SkipAddLayer",
        "layer12_ReLULayer",
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Reference facts, derived by hand from the paper code's formulas (poet/architectures/*.py, poet/power_computation*.py).
# ---------------------------------------------------------------------------------------------------------------------


def test_reference_linear(graphs):
    graph = graphs["linear"]
    # Input + 6 x (Linear, ReLU) + loss = 14 forward nodes; 13 GradientLayers -> 27 nodes.
    assert graph.size == 27
    # Edges: 13 forward chain edges + 13 gradients x 3 deps - 1 (first: inputs[0] == grad_outputs == loss) = 51.
    assert len(graph.edges) == 51
    # Linear FLOPs = 2 * (in + 1) * out + out; ReLU = out; batch 1:
    #   15710 + 2760 + 24300 + 40600 + 4030 + 230 = 87630 (linears) + 450 (ReLUs) = 88080, loss = 10 * 10 = 100.
    fwd_flops = sum(n.flops for n in graph.nodes if n.kind != "bwd")
    assert fwd_flops == 88180
    # Gradients: 2 x FLOPs of every layer but the loss -> 88180 + 2 * 88080 = 264340.
    assert graph.total_flops == 264340
    # Bytes: input 784 * 4 = 3136, linear/ReLU outputs 2 * 450 * 4 = 3600, loss (10,) -> 40: total 6776.
    assert _vfwd_bytes(graph) == 6776
    # Params: 785*10 + 11*120 + 121*100 + 101*200 + 201*10 + 11*10 = 43590 -> 174360 bytes.
    assert graph.param_bytes == 174360
    # First GradientLayer: output = last ReLU (layer 12), inputs = [loss (layer 13)] -> shape (10,), 40 bytes.
    first_grad = graph.nodes[14]
    assert first_grad.name == "layer14_GradientLayer"
    assert (first_grad.forward_index, set(first_grad.deps), first_grad.output_bytes) == (12, {12, 13}, 40)
    assert first_grad.flops == 2 * 10


def test_reference_resnet18_cifar(graphs):
    graph = graphs["resnet18_cifar"]
    # Forward: input, conv, bn (3) + 6 blocks x 10 layers + avgpool, flatten, linear (3) + loss = 67 -> 133 nodes.
    assert graph.size == 133
    # Forward edges: 2 (stem) + 6 x 11 (10 layers, skip has 2 deps, conv3 reads the block input) + 4 = 72;
    # gradients 66 x 3 - 1 = 197 -> 269.
    assert len(graph.edges) == 269
    # Activations (values): input 3072; stem 2 x 16384; blocks 1-2: 20 x 16384; blocks 3-4: 20 x 8192;
    # blocks 5-6: 20 x 4096; avgpool 64, flatten 64, linear 10, loss 10 -> 609428 values x 4 bytes.
    assert _vfwd_bytes(graph) == 2437712
    # Params: stem 448 + 64; blocks 7152, 7152, 18912, 28128, 74688, 111552; linear 650 -> 248746 x 4 bytes.
    assert graph.param_bytes == 994984
    # Stem conv (1, 16, 32, 32): 65536 bytes; FLOPs 2 * 9 * 3072 * 16 + 16384 = 901120.
    stem = graph.nodes[graph.index_of("layer1_Conv2dLayer")]
    assert (stem.output_bytes, stem.flops) == (65536, 901120)


def test_reference_transformer(graphs):
    graph = graphs["transformer"]
    # Input + 8 block layers + loss = 10 forward nodes -> 19 nodes; edges 11 + 9 x 3 - 1 = 37.
    assert (graph.size, len(graph.edges)) == (19, 37)
    # Values: 6 x 512*768 (input, qktv, linear, skip, linear2, skip2) + qkv 1536*64*12 + qkt 512*512*12
    #         + linear_relu 512*3072 + loss 512 = 8258048 -> 33032192 bytes.
    assert _vfwd_bytes(graph) == 33032192
    # FLOPs: qkv 905969664, qkt 207618048, qktv 402653184, linear 1181952, skip 393216, linear_relu 6300672,
    #        linear2 4720896, skip2 393216, loss 393216 * 512 = 201326592 -> 1730557440.
    assert sum(n.flops for n in graph.nodes if n.kind != "bwd") == 1730557440
    # The second skip adds the attention projection (paper's layers[-4]) and the FFN output.
    skip2 = graph.nodes[8]
    assert skip2.name == "layer8_SkipAddLayer" and set(skip2.deps) == {4, 7}


def test_reference_vgg16(graphs):
    graph = graphs["vgg16"]
    # 1 + 13 x 2 + 5 pools + flatten + 3 linears + 2 ReLUs + 2 dropouts + loss = 41 forward -> 81 nodes.
    assert graph.size == 81
    # First conv output (1, 64, 224, 224) -> 12845056 bytes; Flatten (1, 25088).
    assert graph.nodes[1].output_bytes == 64 * 224 * 224 * 4
    assert graph.nodes[graph.index_of("layer32_FlattenLayer")].output_bytes == 25088 * 4
    # 138357544 parameters, the well-known VGG-16 count (conv and linear biases included).
    assert graph.param_bytes == 138357544 * 4


def test_batch_size_handling():
    vgg = build_poet2022_graph("vgg16_cifar", batch_size=4)
    base = build_poet2022_graph("vgg16_cifar")
    assert vgg.meta["batch_size"] == 4
    assert vgg.nodes[0].output_bytes == 4 * base.nodes[0].output_bytes
    assert vgg.param_bytes == base.param_bytes
    # The paper's linear, bert and transformer builders take no batch size.
    linear = build_poet2022_graph("linear", batch_size=8)
    assert linear.fingerprint() == build_poet2022_graph("linear").fingerprint()
    assert "batch_size_note" in linear.meta
