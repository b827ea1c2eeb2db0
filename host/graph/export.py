"""Export a training step with torch.export and make it schedulable: in-place ops rewritten, dead ops dropped.

``torch.export.export(strict=False)`` runs on a wrapper whose forward returns ``loss_fn(model(*inputs), labels)``,
so the loss is part of the program. The training IR keeps ``batch_norm`` in training mode and ``dropout`` as
dropout; LSTM/GRU/RNN ops are unrolled into one cell per time step (:mod:`host.graph.recurrent`).
In-place ops on activations (``relu_``, ``+=``) are rewritten out of place when no later op reads the mutated
tensor, so every node owns its output; buffer mutations (BatchNorm running statistics) stay in place.
An export failure becomes a :class:`TraceError` naming the user's file, line and module, and a fix.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import os
import re
import sys
import sysconfig
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from device_agent.errors import UserError
from host.graph.recurrent import unroll_recurrent

if TYPE_CHECKING:
    from host.graph.zoo import ModelBundle

__all__ = [
    "MODEL_ATTR", "TraceError", "export_error", "export_program",
]  # fmt: skip

MODEL_ATTR = "model"  # the wrapper's attribute holding the user's module: module paths start with it


class TraceError(UserError, ValueError):
    """A model that cannot be traced into a TrainingGraph; the message names the op or line and a fix."""


class _LossWrapper(nn.Module):
    """``forward(*inputs, labels) -> loss_fn(model(*inputs), labels)``: puts the loss into the exported graph."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(*inputs), labels)


_QUOTED_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def _user_frame(error: BaseException) -> tuple[str, int, str, Any] | None:
    """The deepest traceback frame outside torch, the stdlib and this file: (file, line, function, self)."""
    skip = (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"], __file__)
    found = None
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            filename = tb.tb_frame.f_code.co_filename
            if not filename.startswith("<") and not filename.startswith(skip):
                found = (filename, tb.tb_lineno, tb.tb_frame.f_code.co_name, tb.tb_frame.f_locals.get("self"))
            tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return found


def export_error(error: Exception, bundle: ModelBundle) -> TraceError:
    """A TraceError naming where export failed (file, line, module) and how to get around it."""
    text = str(error).strip()
    headline = text.splitlines()[0] if text else type(error).__name__
    where = ""
    frame = _user_frame(error)
    # torch.export names the user line in its message ("File ..., line N, in f\n    code"); prefer that.
    quoted = _QUOTED_FRAME.findall(text)
    if quoted:
        filename, line_text, function, source = quoted[-1]
        lineno = int(line_text)
    elif frame is not None:
        filename, lineno, function, _ = frame
        source = linecache.getline(filename, lineno).strip()
    if quoted or frame is not None:
        where = f" at {os.path.basename(filename)}:{lineno} in {function}()"
        owner = frame[3] if frame is not None and frame[:3] == (filename, lineno, function) else None
        if isinstance(owner, nn.Module):
            path = next((p for p, m in bundle.module.named_modules() if m is owner), None)
            where += f" of {type(owner).__name__}" + (f" {path!r}" if path else "")
        if source:
            where += f": `{source.strip()}`"
    if "data-dependent" in text or "GuardOnDataDependent" in type(error).__name__:
        cause = (
            "Python control flow on tensor values (if/while on a tensor, .item(), bool()) cannot be traced; "
            "rewrite it with torch.where/torch.cond or move the decision out of forward()"
        )
    else:
        cause = "simplify that forward (plain tensor ops, no Python-side data-dependent logic)"
    return TraceError(
        f"cannot trace model {bundle.name!r}: torch.export failed{where} ({type(error).__name__}: {headline}). "
        f"Fix: {cause}, or pass a --model factory that returns its own example batch whose shapes trace; "
        "--granularity only changes how traced ops are grouped, not whether export succeeds."
    )


def export_program(bundle: ModelBundle, *, unroll_recurrent_layers: bool = True) -> torch.export.ExportedProgram:
    """``torch.export`` of the model with its loss (a TraceError on failure).

    ``unroll_recurrent_layers``: LSTM/GRU/RNN ops become one cell per time step (equal to eager's fused kernels
    to float rounding, not bitwise); False keeps the fused op. ``.module()`` of the result, through
    :func:`device_agent.executor.split.make_schedulable`, is the program the trace groups; a board rebuilds the
    same from the saved archive.
    """
    wrapper = _LossWrapper(bundle.module, bundle.training_loss)
    # On failure torch logs a warning and prints partial graphs to stderr; the TraceError says it better,
    # so that output is held back and replayed only when export succeeds.
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            program = torch.export.export(wrapper, tuple(bundle.inputs), {"labels": bundle.labels}, strict=False)
    except Exception as error:
        raise export_error(error, bundle) from error
    finally:
        shapes_log.setLevel(level)
    sys.stderr.write(held.getvalue())
    if unroll_recurrent_layers:
        unroll_recurrent(program)  # in the program itself, so the archive a board receives holds the cells
    return program
