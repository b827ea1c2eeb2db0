"""The optimizers host and board both build, by name, and the state each keeps per parameter.

No torch here: the CLI's parsers, the solver's memory plan and the board all read these facts, and a `poet --help`
must not wait for torch to load. ``device_agent.executor.reference.make_optimizer`` builds them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_OPTIMIZER", "OPTIMIZERS", "OPTIMIZER_STATE", "OptimizerState"]

OPTIMIZERS = ("sgd", "adamw")
DEFAULT_OPTIMIZER = "sgd"


@dataclass(frozen=True)
class OptimizerState:
    """What one optimizer keeps per trainable parameter tensor once it has stepped (frozen ones get nothing).

    ``buffers`` tensors shaped and typed like the parameter, plus ``scalar_bytes`` of per-parameter scalars.
    """

    buffers: int
    scalar_bytes: int = 0

    def state_bytes(self, trainable_bytes: int, trainable_tensors: int) -> int:
        return self.buffers * trainable_bytes + self.scalar_bytes * trainable_tensors


# The state of each optimizer `make_optimizer` builds, as torch allocates it on its first step; the memory plan
# counts it in the fixed bytes (host.graph.training_graph.TrainingGraph.with_optimizer).
# tests/host/run/test_optimizer_state.py checks it against the real optimizers.
OPTIMIZER_STATE: dict[str, OptimizerState] = {
    "sgd": OptimizerState(buffers=1),  # momentum 0.9: one momentum_buffer per parameter (none without momentum)
    # exp_avg and exp_avg_sq, and `step`, a float32 0-dim tensor per parameter (not fused, not capturable)
    "adamw": OptimizerState(buffers=2, scalar_bytes=4),
}
