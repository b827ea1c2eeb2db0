"""The executor against eager PyTorch: every schedule kind on mlp, resnet18_cifar and hf_bert.

Each case trains a few steps under the schedule and plainly from the same seed and data, then checks
parameters (and buffers), the counters against the schedule, and the tracked peak against the budget.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import pytest
import torch

from device_agent.executor import (
    EventStream,
    InvalidScheduleError,
    MissingTensorError,
    PageCorruptError,
    ScheduleExecutor,
    ScheduleMismatchError,
)
from device_agent.schedule import Instruction
from host.costs import load_profile, price_graph
from host.graph.partition import partition_from_traced
from host.graph.trace import trace_model
from host.graph.zoo import get_model_spec
from host.solver.solve import SolveOptions, no_remat_peak_bytes, solve_schedule
from tests.device_agent.executor.helpers import (
    case,
    param_diff,
    run_plain,
    run_scheduled,
    schedule_for,
    without,
)

pytest.importorskip("transformers")

STEPS = 3
CASES = [
    (model, kind, optimizer)
    for model in ("mlp", "resnet18_cifar", "hf_bert")
    for kind, optimizer in (("none", "sgd"), ("remat", "adamw"), ("paging", "sgd"), ("mixed", "adamw"))
]


def _check_kind(model: str, kind: str, counts: dict) -> None:
    recomputes, page_ins = counts["recomputes"], counts["page_ins"]
    expected = {"none": (False, False), "remat": (True, False), "paging": (False, True), "mixed": (True, True)}[kind]
    if model == "mlp" and kind == "mixed":
        # a 3-layer chain has no budget where both pay off (its batch is fixed bytes, not a free recompute)
        assert recomputes + page_ins > 0, f"{kind} schedule has counts {counts}"
        return
    assert (recomputes > 0, page_ins > 0) == expected, f"{kind} schedule has counts {counts}"


# resnet18_cifar's and hf_bert's keep-all cases, and resnet18_cifar's remat case (4-8 s each), run in make test only:
# make test-fast keeps their paging and mixed cases and every mlp case
_SLOW_CASES = {("resnet18_cifar", "none"), ("resnet18_cifar", "remat"), ("hf_bert", "none")}


@pytest.mark.parametrize("model,kind,optimizer", [
    pytest.param(m, k, o, id=f"{m}-{k}-{o}", marks=[pytest.mark.slow] if (m, k) in _SLOW_CASES else [])
    for m, k, o in CASES
])
def test_schedule_matches_plain_pytorch(model, kind, optimizer, tmp_path):
    current = case(model)
    schedule, budget = schedule_for(model, kind)
    _check_kind(model, kind, schedule.counts())
    events = EventStream()
    leftovers = []

    def page_files():  # the page directory stays between steps, empty but for its owner lock
        return [path.name for path in tmp_path.rglob("*") if path.is_file() and path.name != "owner.lock"]

    events.subscribe(lambda e: leftovers.extend(page_files()) if e.type == "step" else None)
    results = run_scheduled(current, schedule, steps=STEPS, optimizer=optimizer, flash_dir=tmp_path, events=events)
    assert leftovers == []  # no page file on flash after a step
    assert os.listdir(tmp_path) == []  # and nothing at all once the executor is closed
    plain, plain_losses = run_plain(current, steps=STEPS, optimizer=optimizer)

    relative, bitwise = param_diff(current.bundle.module, plain.module)
    assert relative <= 1e-6, f"{model}/{kind}: parameters differ from plain PyTorch by {relative:.3g} (relative)"
    if model == "mlp":
        assert bitwise, "mlp runs only deterministic ops: the parameters must be bitwise equal"
    assert [r.loss for r in results] == pytest.approx(plain_losses, rel=1e-6)

    planned = schedule.counts()
    nodes = current.partition.nodes
    per_node = Counter(ins.node for ins in schedule.instructions if ins.kind == "compute")
    fwd_computes = sum(n for node, n in per_node.items() if nodes[node].kind != "bwd")
    for result in results:
        counters = result.counters
        assert counters.plan_counts() == {k: planned[k] for k in ("computes", "recomputes", "page_ins", "page_outs")}
        assert counters.computes_per_node == per_node
        assert counters.program_runs == fwd_computes  # no forward ran outside a compute instruction
        assert counters.backward_runs == counters.computes - fwd_computes
        assert counters.saved_tensor_reads > 0
        assert result.peak_tracked_bytes <= budget
        assert result.peak_tracked_bytes <= schedule.prediction.peak_ram_bytes

    instruction_events = events.instructions()
    assert len(instruction_events) == STEPS * len(schedule.instructions)
    assert len(events.steps()) == STEPS


@pytest.mark.parametrize("node_functions", [False, True], ids=["autograd", "node-functions"])
@pytest.mark.parametrize("model", ["mlp", "resnet18_cifar", "hf_bert"])
def test_first_compute_stores_exactly_the_traced_bytes(model, node_functions, tmp_path):
    """A fwd node's entry (outputs + what its backward saved) has the bytes the solver priced: exactly under
    autograd, whose saved tensors the trace measures; never more with node functions (hf_bert's dropout keeps
    a bool mask where eager autograd keeps a float one, so less)."""
    current = case(model)
    schedule, _ = schedule_for(model, "none")
    events = EventStream()
    run_scheduled(current, schedule, steps=1, optimizer="sgd", flash_dir=tmp_path, events=events,
                  node_functions=node_functions)
    nodes = current.partition.nodes
    for event in events.instructions():
        if event.kind == "compute" and nodes[event.node].kind != "bwd":
            if node_functions and model == "hf_bert":
                assert event.bytes_moved <= nodes[event.node].output_bytes, event.node_name
            else:
                assert event.bytes_moved == nodes[event.node].output_bytes, event.node_name
        if event.kind == "compute" and nodes[event.node].kind == "bwd":
            assert event.bytes_moved <= nodes[event.node].output_bytes, event.node_name


def test_recompute_replays_the_dropout_mask(tmp_path):
    current = case("hf_bert")
    schedule, _ = schedule_for("hf_bert", "remat")
    recomputed = {i.node for i in schedule.instructions if i.kind == "compute"} & {
        p.index for p in current.partition.programs.values() if p.random
    }
    counts = Counter(i.node for i in schedule.instructions if i.kind == "compute")
    assert any(counts[node] > 1 for node in recomputed), "the schedule should recompute a dropout node"
    run_scheduled(current, schedule, steps=2, optimizer="adamw", flash_dir=tmp_path)
    plain, _ = run_plain(current, steps=2, optimizer="adamw")
    assert param_diff(current.bundle.module, plain.module)[0] <= 1e-6
    # Control: without replaying the RNG state the recomputed mask differs and so do the parameters.
    run_scheduled(current, schedule, steps=2, optimizer="adamw", flash_dir=tmp_path,
                  partition=without(current.partition, random=False))
    assert param_diff(current.bundle.module, plain.module)[0] > 1e-6


def test_recompute_updates_batchnorm_statistics_once(tmp_path):
    current = case("resnet18_cifar")
    schedule, _ = schedule_for("resnet18_cifar", "remat")
    counts = Counter(i.node for i in schedule.instructions if i.kind == "compute")
    with_buffers = {p.index for p in current.partition.programs.values() if p.buffers}
    assert any(counts[node] > 1 for node in with_buffers), "the schedule should recompute a BatchNorm node"
    # Under autograd, whose buffer snapshots the control below turns off (node functions return the new
    # statistics instead, applied on first computes only: test_node_functions checks their buffers).
    run_scheduled(current, schedule, steps=2, optimizer="sgd", flash_dir=tmp_path, node_functions=False)
    plain, _ = run_plain(current, steps=2, optimizer="sgd")
    for (name, a), (_, b) in zip(current.bundle.module.named_buffers(), plain.module.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    # Control: a recompute that keeps its buffer updates moves the running statistics twice.
    run_scheduled(current, schedule, steps=2, optimizer="sgd", flash_dir=tmp_path, node_functions=False,
                  partition=without(current.partition, buffers=()))
    differs = [name for (name, a), (_, b) in zip(current.bundle.module.named_buffers(), plain.module.named_buffers(),
                                                 strict=True) if not torch.equal(a, b)]
    assert any("running_mean" in name for name in differs)


# ----------------------------------------------------------------------------- bad input
def _schedule_copy(schedule, **changes):
    return dataclasses.replace(schedule, **changes)


def test_unknown_node_is_rejected_before_training(tmp_path):
    current = case("mlp")
    schedule, _ = schedule_for("mlp", "none")
    bad = _schedule_copy(schedule, instructions=[*schedule.instructions[:3], Instruction("compute", 999)])
    with pytest.raises(InvalidScheduleError, match="unknown node 999"):
        ScheduleExecutor(current.partition, bad, flash_dir=str(tmp_path))


def test_schedule_breaking_a_dependency_is_rejected(tmp_path):
    current = case("mlp")
    schedule, _ = schedule_for("mlp", "none")
    bad = _schedule_copy(schedule, instructions=[Instruction("compute", 2), *schedule.instructions])
    with pytest.raises(InvalidScheduleError, match="needs"):
        ScheduleExecutor(current.partition, bad, flash_dir=str(tmp_path))


def test_schedule_for_another_trace_is_rejected(tmp_path):
    current = case("mlp")
    schedule, _ = schedule_for("mlp", "none")
    with pytest.raises(ScheduleMismatchError, match="fingerprint"):
        ScheduleExecutor(current.partition, _schedule_copy(schedule, graph_fingerprint="0123456789abcdef"))


def test_paging_schedule_needs_a_flash_dir(tmp_path):
    from device_agent.executor import ExecutorError, FlashDirError

    current = case("mlp")
    schedule, _ = schedule_for("mlp", "paging")
    with pytest.raises(ExecutorError, match="flash"):
        ScheduleExecutor(current.partition, schedule)
    with pytest.raises(FlashDirError, match="does not exist"):
        ScheduleExecutor(current.partition, schedule, flash_dir=str(tmp_path / "missing"))


def test_corrupted_page_fails_the_step_and_leaves_nothing(tmp_path):
    current = case("resnet18_cifar")
    schedule, _ = schedule_for("resnet18_cifar", "paging")
    events = EventStream()
    current.reset()
    before = {k: v.clone() for k, v in current.bundle.module.state_dict().items()}
    with ScheduleExecutor(current.partition, schedule, flash_dir=str(tmp_path), events=events) as executor:

        def corrupt(event) -> None:
            if getattr(event, "kind", None) == "page_out":
                path = executor.pages.path_of(event.node)
                with open(path, "r+b") as handle:
                    handle.seek(100)
                    byte = handle.read(1)
                    handle.seek(100)
                    handle.write(bytes([byte[0] ^ 0xFF]))

        events.subscribe(corrupt)
        with pytest.raises(PageCorruptError, match="corrupted") as raised:
            executor.train_step(current.bundle.inputs, current.bundle.labels)
        first_page_in = next(i.node for i in schedule.instructions if i.kind == "page_in")
        assert repr(current.partition.nodes[first_page_in].name) in str(raised.value)
        assert os.listdir(tmp_path) == []  # no page file, no temporary file, no directory
        assert len(executor.ram) == 0
        assert all(p.grad is None for p in current.bundle.module.parameters())
    after = current.bundle.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BatchNorm statistics rolled back
    assert os.listdir(tmp_path) == []


def test_full_flash_fails_the_page_out_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    from device_agent.executor import FlashFullError, page_store

    current = case("mlp")
    schedule, _ = schedule_for("mlp", "paging")
    current.reset()
    written = []

    def storage_bytes_until_full(storage):
        # the page's header is already in its temporary file when the device fills up
        written.append(storage.nbytes())
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(page_store, "storage_bytes", storage_bytes_until_full)
    with ScheduleExecutor(current.partition, schedule, flash_dir=str(tmp_path)) as executor:
        with pytest.raises(FlashFullError, match="full"):
            executor.train_step(current.bundle.inputs, current.bundle.labels)
        assert os.listdir(tmp_path) == []
    assert os.listdir(tmp_path) == []


def test_a_missing_saved_tensor_is_an_error_not_a_silent_recompute(tmp_path):
    """If a schedule drops a tensor a backward saved, the executor says so instead of recomputing it."""
    current = case("mlp")
    schedule, _ = schedule_for("mlp", "none")
    nodes = current.partition.nodes
    bwd = next(n for n in nodes if n.kind == "bwd" and n.name == "bwd:0")
    saved_from = [d for d in bwd.deps if nodes[d].kind != "bwd"]
    assert saved_from
    # A partition that (wrongly) says the backward needs no saved tensor, and a schedule freeing it early.
    lying = list(nodes)
    lying[bwd.index] = dataclasses.replace(bwd, deps=tuple(d for d in bwd.deps if d not in saved_from))
    partition = dataclasses.replace(current.partition, nodes=lying)
    instructions = [i for i in schedule.instructions if not (i.kind == "free" and i.node in saved_from)]
    at = next(k for k, i in enumerate(instructions) if i.kind == "compute" and i.node == bwd.index)
    instructions[at:at] = [Instruction("free", d, "ram") for d in saved_from]
    bad = _schedule_copy(schedule, instructions=instructions, nodes=[])
    current.reset()
    with ScheduleExecutor(partition, bad, flash_dir=str(tmp_path)) as executor:
        with pytest.raises(MissingTensorError, match=repr(nodes[saved_from[0]].name)):
            executor.train_step(current.bundle.inputs, current.bundle.labels)
        assert len(executor.ram) == 0


def test_keep_all_forward_holds_what_autograd_saves(tmp_path):
    """At layer granularity the keep-all schedule holds, at the end of the forward, exactly the activations
    eager autograd saves: a BatchNorm output is not kept for a backward that never reads it, and the pinned
    statistics are the only bytes held outside the schedule."""
    bundle = get_model_spec("resnet18_cifar").bundle(2, seed=0)
    traced = trace_model(bundle, granularity="layer")
    priced = price_graph(traced.graph, load_profile("a72"))
    schedule = solve_schedule(priced, SolveOptions(ram_budget_bytes=no_remat_peak_bytes(priced))).schedule
    events = EventStream()
    with ScheduleExecutor(partition_from_traced(traced), schedule, events=events) as executor:
        executor.train_step(bundle.inputs, bundle.labels)
        pinned = executor.peak_pinned_bytes
    instructions = events.instructions()
    first_backward = next(i for i, e in enumerate(instructions) if e.node_kind == "bwd")
    held_after_forward = instructions[first_backward - 1].ram_in_use_bytes

    plain = get_model_spec("resnet18_cifar").bundle(2, seed=0)
    held_by_caller = (*plain.module.parameters(), *plain.module.buffers(), plain.labels, *plain.inputs)
    fixed = {t.untyped_storage().data_ptr() for t in held_by_caller}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in fixed:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        plain.loss_fn(plain.module(*plain.inputs), plain.labels)
    assert pinned > 0
    loss_scalar_bytes = 4  # the loss node also holds its output, the float32 loss
    assert held_after_forward + pinned == sum(saved.values()) + loss_scalar_bytes
    assert sum(g.pinned_bytes for g in traced.groups) == pinned
