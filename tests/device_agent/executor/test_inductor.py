"""Node functions through inductor (ScheduleExecutor(inductor=True), ``poet train --compile``): every schedule
computes bitwise what the compiled keep-all schedule computes (recompute replays dropout through eager's random
kernels), training stays within float rounding of plain PyTorch, and a graph inductor cannot compile runs
uncompiled, exactly, with a log line saying so."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config

from device_agent.executor.inductor import InductorFunction

from .helpers import case, run_plain, run_scheduled, schedule_for

KINDS = ("none", "remat", "paging", "mixed")


def _train(model: str, kind: str, tmp_path, **options):
    current = case(model)
    schedule, _budget = schedule_for(model, kind)
    logged: list[str] = []
    results = run_scheduled(current, schedule, steps=3, optimizer="sgd", flash_dir=tmp_path, inductor=True,
                            log=logged.append, **options)
    state = {k: v.detach().clone() for k, v in current.bundle.module.state_dict().items()}
    return [r.loss for r in results], state, logged, results


@pytest.mark.slow  # inductor compiles every node: 10-40 s with a cold cache
@pytest.mark.parametrize("model", ["mlp", "hf_bert"])
def test_every_schedule_computes_what_compiled_keep_all_computes(model, tmp_path):
    trained = {kind: _train(model, kind, tmp_path) for kind in KINDS}
    losses, state, logged, results = trained["none"]
    assert logged == []  # every node compiled, none under autograd
    for kind in KINDS[1:]:
        other_losses, other_state, other_logged, _ = trained[kind]
        assert other_logged == []
        assert other_losses == losses, kind
        assert all(torch.equal(other_state[k], state[k]) for k in state), (
            f"{kind} differs from compiled keep-all: "
            f"{ {k: float((other_state[k] - state[k]).abs().max()) for k in state} }")
    assert [r.lowered for r in results] == [False, True, True]
    # within float rounding of eager (hf_bert's dropout draws eager's masks: a different mask moves the loss a lot)
    plain, plain_losses = run_plain(case(model), steps=3, optimizer="sgd")
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for name, value in plain.module.state_dict().items():
        assert torch.allclose(state[name].double(), value.double(), rtol=1e-4, atol=1e-6), name


@pytest.mark.slow
def test_the_executor_runs_inductor_kernels(tmp_path):
    from device_agent.executor import ScheduleExecutor

    current = case("mlp")
    schedule, _budget = schedule_for("mlp", "remat")
    current.reset()
    with ScheduleExecutor(current.partition, schedule, flash_dir=str(tmp_path), inductor=True) as executor:
        executor.train_step(current.bundle.inputs, current.bundle.labels)
        functions = [f for f in executor._functions.values() if f is not None]
    assert functions
    for f in functions:
        for call in (f.call_forward, f.call_backward):
            assert isinstance(call, InductorFunction)
            assert call.failure is None and call.compiled is not None and call.compiled is not call.fallback


def test_a_graph_inductor_cannot_compile_runs_uncompiled_and_exact(tmp_path):
    # no C++ compiler (as on a board without one), and no cached kernels to fall back on
    broken = {"cpp.cxx": ("poet-edge-no-such-compiler",), "fx_graph_cache": False, "fx_graph_remote_cache": False}
    with inductor_config.patch(broken):
        losses, state, logged, _ = _train("mlp", "remat", tmp_path)
    assert logged and all("runs uncompiled" in line for line in logged), logged
    plain, plain_losses = run_plain(case("mlp"), steps=3, optimizer="sgd")
    assert losses == plain_losses  # the uncompiled functions: bitwise eager
    assert all(torch.equal(state[k], v) for k, v in plain.module.state_dict().items())
