"""Tests for ``--model module:callable`` loading and ``--input-shape`` parsing."""

from __future__ import annotations

import itertools
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from host.graph.model_source import ModelSourceError, load_factory_bundle, parse_input_shape
from host.graph.zoo import ModelBundle, default_loss

_module_ids = itertools.count()


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write a throwaway importable module from source and return its name (removed from sys.modules after)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def write(source: str) -> str:
        name = f"poet_user_models_{next(_module_ids)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


# ----------------------------------------------------------------------------- parse_input_shape
@pytest.mark.parametrize(
    ("text", "expected"),
    [("32,64", (32, 64)), (" 4, 3,16 ,16 ", (4, 3, 16, 16)), ("7", (7,))],
)
def test_parse_input_shape_accepts_comma_separated_positive_integers(text, expected):
    assert parse_input_shape(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "comma-separated"),
        ("32,", "comma-separated"),
        ("32,,64", "comma-separated"),
        ("a,3", "'a' is not an integer"),
        ("3.5,2", "'3.5' is not an integer"),
        ("0,3", "positive"),
        ("4,-1", "positive"),
    ],
)
def test_parse_input_shape_rejects_bad_values_clearly(text, fragment):
    with pytest.raises(ModelSourceError, match=fragment):
        parse_input_shape(text)


def test_model_source_error_is_a_value_error():
    assert issubclass(ModelSourceError, ValueError)


# ----------------------------------------------------------------------------- the shipped examples
def test_bare_module_gets_seeded_inputs_probed_labels_and_cross_entropy():
    bundle = load_factory_bundle("host.graph.examples:small_cnn", (4, 3, 16, 16), seed=1)
    assert bundle.name == "host.graph.examples:small_cnn"
    assert bundle.module.training
    assert len(bundle.inputs) == 1 and bundle.inputs[0].shape == (4, 3, 16, 16)
    assert bundle.inputs[0].dtype == torch.float32
    assert bundle.labels.shape == (4,) and bundle.labels.dtype == torch.int64
    assert int(bundle.labels.max()) < 10
    assert bundle.loss_fn is default_loss
    bundle.loss_fn(bundle.module(*bundle.inputs), bundle.labels).backward()


def test_output_probe_leaves_batchnorm_statistics_untouched():
    bundle = load_factory_bundle("host.graph.examples:small_cnn", (4, 3, 16, 16))
    batch_norm = bundle.module[1]
    assert int(batch_norm.num_batches_tracked) == 0
    assert torch.equal(batch_norm.running_mean, torch.zeros(8))
    assert all(module.training for module in bundle.module.modules())


def test_factory_bundle_is_used_as_is():
    bundle = load_factory_bundle("host.graph.examples:bundle_with_custom_loss", None)
    assert bundle.name == "regression_mlp"
    assert bundle.loss_fn is F.mse_loss
    assert bundle.labels.shape == (8, 1) and bundle.labels.dtype == torch.float32
    assert bundle.loss_fn(bundle.module(*bundle.inputs), bundle.labels).ndim == 0


def test_loading_is_deterministic_per_seed_and_keeps_the_global_rng():
    torch.manual_seed(99)
    expected_draw = torch.rand(2)
    torch.manual_seed(99)
    first = load_factory_bundle("host.graph.examples:small_cnn", (2, 3, 8, 8), seed=4)
    assert torch.equal(torch.rand(2), expected_draw)

    second = load_factory_bundle("host.graph.examples:small_cnn", (2, 3, 8, 8), seed=4)
    for a, b in zip(first.module.state_dict().values(), second.module.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(first.inputs[0], second.inputs[0])
    assert torch.equal(first.labels, second.labels)

    other = load_factory_bundle("host.graph.examples:small_cnn", (2, 3, 8, 8), seed=5)
    assert not torch.equal(first.module[0].weight, other.module[0].weight)

    regression_a = load_factory_bundle("host.graph.examples:bundle_with_custom_loss", None, seed=4)
    regression_b = load_factory_bundle("host.graph.examples:bundle_with_custom_loss", None, seed=4)
    assert torch.equal(regression_a.inputs[0], regression_b.inputs[0])


# ----------------------------------------------------------------------------- user modules
def test_dict_factory_supplies_inputs_labels_and_loss(user_module):
    name = user_module(
        """
        import torch
        from torch import nn

        def make():
            return {
                "module": nn.Linear(5, 3),
                "inputs": [torch.ones(2, 5)],
                "labels": torch.zeros(2, 3),
                "loss_fn": torch.nn.functional.l1_loss,
                "name": "tiny",
            }
        """
    )
    bundle = load_factory_bundle(f"{name}:make", None)
    assert isinstance(bundle, ModelBundle)
    assert bundle.name == "tiny"
    assert isinstance(bundle.inputs, tuple) and bundle.inputs[0].shape == (2, 5)
    assert bundle.loss_fn is F.l1_loss


def test_dict_factory_defaults_labels_loss_and_inputs(user_module):
    name = user_module(
        """
        import torch
        from torch import nn

        def with_inputs():
            return {"module": nn.Linear(5, 3), "inputs": torch.ones(6, 5)}

        def module_only():
            return {"module": nn.Linear(5, 3)}
        """
    )
    bundle = load_factory_bundle(f"{name}:with_inputs", None, seed=2)
    assert bundle.labels.shape == (6,) and bundle.loss_fn is default_loss
    assert bundle.name == f"{name}:with_inputs"

    bundle = load_factory_bundle(f"{name}:module_only", (4, 5))
    assert bundle.inputs[0].shape == (4, 5) and bundle.labels.shape == (4,)

    with pytest.raises(ModelSourceError, match="--input-shape"):
        load_factory_bundle(f"{name}:module_only", None)


def test_class_and_dotted_attribute_factories(user_module):
    name = user_module(
        """
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 2)

            def forward(self, x):
                return self.fc(x)

            @classmethod
            def create(cls):
                return cls()
        """
    )
    assert load_factory_bundle(f"{name}:Net", (3, 4)).labels.shape == (3,)
    assert load_factory_bundle(f"{name}:Net.create", (3, 4)).inputs[0].shape == (3, 4)


def test_token_model_with_own_inputs_gets_per_token_labels(user_module):
    name = user_module(
        """
        import torch
        from torch import nn

        def make():
            module = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))
            return {"module": module, "inputs": torch.randint(0, 50, (2, 7))}
        """
    )
    bundle = load_factory_bundle(f"{name}:make", None)
    assert bundle.labels.shape == (2, 7)
    assert bundle.loss_fn(bundle.module(*bundle.inputs), bundle.labels).ndim == 0


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("spec", ["resnet19", "mypkg.models", ":make", "mypkg.models:", " : "])
def test_spec_without_module_and_callable_is_rejected(spec):
    with pytest.raises(ModelSourceError, match="module:callable"):
        load_factory_bundle(spec, None)


def test_missing_module_suggests_pythonpath():
    with pytest.raises(ModelSourceError, match="PYTHONPATH") as caught:
        load_factory_bundle("no_such_poet_package.models:make", None)
    assert "'no_such_poet_package.models'" in str(caught.value)


def test_missing_dependency_of_a_user_module_is_named(user_module):
    name = user_module("import no_such_poet_dependency\n")
    with pytest.raises(ModelSourceError, match="no_such_poet_dependency"):
        load_factory_bundle(f"{name}:make", None)


def test_user_module_that_fails_to_import_is_reported(user_module):
    name = user_module("raise RuntimeError('broken on purpose')\n")
    with pytest.raises(ModelSourceError, match="broken on purpose"):
        load_factory_bundle(f"{name}:make", None)


def test_missing_and_non_callable_attributes_are_named(user_module):
    name = user_module("NOT_A_FACTORY = 3\n")
    with pytest.raises(ModelSourceError, match="no attribute 'make_net'"):
        load_factory_bundle(f"{name}:make_net", None)
    with pytest.raises(ModelSourceError, match="not a callable"):
        load_factory_bundle(f"{name}:NOT_A_FACTORY", None)


def test_bare_module_without_input_shape_asks_for_it():
    with pytest.raises(ModelSourceError, match=r"--input-shape 32,64"):
        load_factory_bundle("host.graph.examples:small_cnn", None)


def test_wrong_return_types_and_bad_dicts_are_rejected(user_module):
    name = user_module(
        """
        import torch
        from torch import nn

        def returns_int():
            return 42

        def typo_key():
            return {"module": nn.Linear(2, 2), "input": torch.ones(1, 2)}

        def module_not_a_module():
            return {"module": "linear", "inputs": torch.ones(1, 2)}

        def bad_inputs():
            return {"module": nn.Linear(2, 2), "inputs": [1, 2]}

        def raises():
            raise TypeError("needs arguments")

        class Pair(nn.Module):
            def forward(self, x):
                return x, x

        def tuple_output():
            return Pair()
        """
    )
    cases = {
        "returns_int": "returned int",
        "typo_key": "unknown dict keys",
        "module_not_a_module": "must be an nn.Module",
        "bad_inputs": "tuple of tensors",
        "raises": "needs arguments",
        "tuple_output": "returned tuple",
    }
    for attr, fragment in cases.items():
        with pytest.raises(ModelSourceError, match=fragment):
            load_factory_bundle(f"{name}:{attr}", (1, 2))


def test_input_shape_that_does_not_fit_the_module_is_explained():
    with pytest.raises(ModelSourceError, match="check --input-shape"):
        load_factory_bundle("host.graph.examples:small_cnn", (4, 16))


def test_input_shape_conflicting_with_factory_inputs_is_rejected():
    with pytest.raises(ModelSourceError, match="drop --input-shape"):
        load_factory_bundle("host.graph.examples:bundle_with_custom_loss", (4, 16))
    matching = load_factory_bundle("host.graph.examples:bundle_with_custom_loss", (8, 16))
    assert matching.inputs[0].shape == (8, 16)


def test_bundle_with_wrong_field_types_is_rejected(user_module):
    name = user_module(
        """
        import torch
        from torch import nn
        from host.graph.zoo import ModelBundle, default_loss

        def make():
            return ModelBundle("bad", nn.Linear(2, 2), [torch.ones(1, 2)], torch.zeros(1, dtype=torch.int64), default_loss)
        """
    )
    with pytest.raises(ModelSourceError, match="tuple of tensors"):
        load_factory_bundle(f"{name}:make", None)
