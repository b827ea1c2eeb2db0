"""Fine-tuning recipes: a frozen backbone with BatchNorm frozen in eval mode, bias-only tuning, LoRA."""

from __future__ import annotations

import torch
from torch import nn


class SmallCnn(nn.Module):
    """conv-BN-ReLU twice, dropout, a linear head: what a personal image classifier is made of."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
        )
        self.dropout = nn.Dropout(0.25)
        self.head = nn.Linear(8 * 8 * 8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.backbone(x).flatten(1)))


def batch(size: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(size, 3, 16, 16, generator=generator), torch.randint(0, 5, (size,), generator=generator)


def eval_mode_bn() -> SmallCnn:
    """Statistics frozen for small personal batches (every BatchNorm in eval mode), dropout in eval mode too."""
    torch.manual_seed(0)
    model = SmallCnn()
    for module in model.modules():
        if isinstance(module, (nn.BatchNorm2d, nn.Dropout)):
            module.eval()
    return model


def frozen_backbone() -> SmallCnn:
    """Only the head trains; the backbone's BatchNorm keeps its statistics (eval mode)."""
    model = eval_mode_bn()
    model.dropout.train()
    for param in model.backbone.parameters():
        param.requires_grad_(False)
    return model


def bias_only() -> SmallCnn:
    """BitFit-style: only biases train."""
    torch.manual_seed(0)
    model = SmallCnn()
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith("bias"))
    return model


def as_factory(make) -> dict:
    inputs, labels = batch()
    return {"module": make(), "inputs": inputs, "labels": labels}


def eval_mode_bn_factory() -> dict:
    return as_factory(eval_mode_bn)


def frozen_backbone_factory() -> dict:
    return as_factory(frozen_backbone)
