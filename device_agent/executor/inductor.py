"""A node function compiled by inductor (``poet train --compile``): fused kernels, not bitwise eager.

Inductor (torch.compile's compiler) fuses a node's pointwise ops, reductions and layout changes into
generated C++ kernels. A node's forward and backward graphs are compiled on their own with
``torch._inductor.standalone_compile``, at their first call, on that call's tensors (shapes and strides
specialised; a later call with other strides is refused by inductor's own input checks, and the executor
captures its functions again for a new batch shape). Compiling costs seconds per distinct graph on the
first step; inductor's on-disk cache makes repeated graphs (a transformer's layers) and later runs cheap.

What stays exact: random ops keep eager's kernels and generator (``fallback_random``), so a recompute replays
the forward's dropout mask as the uncompiled executor does, and the same compiled kernels run on the same
tensors whatever the schedule, lowered with deterministic algorithms (an embedding's backward without
parallel atomic adds, whose order changed from run to run on two threads): a schedule still changes nothing
a compiled step computes. What does not:
fused kernels round differently from eager's, so parameters drift from plain PyTorch's by float rounding,
and ``poet verify`` (bitwise against eager) runs without compiling.

A compiled call costs more than the uncompiled function (aten_calls.py), so compiling pays on nodes with
enough work to fuse: blocks rather than single layers (`bench/executor.py --part 1 --compile`).
A graph inductor cannot compile (no C++ compiler on the board) runs uncompiled, and ``log`` says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch.fx import GraphModule

__all__ = ["InductorFunction"]

# random ops run eager's kernels on eager's generator: a recompute replays the forward's draws exactly
INDUCTOR_CONFIG = {"fallback_random": True}


@contextmanager
def _deterministic_lowering():
    """Deterministic algorithms while inductor lowers the graph: an accumulating index_put (an embedding's
    backward) then calls aten's serial kernel instead of parallel atomic adds, whose order, and so whose
    rounding, changed from run to run on two threads."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


class _NotSaving(logging.Filter):
    """Drops standalone_compile's warning that it cannot make a saveable artifact: nothing here saves one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "cannot save" not in record.getMessage()


logging.getLogger("torch._inductor.standalone_compile").addFilter(_NotSaving())


class InductorFunction:
    """``graph`` compiled by inductor at the first call; ``fallback`` (the uncompiled function) if that fails."""

    def __init__(self, graph: GraphModule, fallback: Callable, label: str,
                 log: Callable[[str], None] | None = None) -> None:
        self.graph = graph
        self.fallback = fallback
        self.label = label
        self.log = log
        self.compiled: Callable | None = None
        self.failure: str | None = None  # why inductor could not compile the graph (it runs uncompiled)

    def __call__(self, *args: Any) -> Any:
        compiled = self.compiled
        if compiled is None:
            compiled = self._compile(args)
        return compiled(*args)

    def _compile(self, args: tuple) -> Callable:
        import torch._inductor.config as inductor_config  # loaded only when a node is compiled

        rng = torch.get_rng_state()  # compiling draws nothing the step would see
        try:
            with torch.no_grad(), inductor_config.patch(INDUCTOR_CONFIG), _deterministic_lowering():
                artifact = torch._inductor.standalone_compile(self.graph, list(args),
                                                              dynamic_shapes="from_example_inputs")
            self.compiled = artifact
        except Exception as error:  # noqa: BLE001 - any compiler failure leaves the exact uncompiled function
            text = str(error).strip()
            self.failure = f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
            self.compiled = self.fallback
            if self.log is not None:
                self.log(f"inductor could not compile {self.label} ({self.failure}); it runs uncompiled")
        finally:
            torch.set_rng_state(rng)
        return self.compiled
