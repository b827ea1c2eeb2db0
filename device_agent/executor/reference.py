"""The reference every scheduled run is compared with: the user's plain PyTorch step, the optimizers host and
board both build (their names and state: device_agent.optimizers), and the parameters' comparison."""

from __future__ import annotations

import torch

from device_agent.optimizers import OPTIMIZER_STATE, OPTIMIZERS, OptimizerState

__all__ = ["OPTIMIZERS", "OPTIMIZER_STATE", "OptimizerState", "make_optimizer", "parameter_differences",
           "plain_train_step"]


def plain_train_step(
    module: torch.nn.Module,
    loss_fn,
    inputs: tuple[torch.Tensor, ...],
    labels: torch.Tensor,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    micro_batch: int = 0,
    micro_batches: int = 1,
) -> float:
    """Ordinary eager PyTorch training step (the reference the executor must match); returns the loss.

    With ``micro_batches`` > 1, the user's gradient accumulation: ``(loss / micro_batches).backward()``, gradients
    cleared before micro-batch 0 and the optimizer stepped after the last.
    """
    if micro_batch == 0:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        else:
            for param in module.parameters():
                param.grad = None
    loss = loss_fn(module(*inputs), labels)
    (loss / micro_batches if micro_batches != 1 else loss).backward()
    if optimizer is not None and micro_batch == micro_batches - 1:
        optimizer.step()
    return float(loss.detach())


def make_optimizer(name: str, parameters, lr: float | None = None) -> torch.optim.Optimizer:
    """SGD (momentum 0.9, lr 0.01) or AdamW (lr 1e-3) over ``parameters``: the one choice of host and board."""
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr or 0.01, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=lr or 1e-3)
    raise ValueError(f"optimizer: {name!r} is not one of {', '.join(OPTIMIZERS)}")


def parameter_differences(module_a: torch.nn.Module, module_b: torch.nn.Module) -> dict:
    """Max absolute and relative (per tensor: max |a-b| / max |b|) differences of parameters and buffers."""
    import math

    max_abs = max_rel = 0.0
    bitwise = True
    worst = ""
    pairs = list(zip(module_a.named_parameters(), module_b.named_parameters(), strict=True))
    pairs += list(zip(module_a.named_buffers(), module_b.named_buffers(), strict=True))
    for (name, a), (_, b) in pairs:
        if torch.equal(a, b):
            continue
        bitwise = False
        diff = float((a.detach().double() - b.detach().double()).abs().max())
        scale = float(b.detach().double().abs().max())
        rel = diff / scale if scale > 0 else math.inf
        max_abs = max(max_abs, diff)
        if rel > max_rel:
            max_rel, worst = rel, name
    return {"max_abs_param_diff": max_abs, "max_rel_param_diff": max_rel, "bitwise_equal": bitwise, "worst": worst}
