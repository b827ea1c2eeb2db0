"""The work the executor really does, measured independently of its counters and of the schedule.

``test_executor`` compares the executor's counters with the schedule, both derived from the same
instruction list. Here the work is observed where it happens:

- aten ops, counted by a ``TorchDispatchMode`` and attributed to the instruction that ran them (an
  event subscriber snapshots the counts after each instruction), and to inside or outside a node's
  program (forward hooks on the program modules). The first computes of the forward nodes must run
  exactly the ops of a plain eager forward, each recompute exactly the ops of its node's first run,
  the backward computes exactly the ops of the eager backward, and nothing else does any work;
- bytes written to and read from page files, from the kernel's per-process I/O counters
  (``/proc/self/io`` wchar and rchar), against each paged node's bytes plus the page file's header.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from device_agent.executor import EventStream, ScheduleExecutor
from tests.device_agent.executor.helpers import case, schedule_for

# Ops that move no data and compute nothing of the model's: views over the stores' storages (empty + set_),
# autograd's detach when it saves an output, the loss's seed gradient (ones), hollow leaves (zeros, expand),
# reading the loss (_local_scalar_dense), restoring buffer snapshots (copy_).
BOOKKEEPING = {
    "aten.empty.memory_format", "aten.set_.source_Storage_storage_offset", "aten.detach.default",
    "aten.ones.default", "aten.ones_like.default", "aten.zeros.default", "aten.expand.default",
    "aten._local_scalar_dense.default", "aten.copy_.default",
}
# A page file: magic u64, node u32, storage count u32, payload bytes u64, one u64 per storage; CRC u32, "END\0".
PAGE_HEADER_BYTES, PAGE_SIZE_FIELD_BYTES, PAGE_TRAILER_BYTES = 24, 8, 8
STATM_READ_MAX_BYTES = 128  # the RSS sampler's pread of /proc/self/statm after each instruction

CASES = [(model, kind) for model in ("mlp", "resnet18_cifar") for kind in ("none", "remat", "paging", "mixed")]
# resnet18_cifar's none/remat/paging cases take 5-10 s each: make test runs them, make test-fast keeps its
# mixed case (recompute and paging at once) beside mlp's four
FAST_CASES = [
    pytest.param(model, kind, id=f"{model}-{kind}",
                 marks=[pytest.mark.slow] if model == "resnet18_cifar" and kind != "mixed" else [])
    for model, kind in CASES
]


class _OpCounter(TorchDispatchMode):
    """Counts every aten op by name: inside a node program (``depth`` > 0) or outside."""

    def __init__(self) -> None:
        super().__init__()
        self.inside: Counter = Counter()
        self.outside: Counter = Counter()
        self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.inside if self.depth else self.outside)[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def enter(self, *_) -> None:
        self.depth += 1

    def leave(self, *_) -> None:
        self.depth -= 1


def _work(ops: Counter) -> Counter:
    return Counter({op: n for op, n in ops.items() if op not in BOOKKEEPING and n})


def _eager_ops(current) -> tuple[Counter, Counter]:
    """(forward ops, backward ops) of one plain eager step of a fresh copy of the model."""
    plain = current.plain_bundle()
    with _OpCounter() as counter:
        counter.depth = 1
        loss = plain.loss_fn(plain.module(*plain.inputs), plain.labels)
        counter.depth = 0
        loss.backward()
    return _work(counter.inside), _work(counter.outside)


def _read_io() -> tuple[dict[str, int], int]:
    """This process's I/O counters, and how many bytes this read itself returned (rchar counts it next time)."""
    with open("/proc/self/io", "rb", buffering=0) as handle:
        data = handle.read()
    return {k.decode(): int(v) for k, v in (line.split(b": ") for line in data.splitlines())}, len(data)


@pytest.mark.parametrize("model,kind", CASES, ids=[f"{m}-{k}" for m, k in CASES])
def test_ops_and_page_bytes_match_eager_and_the_schedule(model, kind, tmp_path):
    if not os.path.exists("/proc/self/io"):
        pytest.skip("needs Linux's /proc/self/io")
    current = case(model)
    schedule, _ = schedule_for(model, kind)
    partition = current.partition
    nodes = partition.nodes
    eager_forward, eager_backward = _eager_ops(current)

    counter = _OpCounter()
    hooks = []
    for program in partition.programs.values():
        if program.run is not None:
            hooks.append(program.run.register_forward_pre_hook(counter.enter))
            hooks.append(program.run.register_forward_hook(counter.leave))
    measured_step = 1  # step 0 warms up (one-off file reads by libraries would blur the I/O counters)
    records = []
    last = {"inside": Counter(), "outside": Counter(), "io": _read_io(), "directory": None}
    executor = None  # bound by the with statement below

    def observe(event):
        if event.type != "instruction":
            return
        io, io_read_bytes = _read_io()  # first, so the rest of this function's work falls after it
        inside, outside = Counter(counter.inside), Counter(counter.outside)
        entry = executor.ram.find(event.node) if event.kind == "page_out" else None
        directory = executor.pages.directory if executor.pages is not None else None
        new_directory = event.kind == "page_out" and directory != last["directory"]
        records.append(dict(
            event=event,
            inside=_work(inside - last["inside"]),
            outside=_work(outside - last["outside"]),
            wchar=io["wchar"] - last["io"][0]["wchar"],
            rchar=io["rchar"] - last["io"][0]["rchar"] - last["io"][1],  # minus the previous /proc/self/io read
            file_bytes=os.path.getsize(executor.pages.path_of(event.node)) if event.kind == "page_out" else None,
            entry=(entry.nbytes, len(entry.storages)) if entry is not None else None,
            # the first page-out of a step creates the page directory and writes its owner record
            owner_bytes=os.path.getsize(os.path.join(directory, "owner.lock")) if new_directory else 0,
        ))
        last.update(inside=inside, outside=outside, io=(io, io_read_bytes), directory=directory)

    events = EventStream()
    events.subscribe(observe)
    current.reset()
    try:
        # under autograd: the programs' own modules run, whose hooks mark inside and outside, and the ops are
        # eager's (node functions run functional variants: test_node_functions_do_no_hidden_work below)
        with ScheduleExecutor(partition, schedule, flash_dir=str(tmp_path), events=events,
                              node_functions=False) as executor, counter:
            for _ in range(measured_step + 1):
                records.clear()
                executor.train_step(current.bundle.inputs, current.bundle.labels)
    finally:
        for hook in hooks:
            hook.remove()
    assert [r["event"].step for r in records] == [measured_step] * len(schedule.instructions)

    # --- ops: forward
    first_run: dict[int, Counter] = {}
    program_work, forward_outside = Counter(), Counter()
    recomputed = Counter()
    for r in records:
        event = r["event"]
        is_forward_compute = event.kind == "compute" and nodes[event.node].kind != "bwd"
        if not is_forward_compute:
            assert not r["inside"], f"a node program ran during {event.kind} of {event.node_name!r}: {r['inside']}"
            continue
        forward_outside += r["outside"]
        program_work += r["inside"]
        if event.recompute:
            assert r["inside"] == first_run[event.node], f"recompute of {event.node_name!r} ran other ops"
            recomputed[event.node] += 1
        else:
            first_run[event.node] = r["inside"]
    assert not forward_outside, f"work outside any node program during forward computes: {forward_outside}"
    assert sum(first_run.values(), Counter()) == eager_forward, "first computes differ from the eager forward"
    extra = Counter()
    for node, times in recomputed.items():
        for _ in range(times):
            extra += first_run[node]
    assert program_work == eager_forward + extra  # recomputation adds exactly the recomputed nodes' ops
    if schedule.counts()["recomputes"] == 0:
        assert program_work == eager_forward

    # --- ops: backward. A bwd node's first compute also accumulates the parameter gradients; a recompute
    # of it only recomputes the gradients of its inputs: a subset of its first run's ops.
    backward_first: dict[int, Counter] = {}
    for r in records:
        event = r["event"]
        if event.kind == "compute" and nodes[event.node].kind == "bwd":
            if event.recompute:
                assert r["outside"] <= backward_first[event.node], f"recompute of {event.node_name!r}"
            else:
                backward_first[event.node] = r["outside"]
        elif event.kind != "compute":
            assert not r["outside"], f"{event.kind} of {event.node_name!r} ran ops: {r['outside']}"
    assert sum(backward_first.values(), Counter()) == eager_backward, "the backward differs from the eager one"

    # --- bytes on page files
    written = read = expected_written = expected_read = 0
    page_bytes: dict[int, int] = {}
    for r in records:
        event = r["event"]
        if event.kind == "page_out":
            payload, storages = r["entry"]
            assert payload == nodes[event.node].output_bytes  # the node's bytes, as the schedule prices them
            expected = payload + PAGE_HEADER_BYTES + PAGE_SIZE_FIELD_BYTES * storages + PAGE_TRAILER_BYTES
            assert r["wchar"] - r["owner_bytes"] == r["file_bytes"] == expected, f"page-out of {event.node_name!r}"
            page_bytes[event.node] = expected
            written += r["wchar"] - r["owner_bytes"]
            expected_written += expected
        elif event.kind == "page_in":
            expected = page_bytes[event.node]
            assert 0 <= r["rchar"] - expected <= STATM_READ_MAX_BYTES, f"page-in of {event.node_name!r}"
            read += r["rchar"]
            expected_read += expected
        else:
            assert r["wchar"] == 0 and r["rchar"] <= STATM_READ_MAX_BYTES, f"{event.kind} of {event.node_name!r} did I/O"
    counts = schedule.counts()
    assert len(page_bytes) == counts["page_outs"] == sum(1 for r in records if r["wchar"] > 0)
    assert written == expected_written
    assert 0 <= read - expected_read <= STATM_READ_MAX_BYTES * counts["page_ins"]
    if kind in ("paging", "mixed"):
        assert written > 0 and read >= expected_read > 0


def _step_work(executor, current) -> tuple[list, Counter, int, object]:
    """Step 1 of ``executor`` (step 0 captures the node functions): ops per instruction when ``observe`` sees
    events synchronously, the step's ops, and the bytes it wrote."""
    counter = _OpCounter()
    per_instruction: list = []
    last = Counter()

    def observe(event):
        nonlocal last
        if event.type == "instruction":
            now = Counter(counter.outside)
            per_instruction.append((event, _work(now - last)))
            last = now

    executor.events.subscribe(observe)
    executor.train_step(current.bundle.inputs, current.bundle.labels)
    per_instruction.clear()
    with counter:
        wchar = _read_io()[0]["wchar"]
        result = executor.train_step(current.bundle.inputs, current.bundle.labels)
        wchar = _read_io()[0]["wchar"] - wchar
    return per_instruction, _work(counter.outside), wchar, result


@pytest.mark.parametrize("model,kind", FAST_CASES)
def test_node_functions_do_no_hidden_work(model, kind, tmp_path):
    """With node functions, interpreted (instrumented: events as each instruction ends) a recompute runs exactly
    its node's first run, frees and page transfers run no op; the lowered program runs exactly the same ops and
    writes exactly the same page bytes as that interpreted step."""
    if not os.path.exists("/proc/self/io"):
        pytest.skip("needs Linux's /proc/self/io")
    current = case(model)
    schedule, _ = schedule_for(model, kind)
    nodes = current.partition.nodes
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    current.reset()
    with ScheduleExecutor(current.partition, schedule, flash_dir=str(tmp_path / "a"), events=EventStream(keep=False),
                          instrumented=True) as executor:
        per_instruction, interpreted, interpreted_written, result = _step_work(executor, current)
        assert not result.lowered and not executor.autograd_nodes
    assert len(per_instruction) == len(schedule.instructions)
    first_run: dict[int, Counter] = {}
    for event, work in per_instruction:
        if event.kind != "compute":
            assert not work, f"{event.kind} of {event.node_name!r} ran ops: {work}"
        elif event.recompute and nodes[event.node].kind != "bwd":
            assert work == first_run[event.node], f"recompute of {event.node_name!r} ran other ops"
        elif event.recompute:
            assert work <= first_run[event.node], f"recompute of {event.node_name!r}"
        else:
            first_run[event.node] = work
    assert sum((work for _, work in per_instruction), Counter()) <= interpreted  # + the optimizer's
    current.reset()
    with ScheduleExecutor(current.partition, schedule, flash_dir=str(tmp_path / "b"),
                          events=EventStream(keep=False)) as executor:
        _, lowered, lowered_written, result = _step_work(executor, current)
        assert result.lowered
    assert lowered == interpreted
    assert lowered_written == interpreted_written
    assert (lowered_written > 0) == (schedule.counts()["page_outs"] > 0)
