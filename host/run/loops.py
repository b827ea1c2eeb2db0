"""Training loops: steps under a schedule (the executor) and plain PyTorch steps, with their measurements."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from device_agent.executor.reference import parameter_differences
from device_agent.optimizers import OPTIMIZERS
from host.run.errors import InputError

__all__ = ["OPTIMIZERS", "RunResult", "StepProgress", "make_optimizer", "parameter_differences", "train_plain",
           "train_scheduled"]



@dataclass
class StepProgress:
    """One finished training step, for progress displays."""

    label: str  # "train" (under the schedule) or "plain"
    step: int  # 1-based
    steps: int
    loss: float
    step_s: float


ProgressFn = Callable[[Any], None]


@dataclass
class RunResult:
    """What one training run measured, per step (energy labelled by ``energy_source``)."""

    losses: list[float]
    step_s: list[float]
    energy_j: list[float]
    energy_source: str
    peak_tracked_bytes: int = 0
    executed: list[dict] = field(default_factory=list)  # per-step instruction counts (scheduled runs)
    rss_peak_bytes: int = 0
    program_runs: int = 0
    backward_runs: int = 0

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)


def make_optimizer(name: str, parameters, lr: float | None = None):
    """The board's optimizer choice (device_agent.executor.make_optimizer); a bad name is an InputError."""
    from device_agent.executor import make_optimizer as board_optimizer

    try:
        return board_optimizer(name, parameters, lr)
    except ValueError as error:
        raise InputError(str(error)) from None


def local_energy_meter(profile=None):
    """The modelled meter for this machine: the local profile's powers, or the documented assumptions."""
    from device_agent.meters.registry import default_energy_meter

    powers = None if profile is None else {"energy_source": profile.energy_source,
                                           "compute_power_w": profile.compute_power_w,
                                           "memory_power_w": profile.memory_power_w}
    return default_energy_meter(profile=powers)


def train_scheduled(partition, schedule, bundle, *, steps: int, optimizer_name: str, lr: float | None, seed: int,
                    flash_dir: str, profile=None, events=None, progress: ProgressFn | None = None,
                    return_freed_memory: bool = False, accumulate_steps: int = 1, inductor: bool = False,
                    log: Callable[[str], None] | None = None) -> RunResult:
    """``steps`` steps of ``bundle``'s model under ``schedule`` (``bundle.module`` must be the traced one).

    A step is ``accumulate_steps`` micro-batches (each the bundle's batch, run under the schedule, which is
    solved per micro-batch) and one optimizer step; its loss is their mean, its time and energy their sum.
    Page files live in a private directory under ``flash_dir``; the executor removes it on the way out,
    also when a step raises (Ctrl-C, SIGTERM). ``inductor``: node functions run inductor's kernels (not bitwise
    eager); ``log`` hears of nodes that run otherwise (under autograd, or uncompiled).
    """
    import torch

    from device_agent.executor import ScheduleExecutor

    optimizer = make_optimizer(optimizer_name, bundle.module.parameters(), lr)
    meter = local_energy_meter(profile)
    torch.manual_seed(seed)
    result = RunResult([], [], [], meter.source)
    # Asked for per-instruction events (--events): every instruction gets its CPU time and energy, at two meter
    # readings each; otherwise only page transfers do (calibration needs no more).
    with ScheduleExecutor(partition, schedule, flash_dir=flash_dir, events=events, energy_meter=meter,
                          return_freed_memory=return_freed_memory, instrumented=events is not None,
                          inductor=inductor, log=log) as executor:
        for step in range(steps):
            losses, step_s, energy_j = [], 0.0, 0.0
            for micro_batch in range(accumulate_steps):
                outcome = executor.train_step(bundle.inputs, bundle.labels, optimizer, micro_batch=micro_batch,
                                              micro_batches=accumulate_steps)
                summary = outcome.summary
                losses.append(outcome.loss)
                step_s += outcome.duration_s
                energy_j += summary.energy_j
                result.peak_tracked_bytes = max(result.peak_tracked_bytes, outcome.peak_tracked_bytes)
                result.executed.append(outcome.counters.plan_counts())
                result.rss_peak_bytes = max(result.rss_peak_bytes, summary.rss_peak_bytes)
                result.program_runs += summary.program_runs
                result.backward_runs += summary.backward_runs
            result.losses.append(statistics.fmean(losses))
            result.step_s.append(step_s)
            result.energy_j.append(energy_j)
            if progress is not None:
                progress(StepProgress("train", step + 1, steps, result.losses[-1], step_s))
    return result


def train_plain(bundle, *, steps: int, optimizer_name: str, lr: float | None, seed: int, profile=None,
                progress: ProgressFn | None = None, accumulate_steps: int = 1) -> RunResult:
    """Ordinary eager PyTorch training of ``bundle`` (the comparison and the reference), with the user's own
    gradient accumulation over ``accumulate_steps`` micro-batches per optimizer step."""
    import torch

    from device_agent.executor import plain_train_step
    from device_agent.meters.memory import RssSampler

    optimizer = make_optimizer(optimizer_name, bundle.module.parameters(), lr)
    meter = local_energy_meter(profile)
    torch.manual_seed(seed)  # the module is trained as given: each submodule keeps its own train/eval flag
    result = RunResult([], [], [], meter.source)
    rss = RssSampler()
    for step in range(steps):
        start = meter.read()
        losses = [plain_train_step(bundle.module, bundle.training_loss, bundle.inputs, bundle.labels, optimizer,
                                   micro_batch=micro_batch, micro_batches=accumulate_steps)
                  for micro_batch in range(accumulate_steps)]
        end = meter.read()
        energy_j, _ = meter.energy_j(start, end)
        loss = statistics.fmean(losses)
        result.losses.append(loss)
        result.step_s.append(end.wall_s - start.wall_s)
        result.energy_j.append(energy_j)
        result.rss_peak_bytes = max(result.rss_peak_bytes, rss.rss_bytes())
        if progress is not None:
            progress(StepProgress("plain", step + 1, steps, loss, end.wall_s - start.wall_s))
    return result
