"""Run a POET Schedule on a real model: every compute, page-out, page-in and free, and nothing else.

Two ways to run a node, both exact (bitwise equal to plain PyTorch where the kernels are deterministic):

- **Node functions** (the default): a fwd/loss node runs as the forward and backward functions of
  ``node_functions.py``, cut from its joint forward-backward graph, without autograd. The forward returns the
  tensors its backward reads; each is classified by where it lives (the node's own entry, the entry of the
  input it views, or fixed: a parameter, buffer or label, or a pinned internal) and held exactly there, so
  freeing an entry really releases it; a page-in rebuilds it byte for byte. The backward takes them with the
  output gradients and returns every gradient. The first step of a batch shape runs instruction by
  instruction and captures the functions; every later step runs as one straight-line program generated from
  the instructions (``lowering.py``).
- **Autograd**: a node whose program cannot be split exactly (or whose functions would hold more bytes than
  the trace priced), or every node with ``node_functions=False``, runs under autograd with
  ``saved_tensors_hooks``: each tensor autograd saves is replaced by a handle naming where it lives, and its
  bwd node runs ``torch.autograd.grad`` on the node's graph with the upstream gradients read from its
  consumers' bwd entries.

Either way every saved tensor is read back from the RAM store, and a missing one is an error rather than a
silent recomputation. Recomputation is invisible to the mathematics: a recomputed program replays the RNG
state of its first run (same dropout mask) and its buffer updates are undone or not applied (BatchNorm
statistics move once per step).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from device_agent.executor.allocator import malloc_trim
from device_agent.executor.errors import BudgetExceededError, ExecutorError, InvalidScheduleError, MissingTensorError
from device_agent.executor.lowering import (
    BackwardNote,
    ForwardNote,
    LoweredStep,
    LoweringNotes,
    LoweringRuntime,
    lower_step,
)
from device_agent.executor.node_functions import NodeCaptureError, NodeFunctions, capture_node_functions
from device_agent.executor.page_store import (
    FlashPageStore,
    PageStoreError,
    StalePageDir,
    check_flash_space,
    remove_stale_page_dirs,
)
from device_agent.executor.partition import Partition, unique_by_identity
from device_agent.executor.plan import PlannedOp, plan_schedule
from device_agent.executor.ram_store import EntryBuilder, RamStore, StorageKey, storage_key
from device_agent.executor.results import Counters, StepResult, copy_counters
from device_agent.executor.saved import (
    GraphRecord,
    Packer,
    Saved,
    SavedRecord,
    accumulate_grad,
    hollow,
    place_saved,
)
from device_agent.executor.telemetry import EventStream, InstructionEvent, StepSummary
from device_agent.meters.base import EnergyMeter
from device_agent.meters.memory import RssSampler
from device_agent.meters.modelled import ModelledEnergyMeter
from device_agent.replay import RELATIVE_SLACK
from device_agent.schedule import Schedule


# ----------------------------------------------------------------------------- one step's state
@dataclass
class _Step:
    """What the instructions of one training step share: made by ``train_step``, gone with it."""

    inputs: tuple[torch.Tensor, ...]
    labels: torch.Tensor
    loss_divisor: int  # micro-batches per optimizer step (gradient accumulation)
    fixed_keys: set[StorageKey] = field(default_factory=set)  # of parameters, buffers, constants, labels (interpreted)
    counters: Counters = field(default_factory=Counters)
    loss: float = float("nan")
    rng_states: dict[int, torch.Tensor] = field(default_factory=dict)  # random node -> RNG state of its first run
    hook_error: BaseException | None = None  # raised inside autograd's unpack hook, re-raised as is
    position: int = 0  # of the instruction running
    notes: LoweringNotes | None = None  # what the lowering needs, noted when this step is to be lowered


# ----------------------------------------------------------------------------- executor
class ScheduleExecutor:
    """Trains ``partition``'s model one step at a time, following ``schedule`` instruction by instruction.

    ``flash_dir`` is needed when the schedule pages. Use as a context manager (or call :meth:`close`)
    so the page directory is removed.

    Pre-flight, before any training: the schedule is replayed (:func:`check_schedule`); page directories
    that killed runs left in ``flash_dir`` are removed (each reported on ``log`` and listed in
    :attr:`stale_page_dirs`), also when this schedule does not page; and when it pages, ``flash_dir``
    must have free space for the schedule's peak of page files, or FlashSpaceError (a FlashFullError)
    is raised naming the bytes needed and free.
    """

    def __init__(
        self,
        partition: Partition,
        schedule: Schedule,
        *,
        flash_dir: str | None = None,
        events: EventStream | None = None,
        energy_meter: ModelledEnergyMeter | EnergyMeter | None = None,
        enforce_budget: bool = False,
        drop_page_cache: bool = True,
        return_freed_memory: bool = False,
        instrumented: bool = False,
        node_functions: bool = True,
        inductor: bool = False,
        overlap_paging: bool = True,
        log: Callable[[str], None] | None = None,
    ):
        self.partition = partition
        self.schedule = schedule
        self.ops, trace = plan_schedule(partition, schedule)
        self.peak_flash_bytes = trace.peak_flash_bytes  # payload bytes the schedule keeps on flash at once
        self.flash_needed_bytes = 0  # with page-file overhead; checked against the free space
        self.ram_budget_bytes = float(schedule.ram_budget_bytes or 0.0)
        self.enforce_budget = enforce_budget
        # Per-instruction CPU time and energy (two meter readings each) for every instruction, not only for the
        # page transfers: calibration fits wall times and the transfers' CPU share, so training needs neither.
        self.instrumented = instrumented
        # Without a stream of the caller's, only step summaries are kept (instruction events cost time to make)
        self.events = events if events is not None else EventStream(keep=False)
        self.energy_meter = energy_meter
        self.rss = RssSampler()
        self.ram = RamStore()
        self.pages: FlashPageStore | None = None
        self.stale_page_dirs: list[StalePageDir] = []  # left by dead runs, removed from flash_dir here
        if any(op.kind == "page_out" for op in self.ops):
            if flash_dir is None:
                raise ExecutorError("the schedule pages to flash: pass a flash directory (--flash-dir)")
            self.pages = FlashPageStore(flash_dir, drop_cache=drop_page_cache, log=log)
            self.stale_page_dirs = self.pages.stale_removed
            self.flash_needed_bytes = check_flash_space(flash_dir, trace.peak_flash_bytes, trace.peak_flash_pages)
        elif flash_dir is not None:
            self.stale_page_dirs = remove_stale_page_dirs(flash_dir, log=log)
        self._trim = malloc_trim() if return_freed_memory else None
        self.step_index = 0
        self._records: dict[int, GraphRecord | SavedRecord] = {}
        # node_functions (the default): fwd/loss nodes run as forward and backward functions without autograd,
        # captured at their first compute (node_functions.py), and later steps as one straight-line program
        # (lowering.py). A node whose program AOTAutograd cannot split exactly, or whose functions would hold
        # more bytes than the trace priced (the schedule's budget rests on them), runs under autograd instead
        # (listed in autograd_nodes, with the reason). node_functions=False runs every node under autograd.
        self.node_functions = node_functions
        # inductor: node functions run inductor's fused kernels (device_agent.executor.inductor): faster on nodes
        # with work to fuse, not bitwise eager; every schedule still computes the same as keep-all
        self.inductor = inductor
        # lowered steps run page transfers on an I/O thread behind compute (lowering.LoweringRuntime)
        self.overlap_paging = overlap_paging
        self._functions: dict[int, NodeFunctions | None] = {}
        self.autograd_nodes: dict[int, str] = {}  # node -> why it runs under autograd
        # With node functions, every step after the first of a batch shape runs as one straight-line program
        # (lowering.py), generated from what that first, interpreted step noted.
        self._shape_key: tuple | None = None
        self._lowered: LoweredStep | None = None
        self._lowered_counters = Counters()
        self._lowered_peak_pinned_bytes = 0
        self._lowered_state: _Step | None = None
        self._log = log
        self.pinned_bytes = 0  # pinned internals held by live graphs (fixed bytes, outside the schedule)
        self.peak_pinned_bytes = 0
        self._buffers = unique_by_identity(b for p in partition.programs.values() for b in p.buffers)
        self._buffer_copies = [b.detach().clone() for b in self._buffers]  # for rollback after a failed step
        self._recompute_copies = {  # a recompute restores its program's buffers from these
            index: [b.detach().clone() for b in program.buffers]
            for index, program in partition.programs.items()
            if program.buffers
        }

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Drop every tensor and remove the page directory. Idempotent; safe on an exception path."""
        if self._lowered is not None:
            self._lowered.runtime.close()
        self._drop_records()
        self.ram.clear()
        if self.pages is not None:
            self.pages.close()

    def __enter__(self) -> ScheduleExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ one step
    def train_step(
        self,
        inputs: tuple[torch.Tensor, ...],
        labels: torch.Tensor,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        micro_batch: int = 0,
        micro_batches: int = 1,
    ) -> StepResult:
        """Forward, loss and backward under the schedule, then ``optimizer.step()`` (when given).

        Gradient accumulation, as eager ``(loss / micro_batches).backward()`` per micro-batch: micro-batch 0
        starts from no gradients, later ones add to them, and only the last one steps the optimizer.
        """
        if not 0 <= micro_batch < micro_batches:
            raise ExecutorError(f"micro-batch {micro_batch} of {micro_batches}: expected 0 <= micro_batch < micro_batches")
        partition = self.partition
        if len(inputs) != len(partition.batch_values):
            raise ExecutorError(f"model {partition.name!r} takes {len(partition.batch_values)} input(s), got {len(inputs)}")
        state = _Step(tuple(inputs), labels, micro_batches)
        if micro_batch == 0:
            for param in partition.parameters:
                param.grad = None
        if self._buffers:
            with torch.no_grad():  # persistent copies: no allocation per step
                for copy, buffer in zip(self._buffer_copies, self._buffers, strict=True):
                    copy.copy_(buffer)
        meter = self.energy_meter
        meter_read = meter.read if meter is not None else ModelledEnergyMeter.read
        shape_key = _shape_key(state.inputs, labels)
        if shape_key != self._shape_key:  # functions and programs are traced for one shape of batch
            self._functions.clear()
            self.autograd_nodes.clear()
            if self._lowered is not None:
                self._lowered.runtime.close()
            self._lowered = None
            self._shape_key = shape_key
        lowered = self._lowered
        if lowered is None:
            self._prepare_interpreted(state)
            if self._lowering_wanted():
                state.notes = LoweringNotes()
        start = meter_read()
        started = time.perf_counter()
        try:
            if lowered is not None:
                compute_s, paging_s, rss_peak = self._run_lowered(lowered, state)
                peak_tracked_bytes = lowered.peak_tracked_bytes
            else:
                compute_s, paging_s, rss_peak = self._interpret(state, meter, meter_read)
                peak_tracked_bytes = self.ram.peak_bytes
            t0 = time.perf_counter()
            if optimizer is not None and micro_batch == micro_batches - 1:
                optimizer.step()
            optimizer_s = time.perf_counter() - t0
        except BaseException:
            self._abort()
            raise
        duration_s = time.perf_counter() - started
        end = meter_read()  # then energy_j and source: a meter lost meanwhile is labelled with this reading
        energy_j = cpu_s = None
        if self.energy_meter is not None:
            energy_j, cpu_s = self.energy_meter.energy_j(start, end, paging_s)
        counters = state.counters
        step = self.step_index
        if state.notes is not None and self._lowerable():  # from the next step on, the straight-line program
            self._lowered = lower_step(
                partition, self.ops, self._functions, state.notes,
                LoweringRuntime(partition, self.pages, meter_read, self.rss.rss_bytes), self._plain_run,
                accumulate_grad, trim=self._trim, ram_budget_bytes=self.ram_budget_bytes,
                overlap=self.overlap_paging)
            self._lowered_counters = counters
            self._lowered_peak_pinned_bytes = self.peak_pinned_bytes
        summary = StepSummary(
            step=step,
            duration_s=duration_s,
            loss=state.loss,
            peak_tracked_bytes=peak_tracked_bytes,
            peak_pinned_bytes=self.peak_pinned_bytes,
            ram_budget_bytes=self.ram_budget_bytes,
            fixed_bytes=int(self.schedule.fixed_bytes),
            computes=counters.computes,
            recomputes=counters.recomputes,
            page_ins=counters.page_ins,
            page_outs=counters.page_outs,
            frees=counters.frees_ram + counters.frees_flash,
            bytes_paged_out=counters.bytes_paged_out,
            bytes_paged_in=counters.bytes_paged_in,
            compute_s=compute_s,
            paging_s=paging_s,
            optimizer_s=optimizer_s,
            cpu_s=cpu_s if cpu_s is not None else max(end.cpu_s - start.cpu_s, 0.0),
            energy_j=energy_j,
            energy_source=self.energy_meter.source if self.energy_meter is not None else "",
            rss_peak_bytes=rss_peak,
            program_runs=counters.program_runs,
            backward_runs=counters.backward_runs,
            saved_tensor_reads=counters.saved_tensor_reads,
        )
        self.events.emit(summary)
        self.step_index += 1
        return StepResult(step, state.loss, duration_s, peak_tracked_bytes, counters, summary, lowered is not None)

    # ------------------------------------------------------------------ the two ways to run a step
    def _prepare_interpreted(self, state: _Step) -> None:
        """What only the interpreted step needs: fixed storages, empty records, the store's peak reset."""
        partition = self.partition
        state.fixed_keys = {k for t in (*partition.fixed_tensors, state.labels) if (k := storage_key(t)) is not None}
        self._drop_records()
        self.peak_pinned_bytes = 0
        self.ram.reset_peak()
        # The caller holds the batch all step: its bytes are fixed (the trace prices the input node at 0).
        self.ram.fixed_storages = frozenset(k for t in state.inputs if (k := storage_key(t)) is not None)

    def _interpret(self, state: _Step, meter, meter_read) -> tuple[float, float, int]:
        """Run the instructions one by one on the stores; returns (compute s, paging s, peak RSS bytes)."""
        compute_s = paging_s = 0.0
        step = self.step_index
        nodes = self.partition.nodes
        instrumented = self.instrumented
        rss_bytes = rss_peak = self.rss.rss_bytes()
        notes = state.notes
        for position, op in enumerate(self.ops):
            state.position = position
            # Instrumented (or a page transfer, whose CPU share calibration fits): meter readings just
            # before and just after the instruction, for its CPU time and its energy (the meter's label
            # as of the after reading). Otherwise only the wall clock (vDSO, no system call) is read.
            transfer = op.kind == "page_in" or op.kind == "page_out"
            metered = instrumented or transfer
            before = meter_read() if metered else None
            t0 = time.perf_counter()
            if op.kind == "compute":
                moved = self._compute(op, state)
            elif op.kind == "page_out":
                moved = self._page_out(op.node, state.counters)
            elif op.kind == "page_in":
                moved = self._page_in(op.node, state.counters)
            elif op.location == "ram":
                moved = self.ram.drop(op.node)
                state.counters.frees_ram += 1
                if moved and self._trim is not None:
                    self._trim(0)
            else:
                moved = self._pages().delete(op.node)
                state.counters.frees_flash += 1
            duration_s = time.perf_counter() - t0
            if op.kind == "compute":
                compute_s += duration_s
            elif transfer:
                paging_s += duration_s
            instruction_energy_j, instruction_source, instruction_cpu_s = None, "", None
            if metered:
                instruction_energy_j, instruction_source, instruction_cpu_s = _metered(
                    meter, before, meter_read(), duration_s if transfer else 0.0)
            if instrumented or op.kind == "compute" or op.kind == "page_in":  # frees and page-outs cannot raise RSS
                rss_bytes = self.rss.rss_bytes()
                rss_peak = max(rss_peak, rss_bytes)
            # A compute also held its workspace (the temporaries the trace measured) while it ran.
            held_bytes = self.ram.hold_workspace(nodes[op.node].workspace_bytes if op.kind == "compute" else 0)
            if self.enforce_budget and self.ram_budget_bytes and (
                held_bytes > self.ram_budget_bytes * (1 + RELATIVE_SLACK)
            ):
                raise BudgetExceededError(
                    f"tracked RAM {held_bytes} bytes exceeds the budget of {self.ram_budget_bytes:.0f} "
                    f"bytes at instruction {position} ({op.kind} {nodes[op.node].name!r})"
                )
            if notes is not None:
                notes.in_use_bytes.append(self.ram.in_use_bytes)
                notes.moved_bytes.append(int(moved))
                if op.kind == "compute" and nodes[op.node].kind != "bwd":
                    notes.entry_views[op.node] = self.ram.find(op.node).views
            node = nodes[op.node]
            self.events.emit(
                InstructionEvent(
                    step, position, op.kind, op.node, node.name, node.kind, op.location, duration_s,
                    int(moved), self.ram.in_use_bytes, rss_bytes, op.recompute, instruction_cpu_s,
                    instruction_energy_j, instruction_source,
                )
            )
        if len(self.ram) or (self.pages is not None and self.pages.nodes()):
            raise ExecutorError("tensors are left in RAM or on flash at the end of the step")
        self._drop_records()
        return compute_s, paging_s, rss_peak

    def _lowering_wanted(self) -> bool:
        """Steps after the first of a batch shape run as a straight-line program, with node functions, unless
        instrumented (those read the meter around every instruction) or a node runs under autograd."""
        return self.node_functions and not self.instrumented and not self.autograd_nodes

    def _lowerable(self) -> bool:
        return self._lowering_wanted() and all(
            self._functions.get(index) is not None
            for index, program in self.partition.programs.items() if program.bwd_index is not None)

    def _run_lowered(self, lowered: LoweredStep, state: _Step) -> tuple[float, float, int]:
        """One step of the straight-line program; telemetry is made from its clock readings afterwards."""
        runtime = lowered.runtime
        runtime.begin_step()
        clock_s = [0.0] * (len(self.ops) + 1)
        rss_start = self.rss.rss_bytes()
        rss = [rss_start]
        self._lowered_state = state
        with torch.no_grad():
            loss = lowered.run(state.inputs, state.labels, state.loss_divisor, clock_s, rss)
        if self.pages is not None and self.pages.nodes():
            raise ExecutorError("tensors are left on flash at the end of the step")
        state.loss = float(loss) if loss is not None else float("nan")
        self.peak_pinned_bytes = self._lowered_peak_pinned_bytes
        ops = self.ops
        # the transfers' own time, in the I/O thread (page-file deletes are timed there too, but are not transfers)
        paging_s = sum(s for position, s in runtime.transfer_s.items() if ops[position].kind != "free")
        compute_s = 0.0
        for position in lowered.compute_positions:
            compute_s += lowered.instruction_s(position, clock_s)
        counters = self._lowered_counters
        if runtime.moved:  # page transfers: the same bytes every step of a shape, else a counters object of its own
            paged_out = sum(moved for position, moved in runtime.moved.items() if ops[position].kind == "page_out")
            paged_in = sum(moved for position, moved in runtime.moved.items() if ops[position].kind == "page_in")
            if (paged_out, paged_in) != (counters.bytes_paged_out, counters.bytes_paged_in):
                counters = copy_counters(counters)
                counters.bytes_paged_out, counters.bytes_paged_in = paged_out, paged_in
        state.counters = counters
        if self.events.wants_instructions:
            self._emit_lowered_events(lowered, clock_s, rss_start, rss[0])
        return compute_s, paging_s, max(rss_start, rss[0])

    def _emit_lowered_events(self, lowered: LoweredStep, clock_s: list[float], rss_start: int, rss_peak: int) -> None:
        """The step's instruction events, made from the program's clock readings once it has run."""
        runtime = lowered.runtime
        notes = lowered.notes
        nodes = self.partition.nodes
        meter = self.energy_meter
        step = self.step_index
        rss_bytes = rss_start
        emit = self.events.emit
        for position, op in enumerate(self.ops):
            # a page transfer's own time (it overlaps the instructions before it), else the program's clock
            duration_s = runtime.transfer_s.get(position)
            if duration_s is None:
                duration_s = lowered.instruction_s(position, clock_s)
            moved = runtime.moved.get(position, notes.moved_bytes[position])
            energy_j, source, cpu_s = None, "", None
            metered = runtime.metered.get(position)
            if metered is not None:
                energy_j, source, cpu_s = _metered(meter, metered[0], metered[1], duration_s)
            if position == lowered.rss_position:
                rss_bytes = rss_peak
            node = nodes[op.node]
            emit(InstructionEvent(
                step, position, op.kind, op.node, node.name, node.kind, op.location, duration_s, int(moved),
                lowered.in_use_bytes[position], rss_bytes, op.recompute, cpu_s, energy_j, source,
                compute_thread_s=runtime.compute_thread_s(position)))

    def _plain_run(self, index: int, recompute: bool, *fed: torch.Tensor) -> tuple:
        """A node no backward reads, as the interpreted step runs it (RNG replayed, buffers left alone on a
        recompute): for the straight-line program."""
        program = self.partition.programs[index]
        op = PlannedOp("compute", index, "ram", recompute)
        fed = [x.clone() if program.mutates_inputs and value != self.partition.label_value else x
               for value, x in zip(program.input_values, fed, strict=True)]
        restore_rng = _replay_rng(op, program, self._lowered_state)
        buffer_snapshot = None
        if recompute and program.buffers:
            buffer_snapshot = self._recompute_copies[index]
            for saved, buffer in zip(buffer_snapshot, program.buffers, strict=True):
                saved.copy_(buffer)
        try:
            outputs = program.run(*fed)
        finally:
            if restore_rng is not None:
                torch.set_rng_state(restore_rng)
            if buffer_snapshot is not None:
                for buffer, saved in zip(program.buffers, buffer_snapshot, strict=True):
                    buffer.copy_(saved)
        return tuple(output.detach() for output in outputs)

    # ------------------------------------------------------------------ instructions
    def _compute(self, op: PlannedOp, state: _Step) -> int:
        node = self.partition.nodes[op.node]
        counters = state.counters
        counters.computes += 1
        counters.recomputes += int(op.recompute)
        counters.computes_per_node[op.node] += 1
        if node.kind == "bwd":
            return self._backward(op, state)
        return self._forward(op, state)

    def _forward(self, op: PlannedOp, state: _Step) -> int:
        partition = self.partition
        program = partition.programs[op.node]
        state.counters.program_runs += 1
        if program.run is None:  # the input node: the batch itself
            builder = EntryBuilder(op.node)
            for name, tensor in zip(partition.batch_values, state.inputs, strict=True):
                builder.add_named(name, tensor)
            return self.ram.put(builder.build())
        if self.node_functions and program.bwd_index is not None:
            functions = self._functions.get(op.node, False)
            if functions is False:
                functions = self._capture(program, state)
            if functions is not None:
                return self._forward_functions(op, state, program, functions)
        fed, input_keys = self._fed(program, state)
        # Inputs require grad as in plain training even when this run's graph is dropped: some kernels
        # (matmul folding) choose their path on requires_grad, and a recompute must be bitwise the same.
        grad_inputs = set(program.grad_input_values) if program.bwd_index is not None else set()
        leaves: dict[str, torch.Tensor] = {}
        for position, value in enumerate(program.input_values):
            if value in grad_inputs:
                leaves[value] = fed[position].requires_grad_(True)  # a fresh tensor over the store's storage
            if program.mutates_inputs and value != partition.label_value:
                fed[position] = fed[position].clone()

        restore_rng = _replay_rng(op, program, state)
        buffer_snapshot = None
        if op.recompute and program.buffers:
            buffer_snapshot = self._recompute_copies[op.node]
            with torch.no_grad():
                for saved, buffer in zip(buffer_snapshot, program.buffers, strict=True):
                    saved.copy_(buffer)
        try:
            if program.bwd_index is None:
                with torch.no_grad():
                    outputs = program.run(*fed)
                pending: list[Saved] = []
            elif op.graph:
                packer = Packer(op.node, input_keys, state.fixed_keys)
                unpack = partial(self._unpack, state)
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(packer.pack, unpack):
                    outputs = program.run(*fed)
                pending = packer.pending
            else:  # no backward will read this run's graph: only its outputs count
                with torch.enable_grad():
                    outputs = program.run(*fed)
                pending = []
        finally:
            if restore_rng is not None:
                torch.set_rng_state(restore_rng)
            if buffer_snapshot is not None:
                with torch.no_grad():
                    for buffer, saved in zip(program.buffers, buffer_snapshot, strict=True):
                        buffer.copy_(saved)
        del fed
        builder = EntryBuilder(op.node)
        roots: dict[str, torch.autograd.graph.GradientEdge] = {}
        root_meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
        senders = partition.grad_senders
        output_keys: set[StorageKey] = set()
        for name, output in zip(program.output_values, outputs, strict=True):
            builder.add_named(name, output.detach())
            output_keys.add(storage_key(output))
            if op.graph and output.requires_grad and (name in senders or name == partition.loss_value):
                roots[name] = torch.autograd.graph.get_gradient_edge(output)
                root_meta[name] = (output.shape, output.dtype)
            if name == partition.loss_value and not op.recompute:
                state.loss = float(output.detach())
        pinned_bytes = place_saved(pending, program.pinned_internals, output_keys, builder)
        del outputs, pending
        if op.graph:
            for leaf in leaves.values():
                leaf.data = hollow(leaf)
            self._records[op.node] = GraphRecord(roots, root_meta, leaves, pinned_bytes)
            self._pin(pinned_bytes)
        return self.ram.put(builder.build())

    def _backward(self, op: PlannedOp, state: _Step) -> int:
        partition = self.partition
        node = partition.nodes[op.node]
        program = partition.programs[node.forward_index]
        record = self._records.get(program.index)
        if record is None:
            raise ExecutorError(f"{node.name!r}: the autograd graph of {program.name!r} is not available")
        state.counters.backward_runs += 1
        if isinstance(record, SavedRecord):
            return self._backward_functions(op, state, program, record)
        roots: list[torch.autograd.graph.GradientEdge] = []
        grads: list[torch.Tensor] = []
        for name, edge in record.roots.items():
            shape, dtype = record.root_meta[name]
            if name == partition.loss_value:
                total = torch.ones(shape, dtype=dtype)
                if state.loss_divisor != 1:  # autograd's DivBackward of (loss / micro_batches): the same op
                    total = total / state.loss_divisor
            else:
                total = None
                for consumer in partition.grad_senders.get(name, ()):
                    consumer_bwd = partition.programs[consumer].bwd_index
                    entry = self.ram.find(consumer_bwd)
                    if entry is None:
                        raise MissingTensorError(
                            f"{node.name!r} needs the gradient of {name!r} from {partition.nodes[consumer_bwd].name!r}, "
                            "which is not in RAM"
                        )
                    grad = entry.tensor(name)
                    total = grad if total is None else total + grad
                if total is None:
                    continue
            roots.append(edge)
            grads.append(total)
        leaf_names = list(record.leaves)
        params = list(program.params) if op.accumulate else []
        inputs = [record.leaves[v] for v in leaf_names] + params
        results: tuple = ()
        if roots and inputs:
            state.hook_error = None
            try:
                results = torch.autograd.grad(roots, inputs, grad_outputs=grads, retain_graph=op.retain, allow_unused=True)
            except Exception as error:
                if state.hook_error is not None:
                    raise state.hook_error from None
                raise ExecutorError(f"backward of {program.name!r} failed: {error}") from error
        del grads
        if not op.retain:
            self._drop_record(program.index)
        builder = EntryBuilder(op.node)
        leaf_grads = results[: len(leaf_names)] if results else [None] * len(leaf_names)
        for name, grad in zip(leaf_names, leaf_grads, strict=True):
            if grad is None:
                leaf = record.leaves[name]
                grad = torch.zeros(leaf.shape, dtype=leaf.dtype)
            builder.add_named(name, grad)
        if params and results:
            param_grads = results[len(leaf_names) :]
            taken = Counter(k for g in results if g is not None and (k := storage_key(g)) is not None)
            for param, grad in zip(params, param_grads, strict=True):
                if grad is not None:
                    accumulate_grad(param, grad, shared=self._is_shared(grad, taken))
        return self.ram.put(builder.build())

    # ------------------------------------------------------------------ forward and backward functions
    def _fed(self, program, state: _Step) -> tuple[list[torch.Tensor], dict[StorageKey, tuple[int, int]]]:
        """The tensors ``program`` reads, in its order, and where each input storage lives (producer, storage)."""
        partition = self.partition
        fed: list[torch.Tensor] = []
        input_keys: dict[StorageKey, tuple[int, int]] = {}
        for value in program.input_values:
            if value == partition.label_value:
                fed.append(state.labels)
                continue
            producer = partition.value_producer[value]
            entry = self.ram.find(producer)
            if entry is None:
                raise InvalidScheduleError(
                    f"computing {program.name!r} needs {partition.nodes[producer].name!r} in RAM, but it is not there"
                )
            tensor = entry.tensor(value)
            key = storage_key(tensor)
            if key is not None:
                input_keys[key] = (producer, entry.views[value].storage_index)
            fed.append(tensor)
        return fed, input_keys

    def _capture(self, program, state: _Step) -> NodeFunctions | None:
        fed, _ = self._fed(program, state)
        try:
            partition = self.partition
            receiving = {name for name in program.output_values
                         if name in partition.grad_senders or name == partition.loss_value}
            functions = capture_node_functions(program, fed, receiving, inductor=self.inductor, log=self._log)
            excess = self._bytes_beyond_price(program, functions, fed)
            if excess > 0:  # the schedule's budget would not hold: autograd saves what the trace priced
                raise NodeCaptureError(f"{program.name!r}: its forward function holds {excess} bytes more than "
                                       "the trace priced")
        except NodeCaptureError as error:
            functions = None
            self.autograd_nodes[program.index] = str(error)
            if self._log is not None:
                self._log(f"{error}; it runs under autograd (slower, as exact)")
        self._functions[program.index] = functions
        return functions

    def _bytes_beyond_price(self, program, functions: NodeFunctions, fed: list[torch.Tensor]) -> int:
        """How many bytes more than the trace priced the node's entry would hold with these functions (its
        outputs, and the saved tensors that join the entry), from one run of the forward function."""
        if functions.backward is None:
            return 0
        rng = torch.get_rng_state()
        try:
            with torch.no_grad():
                results = functions.call_forward(*functions.arguments, *fed)
        finally:
            torch.set_rng_state(rng)
        count = functions.output_count
        held = [*results[:count]]
        if not program.pinned_internals:  # else the internals it saves are pinned, outside the entry
            held += [t for k, t in enumerate(results[count + len(functions.buffers):]) if k not in functions.saved_buffers]
        elsewhere = {k for t in (*fed, *self.partition.fixed_tensors) if (k := storage_key(t)) is not None}
        entry = {k for t in held if (k := storage_key(t)) is not None} - elsewhere
        return sum(nbytes for _, nbytes in entry) - self.partition.nodes[program.index].output_bytes

    def _forward_functions(self, op: PlannedOp, state: _Step, program, functions: NodeFunctions) -> int:
        fed, input_keys = self._fed(program, state)
        restore_rng = _replay_rng(op, program, state)
        try:
            with torch.no_grad():
                results = functions.call_forward(*functions.arguments, *fed)
        finally:
            if restore_rng is not None:
                torch.set_rng_state(restore_rng)
        grad_inputs = program.grad_input_values
        count = functions.output_count
        outputs = results[:count]
        if functions.buffers and not op.recompute:  # statistics move once per step, as in eager training
            with torch.no_grad():
                for buffer, value in zip(functions.buffers, results[count:count + len(functions.buffers)],
                                         strict=True):
                    buffer.copy_(value)
        partition = self.partition
        builder = EntryBuilder(op.node)
        output_keys: set[StorageKey] = set()
        for name, output in zip(program.output_values, outputs, strict=True):
            builder.add_named(name, output)
            output_keys.add(storage_key(output))
            if name == partition.loss_value and not op.recompute:
                state.loss = float(output)
        if op.graph and functions.backward is not None:
            packer = Packer(op.node, input_keys, state.fixed_keys)
            buffers_of = functions.saved_buffers
            saved = [packer.pack(functions.buffers[buffers_of[k]] if k in buffers_of else t)
                     for k, t in enumerate(results[count + len(functions.buffers):])]
            pinned_bytes = place_saved(packer.pending, program.pinned_internals, output_keys, builder)
            input_meta = {name: (x.shape, x.dtype) for name, x in zip(program.input_values, fed, strict=True)
                          if name in grad_inputs}
            record = self._records[op.node] = SavedRecord(saved, [(o.shape, o.dtype) for o in outputs], input_meta,
                                                           pinned_bytes)
            self._pin(pinned_bytes)
            if state.notes is not None:
                state.notes.forward[state.position] = ForwardNote(
                    tuple(("buffer", buffers_of[k]) if k in buffers_of else ("keep",) if item.node is None
                          else ("own", item.view) if item.node == op.node
                          else ("producer", item.node, item.view) for k, item in enumerate(saved)),
                    tuple(record.output_meta), input_meta)
        del results, outputs, fed
        return self.ram.put(builder.build())

    def _backward_functions(self, op: PlannedOp, state: _Step, program, record: SavedRecord) -> int:
        partition = self.partition
        functions = self._functions[program.index]
        grads: list[torch.Tensor] = []
        for position in functions.differentiable_outputs:
            name = program.output_values[position]
            shape, dtype = record.output_meta[position]
            if name == partition.loss_value:
                total = torch.ones(shape, dtype=dtype)
                if state.loss_divisor != 1:  # autograd's DivBackward of (loss / micro_batches): the same op
                    total = total / state.loss_divisor
            else:
                total = None
                for consumer in partition.grad_senders.get(name, ()):
                    consumer_bwd = partition.programs[consumer].bwd_index
                    entry = self.ram.find(consumer_bwd)
                    if entry is None:
                        raise MissingTensorError(
                            f"{partition.nodes[op.node].name!r} needs the gradient of {name!r} from "
                            f"{partition.nodes[consumer_bwd].name!r}, which is not in RAM"
                        )
                    grad = entry.tensor(name)
                    total = grad if total is None else total + grad
                if total is None:  # captured with receiving outputs only: a consumer always sends one
                    raise ExecutorError(f"{partition.nodes[op.node].name!r}: no gradient reached output {name!r}")
            stride = functions.gradient_strides[len(grads)]
            if total.stride() != stride:  # the backward's views assume the layout it was traced with
                total = torch.empty_strided(shape, stride, dtype=dtype).copy_(total)
            grads.append(total)
        saved = [self._read_saved(item, state, program.name) for item in record.saved]
        with torch.no_grad():
            results = functions.call_backward(*saved, *grads)
        del saved, grads
        if not op.retain:
            self._drop_record(program.index)
        offset = len(functions.arguments)
        by_input = dict(zip(program.input_values, results[offset:], strict=True))
        builder = EntryBuilder(op.node)
        for name in program.grad_input_values:
            grad = by_input.get(name)
            if grad is None:  # the outputs do not depend on it
                shape, dtype = record.input_meta[name]
                grad = torch.zeros(shape, dtype=dtype)
            builder.add_named(name, grad)
        if op.accumulate:
            param_grads = results[:len(functions.params)]
            taken = Counter(k for g in results if g is not None and (k := storage_key(g)) is not None)
            shared_flags: list[bool | None] = []
            for param, grad in zip(functions.params, param_grads, strict=True):
                shared = None
                if grad is not None:
                    shared = self._is_shared(grad, taken)
                    accumulate_grad(param, grad, shared=shared)
                shared_flags.append(shared)
            if state.notes is not None:
                state.notes.backward[state.position] = BackwardNote(tuple(shared_flags))
        return self.ram.put(builder.build())

    def _read_saved(self, saved: Saved, state: _Step, reader: str) -> torch.Tensor:
        if saved.node is None:
            return saved.tensor
        entry = self.ram.find(saved.node)
        if entry is None:
            raise MissingTensorError(
                f"the backward of {reader!r} needs a tensor held by {self.partition.nodes[saved.node].name!r}, "
                "which the schedule "
                "does not hold in RAM at this point; the executor does not recompute it behind the schedule's back"
            )
        state.counters.saved_tensor_reads += 1
        return entry.view_tensor(saved.view)

    def _pin(self, nbytes: int) -> None:
        self.pinned_bytes += nbytes
        self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.pinned_bytes)

    def _drop_record(self, index: int) -> None:
        record = self._records.pop(index, None)
        if record is not None:
            self.pinned_bytes -= record.pinned_bytes

    def _drop_records(self) -> None:
        self._records.clear()
        self.pinned_bytes = 0

    def _is_shared(self, grad: torch.Tensor, taken: Counter) -> bool:
        key = storage_key(grad)
        return key is not None and (taken[key] > 1 or self.ram.holds_storage(grad))

    def _page_out(self, node: int, counters: Counters) -> int:
        entry = self.ram.find(node)
        if entry is None:
            raise InvalidScheduleError(f"cannot page out {self.partition.nodes[node].name!r}: not in RAM")
        written = self._pages().write(node, self.partition.nodes[node].name, entry)
        counters.page_outs += 1
        counters.bytes_paged_out += written
        return written

    def _page_in(self, node: int, counters: Counters) -> int:
        entry, read = self._pages().read(node)
        self.ram.put(entry)
        counters.page_ins += 1
        counters.bytes_paged_in += read
        return read

    def _pages(self) -> FlashPageStore:
        if self.pages is None:
            raise PageStoreError("this schedule was not prepared for paging (no flash directory)")
        return self.pages

    def _unpack(self, state: _Step, saved: Saved) -> torch.Tensor:
        if saved.node is None:
            return saved.tensor
        entry = self.ram.find(saved.node)
        if entry is None:
            state.hook_error = MissingTensorError(
                f"backward needs a tensor saved by {self.partition.nodes[saved.node].name!r}, which the schedule "
                "does not hold in RAM at this point; the executor does not recompute it behind the schedule's back"
            )
            raise state.hook_error
        state.counters.saved_tensor_reads += 1
        return entry.view_tensor(saved.view)

    def _abort(self) -> None:
        """After a failure: nothing stays in RAM or on flash, gradients are dropped, buffers restored."""
        if self._lowered is not None:  # transfers still in flight finish before their files are removed
            try:
                self._lowered.runtime.drain()
            except BaseException:  # noqa: BLE001 - the step's own error is the one raised
                pass
        self._drop_records()
        self.ram.clear()
        if self.pages is not None:
            self.pages.clear()
        for param in self.partition.parameters:
            param.grad = None
        with torch.no_grad():
            for buffer, saved in zip(self._buffers, self._buffer_copies, strict=True):
                buffer.copy_(saved)


def _replay_rng(op: PlannedOp, program, state: _Step) -> torch.Tensor | None:
    """A random program's first run records the RNG state; a recompute replays it. Returns the state to put
    back after a recompute (None otherwise)."""
    if not program.random:
        return None
    if not op.recompute:
        state.rng_states[op.node] = torch.get_rng_state()
        return None
    restore = torch.get_rng_state()
    torch.set_rng_state(state.rng_states[op.node])
    return restore


def _metered(meter, before, after, transfer_s: float) -> tuple[float | None, str, float]:
    """Energy, its source and CPU time between two meter readings around one instruction."""
    if meter is not None:
        energy_j, cpu_s = meter.energy_j(before, after, transfer_s)
        return energy_j, meter.source, cpu_s
    return None, "", max(after.cpu_s - before.cpu_s, 0.0)


def _shape_key(inputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in (*inputs, labels))


__all__ = ["Counters", "ScheduleExecutor", "StepResult"]
