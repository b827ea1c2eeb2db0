"""Training on a microcontroller from the host: `poet mcu run` (build the firmware, boot QEMU, solve for the
board, train, compare), and the PyTorch reference the board's parameters are compared with."""

from host.mcu.model import McuModelError, TorchReference, max_relative_difference

__all__ = ["McuModelError", "TorchReference", "max_relative_difference"]
