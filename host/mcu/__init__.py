"""Training on a microcontroller: the McuModel the Cortex-M firmware runs, and the PyTorch reference it matches."""

from host.mcu.model import (
    McuModelError,
    McuSpec,
    TorchReference,
    initial_params,
    max_relative_difference,
    mcu_spec,
)

__all__ = ["McuModelError", "McuSpec", "TorchReference", "initial_params", "max_relative_difference", "mcu_spec"]
