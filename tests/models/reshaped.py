"""Forwards that reshape, slice or cast their batch input (or their labels) before the first layer."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class _Head(nn.Module):
    def __init__(self, prepare, features: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.prepare = prepare
        self.fc1 = nn.Linear(features, 32)
        self.fc2 = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.prepare(x))))


def _batch(shape, classes: int = 4, dtype=torch.float32) -> dict:
    generator = torch.Generator().manual_seed(1)
    if dtype.is_floating_point:
        inputs = torch.randn(shape, generator=generator, dtype=dtype)
    else:
        inputs = torch.randint(0, 5, shape, generator=generator, dtype=dtype)
    return {"inputs": inputs, "labels": torch.randint(0, classes, (shape[0],), generator=generator)}


def view() -> dict:
    return {"module": _Head(lambda x: x.view(-1, 16)), **_batch((8, 4, 4))}


def reshape() -> dict:
    return {"module": _Head(lambda x: x.reshape(x.shape[0], -1)), **_batch((8, 4, 4))}


def transpose() -> dict:
    return {"module": _Head(lambda x: x.transpose(1, 2).flatten(1)), **_batch((8, 4, 4))}


def slice_() -> dict:
    return {"module": _Head(lambda x: x[:, 2:18]), **_batch((8, 20))}


def dtype_cast() -> dict:
    return {"module": _Head(lambda x: x.to(torch.float32) / 4), **_batch((8, 16), dtype=torch.int64)}


def label_view() -> dict:
    """Labels come as a column and the loss reshapes them."""
    parts = _batch((8, 16))
    parts["labels"] = parts["labels"].view(-1, 1)
    return {"module": _Head(lambda x: x), **parts, "loss_fn": lambda out, y: F.cross_entropy(out, y.view(-1))}


class _Gru(nn.Module):
    """A keyword-spotting GRU: features arrive channels first, the forward starts with a transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 16, batch_first=True)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x.transpose(1, 2))
        return self.fc(out[:, -1])


def gru_transposed() -> dict:
    generator = torch.Generator().manual_seed(1)
    return {"module": _Gru(), "inputs": torch.randn(4, 8, 10, generator=generator),
            "labels": torch.randint(0, 5, (4,), generator=generator)}


RESHAPED = ("view", "reshape", "transpose", "slice_", "dtype_cast", "label_view", "gru_transposed")
