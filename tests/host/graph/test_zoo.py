"""Tests for the model zoo: shapes, parameter counts, determinism, bundles and errors."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from host.graph.zoo import (
    ZOO,
    ModelBundle,
    ModelSpec,
    UnknownModelError,
    default_loss,
    get_model_spec,
    list_models,
    seeded_labels,
)

EXPECTED_NAMES = {
    "mlp",
    "digits_mlp",
    "linear",
    "vgg16",
    "vgg16_cifar",
    "resnet18",
    "resnet50",
    "resnet18_cifar",
    "bert",
    "transformer",
    "hf_bert",
}
SMALL_MODELS = ["mlp", "linear", "resnet18_cifar", "vgg16_cifar", "hf_bert"]
LARGE_MODELS = ["vgg16", "resnet18", "resnet50", "bert", "transformer"]
NATIVE_MODELS = sorted(EXPECTED_NAMES - {"hf_bert"})  # built from torch.nn only


def _needs_transformers(name: str) -> None:
    if name == "hf_bert":
        pytest.importorskip("transformers")


def _meta_module(spec: ModelSpec) -> nn.Module:
    """Build on the meta device: shapes and parameter counts without allocating or initialising weights."""
    with torch.device("meta"):
        return spec.builder()


def _num_params(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def _forward_backward(bundle: ModelBundle) -> torch.Tensor:
    output = bundle.module(*bundle.inputs)
    loss = bundle.loss_fn(output, bundle.labels)
    loss.backward()
    return output


# ----------------------------------------------------------------------------- registry
def test_zoo_has_the_paper_models_in_list_order():
    assert set(ZOO) == EXPECTED_NAMES
    assert [spec.name for spec in list_models()] == list(ZOO)
    for name, spec in ZOO.items():
        assert spec.name == name
        assert get_model_spec(name) is spec
        assert spec.default_batch_size >= 1
        assert spec.description


def test_unknown_model_error_names_the_bad_name_and_lists_valid_ones():
    with pytest.raises(UnknownModelError) as caught:
        get_model_spec("resnet19")
    message = str(caught.value)
    assert "'resnet19'" in message
    for name in EXPECTED_NAMES:
        assert name in message
    assert isinstance(caught.value, KeyError)
    assert caught.value.name == "resnet19"


def test_model_spec_rejects_bad_input_kind_and_missing_vocab():
    with pytest.raises(ValueError, match="input_kind"):
        ModelSpec("x", "x", (4,), "image", None, 1, nn.Identity, (4,))
    with pytest.raises(ValueError, match="vocab_size"):
        ModelSpec("x", "x", (4,), "tokens", None, 1, nn.Identity, (4,))


# ----------------------------------------------------------------------------- sizes and shapes (meta device: fast)
@pytest.mark.parametrize(
    ("name", "expected"),
    [("resnet18", 11_689_512), ("resnet50", 25_557_032), ("vgg16", 138_357_544)],
)
def test_imagenet_parameter_counts_match_the_reference_architectures(name, expected):
    assert _num_params(_meta_module(ZOO[name])) == expected


def test_bert_base_has_about_110m_parameters_and_ties_the_decoder():
    module = _meta_module(ZOO["bert"])
    assert 105_000_000 <= _num_params(module) <= 115_000_000
    assert module.decoder.weight is module.word_embedding.weight
    assert len(module.layers) == 12
    assert len(_meta_module(ZOO["transformer"]).layers) == 1


def test_cifar_resnet_has_three_stages_of_two_basic_blocks():
    module = _meta_module(ZOO["resnet18_cifar"])
    assert len(module.blocks) == 6
    assert module.stem[0][0].out_channels == 16
    assert [block.conv2[0].out_channels for block in module.blocks] == [16, 16, 32, 32, 64, 64]
    assert module.fc.in_features == 64 and module.fc.out_features == 10


@pytest.mark.parametrize("name", NATIVE_MODELS)
def test_declared_output_shape_matches_the_module(name):
    spec = ZOO[name]
    module = _meta_module(spec)
    inputs = tuple(tensor.to("meta") for tensor in spec.make_inputs(batch_size=2))
    output = module(*inputs)
    assert tuple(output.shape) == (2, *spec.output_shape)


# ----------------------------------------------------------------------------- bundles
@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_bundle_inputs_and_labels_have_the_declared_shapes(name, monkeypatch):
    spec = ZOO[name]
    # Only the batch is under test here: skip weight construction for the big models.
    monkeypatch.setattr(ModelSpec, "build", lambda self, seed=0: nn.Identity())
    bundle = spec.bundle(batch_size=3, seed=5)
    (inputs,) = bundle.inputs
    assert bundle.name == name
    assert inputs.shape == (3, *spec.input_shape)
    if spec.input_kind == "tokens":
        assert inputs.dtype == torch.int64
        assert 0 <= int(inputs.min()) and int(inputs.max()) < spec.vocab_size
    else:
        assert inputs.dtype == torch.float32
    assert bundle.labels.dtype == torch.int64
    assert bundle.labels.shape == (3, *spec.output_shape[:-1])
    assert 0 <= int(bundle.labels.min()) and int(bundle.labels.max()) < spec.output_shape[-1]
    assert bundle.loss_fn is default_loss


def test_bundle_defaults_to_the_spec_batch_size_and_rejects_empty_batches():
    spec = ZOO["mlp"]
    assert spec.bundle().inputs[0].shape[0] == spec.default_batch_size
    with pytest.raises(ValueError, match="batch_size"):
        spec.bundle(batch_size=0)


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_small_models_train_one_step(name):
    _needs_transformers(name)
    bundle = ZOO[name].bundle(batch_size=2)
    assert bundle.module.training
    output = _forward_backward(bundle)
    assert tuple(output.shape) == (2, *ZOO[name].output_shape)
    grads = [parameter.grad for parameter in bundle.module.parameters()]
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads)


def test_transformer_layer_trains_on_a_short_sequence():
    module = ZOO["transformer"].build(seed=0)
    tokens = torch.randint(0, 30522, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = module(tokens)
    assert logits.shape == (2, 16, 30522)
    loss = default_loss(logits, seeded_labels(logits.shape, seed=0))
    assert 9.0 < loss.item() < 12.0  # ~ln(30522): BERT's small init keeps logits near zero
    loss.backward()
    assert module.layers[0].attention.query.weight.grad is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", LARGE_MODELS)
def test_large_models_train_one_step_at_full_size(name):
    spec = ZOO[name]
    bundle = spec.bundle()
    output = _forward_backward(bundle)
    assert tuple(output.shape) == (spec.default_batch_size, *spec.output_shape)


# ----------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", ["mlp", "resnet18_cifar", "transformer"])
def test_same_seed_gives_identical_weights_inputs_and_labels(name):
    first, second = ZOO[name].bundle(batch_size=2, seed=7), ZOO[name].bundle(batch_size=2, seed=7)
    for a, b in zip(first.module.state_dict().values(), second.module.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(first.inputs, second.inputs, strict=True))
    assert torch.equal(first.labels, second.labels)

    other = ZOO[name].bundle(batch_size=2, seed=8)
    assert not all(torch.equal(a, b) for a, b in zip(first.module.parameters(), other.module.parameters(), strict=True))
    assert not torch.equal(first.inputs[0], other.inputs[0])


def test_building_leaves_the_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    ZOO["mlp"].bundle(seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_hf_bert_is_deterministic_and_returns_logits():
    pytest.importorskip("transformers")
    first, second = ZOO["hf_bert"].bundle(seed=3), ZOO["hf_bert"].bundle(seed=3)
    for a, b in zip(first.module.parameters(), second.module.parameters(), strict=True):
        assert torch.equal(a, b)
    output = first.module(*first.inputs)
    assert isinstance(output, torch.Tensor)
    assert first.module.model.config._attn_implementation == "eager"


def test_hf_bert_without_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match=r"pip install poet-edge\[hf\]"):
        ZOO["hf_bert"].build()


# ----------------------------------------------------------------------------- loss and labels
def test_default_loss_is_cross_entropy_over_the_last_dimension():
    logits = torch.zeros(2, 3, 5)
    labels = torch.zeros(2, 3, dtype=torch.int64)
    assert torch.isclose(default_loss(logits, labels), torch.log(torch.tensor(5.0)))
    logits_2d = torch.tensor([[10.0, 0.0], [0.0, 10.0]])
    assert float(default_loss(logits_2d, torch.tensor([0, 1]))) < 1e-3


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=4),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_seeded_labels_are_reproducible_class_indices(shape, seed):
    labels = seeded_labels(shape, seed)
    assert labels.dtype == torch.int64
    assert tuple(labels.shape) == tuple(shape[:-1])
    if labels.numel():
        assert 0 <= int(labels.min()) and int(labels.max()) < shape[-1]
    assert torch.equal(labels, seeded_labels(tuple(shape), seed))


def test_seeded_labels_need_a_class_dimension():
    with pytest.raises(ValueError):
        seeded_labels((), 0)
