"""The trace measures each node's workspace from torch's own allocator: the temporaries a pass holds beyond
what it keeps, including buffers allocated and freed inside a kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from device_agent.replay import replay
from host.graph.partition import partition_from_traced
from host.graph.trace import trace_model
from host.graph.zoo import ModelBundle
from host.solver.baselines import keep_all_plan
from host.solver.stage_plan import lower_plan, make_schedule

BATCH, CLASSES = 32, 1000


def _bundle(module: nn.Module, input_shape: tuple[int, ...]) -> ModelBundle:
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(*input_shape, generator=generator),)
    labels = torch.randint(0, CLASSES, (input_shape[0],), generator=generator)
    return ModelBundle(name="workspace", module=module, inputs=inputs, labels=labels, loss_fn=F.cross_entropy)


def _smoothed_bundle() -> ModelBundle:
    bundle = _bundle(nn.Linear(16, CLASSES), (BATCH, 16))
    return ModelBundle(name=bundle.name, module=bundle.module, inputs=bundle.inputs, labels=bundle.labels,
                       loss_fn=lambda logits, labels: F.cross_entropy(logits, labels, label_smoothing=0.1))


def test_the_loss_backward_writes_the_logits_gradient_over_the_log_probabilities_gradient():
    """cross_entropy's backward makes the gradient of its log-softmax output (batch x classes floats), then turns
    it into the logits' gradient: written over the first, as the executor's backward does, it needs no workspace
    (eager autograd would hold both: batch x classes floats of workspace)."""
    torch.manual_seed(0)
    traced = trace_model(_bundle(nn.Linear(16, CLASSES), (BATCH, 16)), granularity="layer")
    loss_backward = next(n for n in traced.graph.nodes if n.name == "bwd:loss")
    assert loss_backward.output_bytes == BATCH * CLASSES * 4
    assert loss_backward.workspace_bytes == 0


def test_a_log_probabilities_gradient_summed_with_another_is_not_written_over():
    """With label smoothing the log-probabilities receive two gradients, summed before the log-softmax's backward:
    the sum is not the loss backward's own fresh tensor, so nothing is written over and the workspace is held."""
    torch.manual_seed(0)
    traced = trace_model(_smoothed_bundle(), granularity="layer")
    loss_backward = next(n for n in traced.graph.nodes if n.name == "bwd:loss")
    assert loss_backward.workspace_bytes >= BATCH * CLASSES * 4


def test_a_convolution_s_kernel_buffers_are_measured():
    """A convolution's backward allocates and frees buffers inside the kernel, which no op output shows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.Flatten(), nn.Linear(16 * 8 * 8, CLASSES))
    traced = trace_model(_bundle(model, (BATCH, 16, 8, 8)), granularity="layer")
    conv_backward = next(n for n in traced.graph.nodes if n.kind == "bwd" and n.op_class == "conv")
    assert conv_backward.workspace_bytes > 0
    schedule = make_schedule(traced.graph, lower_plan(keep_all_plan(traced.graph), traced.graph))
    with_workspace = replay(partition_from_traced(traced).nodes, schedule.instructions, graph_label="conv")
    assert with_workspace.peak_ram_bytes > max(with_workspace.ram_timeline_bytes)


class _TwoConsumers(nn.Module):
    """One activation read by two layers: its backward first sums the two gradients it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.left, self.right = nn.Linear(16, 64), nn.Linear(64, CLASSES), nn.Linear(64, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.relu(self.first(x))
        return self.left(shared) + self.right(shared)


def test_summing_gradients_from_several_consumers_is_workspace():
    torch.manual_seed(0)
    traced = trace_model(_bundle(_TwoConsumers(), (BATCH, 16)), granularity="layer")
    relu_backward = next(n for n in traced.graph.nodes if n.kind == "bwd" and "relu" in n.name)
    assert relu_backward.workspace_bytes >= BATCH * 64 * 4  # the sum of the two gradients of ``shared``


def test_the_executor_counts_the_workspace_in_its_tracked_peak(tmp_path):
    """Interpreted (first step) and lowered (later steps) alike, the tracked peak is the replay's, workspace
    included, so the budget a schedule was solved for bounds what the executor reports."""
    from device_agent.executor import ScheduleExecutor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.Flatten(), nn.Linear(16 * 8 * 8, CLASSES))
    bundle = _bundle(model, (BATCH, 16, 8, 8))
    traced = trace_model(bundle, granularity="layer")
    schedule = make_schedule(traced.graph, lower_plan(keep_all_plan(traced.graph), traced.graph))
    partition = partition_from_traced(traced)
    expected = replay(partition.nodes, schedule.instructions, graph_label="conv").peak_ram_bytes
    with ScheduleExecutor(partition, schedule, flash_dir=tmp_path) as executor:
        peaks = [executor.train_step(bundle.inputs, bundle.labels).peak_tracked_bytes for _ in range(3)]
    assert peaks[0] >= expected > max(replay(partition.nodes, schedule.instructions, graph_label="c").ram_timeline_bytes)
    assert peaks[1] == peaks[2] >= expected


def test_a_trace_inside_the_caller_s_profiler_warns_and_measures_no_workspace():
    """torch.profiler sessions do not nest: the trace says it could not measure, instead of failing."""
    torch.manual_seed(0)
    bundle = _smoothed_bundle()  # its loss backward has a workspace
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as callers, \
            pytest.warns(RuntimeWarning, match="workspaces not measured"):
        traced = trace_model(bundle, granularity="layer")
    assert all(n.workspace_bytes == 0 for n in traced.graph.nodes)
    assert len(callers.events()) > 0  # the caller's session was left running
    assert next(n for n in trace_model(bundle, granularity="layer").graph.nodes
                if n.name == "bwd:loss").workspace_bytes >= BATCH * CLASSES * 4  # the lock was released
