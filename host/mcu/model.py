"""What the board's training is compared with: plain PyTorch training of the same received program.

The model is mapped onto the firmware's layers in one place, on the board's side
(:func:`device_agent.serial_bridge.model.mcu_model`, from the exported program and its node grouping), so the
serial bridge and `poet mcu run` send the board the same thing. :class:`TorchReference` trains a copy of that
program with torch.optim.SGD on the same batches; :func:`max_relative_difference` compares the parameters.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch.fx import GraphModule

from device_agent.serial_bridge.model import McuModelError, McuProgram, parameter_tensors

__all__ = ["McuModelError", "TorchReference", "max_relative_difference"]


class TorchReference:
    """PyTorch training of a copy of ``module`` (the exported program, which returns the loss) as the board trains
    it: the mean cross-entropy, then SGD(learning_rate, momentum) from the McuModel."""

    def __init__(self, module: GraphModule, program: McuProgram) -> None:
        with warnings.catch_warnings():  # torch's own pytree deprecation, raised while copying an exported module
            warnings.simplefilter("ignore", FutureWarning)
            self.module = copy.deepcopy(module)
        self.program = program
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=float(program.model.learning_rate),
                                         momentum=float(program.model.momentum))

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = self.module(inputs, labels=labels)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def params(self) -> dict[tuple[int, int], torch.Tensor]:
        """{(layer, tensor): flat values}, as McuBoard.read_params() returns the board's."""
        return {(layer, tensor): values.reshape(-1).clone()
                for layer, tensor, values in parameter_tensors(self.module, self.program)}


def max_relative_difference(board: dict, reference: dict) -> float:
    """Max over tensors of max|board - reference| / max|reference| (each tensor against its own scale)."""
    if set(board) != set(reference):
        raise ValueError(f"the board holds tensors {sorted(board)}, the reference {sorted(reference)}")
    worst = 0.0
    for key, expected in reference.items():
        got = board[key].reshape(-1).to(torch.float64)
        want = expected.reshape(-1).to(torch.float64)
        if got.shape != want.shape:
            raise ValueError(f"tensor {key}: board has {tuple(got.shape)} values, reference {tuple(want.shape)}")
        scale = float(want.abs().max()) or 1.0
        worst = max(worst, float((got - want).abs().max()) / scale)
    return worst
