"""Models users bring, trained as users train them: reshaped inputs, eval-mode layers, Hugging Face outputs,
gradient accumulation, LoRA and frozen backbones. Each is compared with the user's own eager loop."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from host.graph.zoo import ModelBundle
from host.run.loops import train_plain
from poet_edge import train, verify
from tests.host.cli.helpers import one_json_object, poet
from tests.models import frozen, huggingface, reshaped

pytest.importorskip("transformers")


def _factory(name: str) -> str:
    return f"tests.models.reshaped:{name}"


@pytest.mark.parametrize("name,granularity", [(name, "layer") for name in reshaped.RESHAPED]
                         + [("transpose", "op"), ("label_view", "op")])
def test_a_batch_input_reshaped_sliced_or_cast_before_the_first_layer_trains_exactly(name, granularity, tmp_path):
    """A view, reshape, transpose, slice or cast of the batch (or a view of the labels) is an op like any other."""
    report = verify(_factory(name), "a72", "100%", granularity=granularity, steps=2, flash_dir=tmp_path,
                    time_limit_s=20)
    assert report.ok, report
    assert report.bitwise_equal or name == "gru_transposed"  # the GRU's kernels: equal within the tolerance
    assert report.losses[1] < report.losses[0]


@pytest.mark.slow  # a CLI verify (5 s): the fast suite stays under 5 minutes
def test_a_reshaped_input_verifies_through_the_cli_under_a_binding_budget(tmp_path):
    result = poet("verify", "--model", _factory("transpose"), "--platform", "a72", "--ram-budget", "90%",
                  "--granularity", "op", "--steps", "2", "--flash-dir", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    report = one_json_object(result.stdout)
    assert report["ok"] and report["bitwise_equal"]
    assert report["planned"]["recomputes"] + report["planned"]["page_outs"] > 0


@pytest.mark.slow  # a CLI subprocess or a solve of several seconds: the fast suite stays under 5 minutes
def test_gpt2_from_its_config_returning_logits_verifies_through_the_cli(tmp_path):
    """GPT-2's forward views its input ids; its logits go to the default per-token cross-entropy."""
    result = poet("verify", "--model", "tests.models.huggingface:gpt2_logits", "--platform", "a72", "--ram-budget",
                  "70%", "--steps", "2", "--time-limit", "30", "--flash-dir", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    report = one_json_object(result.stdout)
    assert report["ok"] and report["bitwise_equal"]
    assert report["peak_tracked_bytes"] <= report["ram_budget_bytes"]


@pytest.mark.slow  # ~6 s
def test_a_model_output_trains_on_its_logits_like_the_logits_themselves(tmp_path):
    as_is = verify("tests.models.huggingface:gpt2_as_is", "a72", "100%", steps=2, flash_dir=tmp_path)
    logits = verify("tests.models.huggingface:gpt2_logits", "a72", "100%", steps=2, flash_dir=tmp_path)
    assert as_is.ok and as_is.bitwise_equal
    assert as_is.losses == logits.losses


def test_a_model_output_with_its_own_loss_is_trained_on_that_loss():
    from transformers.modeling_outputs import SequenceClassifierOutput

    logits = torch.randn(4, 3)
    labels = torch.tensor([0, 1, 2, 0])
    own = torch.tensor(1.25)
    loss = ModelBundle("m", torch.nn.Identity(), (logits,), labels, F.cross_entropy).training_loss
    assert loss(SequenceClassifierOutput(loss=own, logits=logits), labels) is own
    assert torch.equal(loss(SequenceClassifierOutput(logits=logits), labels), F.cross_entropy(logits, labels))
    with pytest.raises(TypeError, match="no 'logits'"):
        loss(SequenceClassifierOutput(hidden_states=(logits,)), labels)


def test_a_model_computing_its_own_loss_is_refused_naming_the_fix(tmp_path):
    """A loss computed inside the model leaves no loss node to schedule: the error says what to return instead."""
    from transformers.modeling_outputs import SequenceClassifierOutput

    from poet_edge import InputError

    class OwnLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 3)

        def forward(self, x, y):
            logits = self.fc(x)
            return SequenceClassifierOutput(loss=F.cross_entropy(logits, y), logits=logits)

    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    with pytest.raises((InputError, ValueError), match="computed inside the model"):
        verify(OwnLoss(), "a72", "100%", inputs=(x, y), labels=y, flash_dir=tmp_path)


def test_a_recurrent_layer_kept_whole_at_block_granularity_trains_bitwise_like_eager(tmp_path):
    report = verify(_factory("gru_transposed"), "a72", "100%", granularity="block", steps=2, flash_dir=tmp_path)
    assert report.ok and report.bitwise_equal, report


def _users_loop(model, inputs, labels, *, steps: int, micro_batches: int = 1, optimizer: str = "sgd"):
    """The user's own eager loop: forward, loss, backward (accumulated), optimizer.step()."""
    if optimizer == "sgd":
        opt = torch.optim.SGD([p for p in model.parameters()], lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.AdamW([p for p in model.parameters()], lr=1e-3)
    torch.manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(micro_batches):
            loss = F.cross_entropy(model(inputs), labels)
            (loss / micro_batches if micro_batches > 1 else loss).backward()
        opt.step()


def _state_differences(a: torch.nn.Module, b: torch.nn.Module) -> dict[str, float]:
    """Every parameter and buffer that differs, with its max absolute difference."""
    return {name: float((x.double() - y.double()).abs().max())
            for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True)
            if not torch.equal(x, y)}


@pytest.mark.parametrize("make,budget", [(frozen.eval_mode_bn, "90%"), (frozen.frozen_backbone, "100%"),
                                         (frozen.bias_only, "90%")])
def test_each_submodule_keeps_its_own_train_or_eval_mode(make, budget, tmp_path):
    """BatchNorm frozen with .eval() keeps its statistics, as in the user's loop (parameters and buffers)."""
    model = make()
    reference = copy.deepcopy(model)
    inputs, labels = frozen.batch()
    modes = [m.training for m in model.modules()]
    train(model, "a72", budget, inputs=inputs, labels=labels, steps=2, flash_dir=tmp_path, time_limit_s=20)
    _users_loop(reference, inputs, labels, steps=2)
    assert _state_differences(model, reference) == {}
    assert [m.training for m in model.modules()] == modes


def test_verify_s_plain_reference_is_the_module_as_given():
    """The plain run leaves an eval-mode BatchNorm's statistics alone, as the user's loop does."""
    model = frozen.eval_mode_bn()
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    inputs, labels = frozen.batch()
    bundle = ModelBundle("cnn", model, (inputs,), labels, F.cross_entropy)
    train_plain(bundle, steps=2, optimizer_name="sgd", lr=None, seed=0)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_gradient_accumulation_equals_the_users_eager_accumulation(optimizer, tmp_path):
    model = frozen.eval_mode_bn()
    reference, single = copy.deepcopy(model), copy.deepcopy(model)
    inputs, labels = frozen.batch()
    report = train(model, "a72", "90%", inputs=inputs, labels=labels, steps=2, accumulate_steps=3,
                   optimizer=optimizer, flash_dir=tmp_path, time_limit_s=20)
    assert report.accumulate_steps == 3 and len(report.losses) == 2
    _users_loop(reference, inputs, labels, steps=2, micro_batches=3, optimizer=optimizer)
    _users_loop(single, inputs, labels, steps=2, optimizer=optimizer)
    assert _state_differences(model, reference) == {}
    assert _state_differences(model, single), "accumulating 3 micro-batches must differ from one (sgd: 3x the step)"


@pytest.mark.slow  # a CLI subprocess or a solve of several seconds: the fast suite stays under 5 minutes
def test_verify_with_accumulation_through_the_cli(tmp_path):
    result = poet("verify", "--model", "tests.models.frozen:eval_mode_bn_factory", "--platform", "a72",
                  "--ram-budget", "90%", "--accumulate", "3", "--steps", "2", "--flash-dir", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    report = one_json_object(result.stdout)
    assert report["ok"] and report["bitwise_equal"] and report["accumulate_steps"] == 3


def test_bad_accumulate_values_are_refused_with_the_flag_named():
    for value in ("0",):
        result = poet("verify", "--model", "mlp", "--platform", "a72", "--ram-budget", "80%", "--accumulate", value)
        assert result.returncode == 2 and "--accumulate" in result.stderr, result.stderr


def test_lora_and_a_frozen_backbone_shrink_the_trainable_bytes(tmp_path):
    """Only LoRA's adapters (or the head) have gradients: the graph's parameter and gradient bytes shrink."""
    from host.run.sources import ModelSource

    full = ModelSource("tests.models.huggingface:gpt2_logits").resolve().graph
    lora = ModelSource("tests.models.huggingface:gpt2_lora").resolve().graph
    adapters = sum(p.numel() * 4 for n, p in huggingface.gpt2_lora()["module"].named_parameters() if "lora_" in n)
    assert lora.param_bytes == lora.param_grad_bytes == adapters
    assert lora.param_bytes < full.param_bytes / 20
    cnn = ModelSource(frozen.eval_mode_bn(), inputs=frozen.batch()[0], labels=frozen.batch()[1]).resolve().graph
    head_only = ModelSource(frozen.frozen_backbone(), inputs=frozen.batch()[0], labels=frozen.batch()[1])
    head_graph = head_only.resolve().graph
    head = frozen.frozen_backbone().head
    assert head_graph.param_bytes == sum(p.numel() * 4 for p in head.parameters())
    assert sum(n.output_bytes for n in head_graph.nodes if n.kind == "bwd") < sum(
        n.output_bytes for n in cnn.nodes if n.kind == "bwd")


@pytest.mark.slow  # a CLI subprocess or a solve of several seconds: the fast suite stays under 5 minutes
def test_lora_on_gpt2_verifies(tmp_path):
    report = verify("tests.models.huggingface:gpt2_lora", "a72", "70%", steps=2, flash_dir=tmp_path,
                    time_limit_s=30)
    assert report.ok and report.bitwise_equal, report


@pytest.mark.slow
@pytest.mark.parametrize("name", ["distilbert", "vit", "mobilenet_v2"])
def test_hugging_face_models_from_their_configs_verify_as_returned(name, tmp_path):
    """Returned as is (a ModelOutput); ViT's dropout with p=0 returns its input, whose bytes it then holds."""
    report = verify(f"tests.models.huggingface:{name}", "a72", "70%", steps=2, flash_dir=tmp_path, time_limit_s=30)
    assert report.ok and report.bitwise_equal, report
    assert report.peak_tracked_bytes <= report.predicted_peak_bytes
