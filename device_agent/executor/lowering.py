"""The schedule lowered once into a straight-line program: one generated Python function per step shape.

The executor interprets the first step of a shape instruction by instruction (capturing every node's forward
and backward functions, and noting where each saved tensor lives). From then on the whole step runs as one
generated function in which every instruction is a few statements on local variables:

- compute of a fwd/loss node: a call of its forward function on the locals holding its inputs; its outputs
  and the saved tensors its backward reads become locals;
- compute of a bwd node: the upstream gradients summed from the consumers' gradient locals (in autograd's
  order), a call of the backward function, the input gradients bound to locals, parameter gradients
  accumulated as autograd's AccumulateGrad does;
- free (RAM): ``del`` of the node's locals, which releases their storage (nothing else refers to it);
- page_out / page_in / free (flash): calls into the page store, which rebuild the locals byte for byte.

No dictionaries, entries or objects on the hot path; a clock reading per instruction feeds telemetry. The
program does exactly what the interpreted step did (same kernels, same order, same RNG replay and buffer
rules), so parameters stay bitwise equal; the tests compare both with plain PyTorch. The RAM accounting of a
lowered step is the interpreted step's, instruction by instruction: the same storages are held at every
point, since the same tensors are bound and released in the same order.

The generated source is kept on :attr:`LoweredStep.source`, to be read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from device_agent.executor.node_functions import NodeFunctions
from device_agent.executor.overlap import transfer_starts
from device_agent.executor.partition import Partition
from device_agent.executor.plan import PlannedOp
from device_agent.executor.ram_store import EntryBuilder, TensorView
from device_agent.replay import instruction_workspace_bytes

__all__ = ["BackwardNote", "ForwardNote", "LoweredStep", "LoweringNotes", "lower_step"]


@dataclass(frozen=True)
class ForwardNote:
    """Where each saved tensor of a fwd/loss compute lives: ``("keep",)`` (fixed or pinned: held by the
    record), ``("buffer", i)`` (the node's i-th buffer, see ``NodeFunctions.saved_buffers``), ``("own", view)``
    (in this node's entry) or ``("producer", node, view)`` (in an input's entry)."""

    saved: tuple[tuple, ...]
    output_meta: tuple[tuple[torch.Size, torch.dtype], ...]  # of its outputs
    input_meta: dict[str, tuple[torch.Size, torch.dtype]]  # of the inputs it sends gradients to


@dataclass(frozen=True)
class BackwardNote:
    """Whether each parameter gradient of a bwd compute was shared (copied before it became ``.grad``)."""

    shared: tuple[bool | None, ...]


@dataclass
class LoweringNotes:
    """What the interpreted step saw, by instruction position: all a lowering needs besides the schedule."""

    forward: dict[int, ForwardNote] = field(default_factory=dict)
    backward: dict[int, BackwardNote] = field(default_factory=dict)
    entry_views: dict[int, dict[str, TensorView]] = field(default_factory=dict)  # node -> views of its outputs
    in_use_bytes: list[int] = field(default_factory=list)  # tracked RAM after each instruction
    moved_bytes: list[int] = field(default_factory=list)  # bytes each instruction added, released or moved


class LoweringRuntime:
    """What the generated program calls besides kernels: the page store, behind one I/O thread.

    Page transfers overlap compute. A page-out starts as soon as its entry is complete (and no page file is
    deleted before the schedule's page-out, so flash never holds more than the schedule's peak); the RAM it
    reads is held until the transfer ends, which the node's RAM free waits for. A page-in starts as early as
    the RAM accounting allows: its buffers are charged from the instruction that starts it, and that never
    takes tracked RAM above the step's peak as interpreted (nor above the budget). One thread runs every
    transfer and delete in program order, so the page store sees them one at a time, as when interpreted.
    Each transfer's own time and meter readings are taken in that thread: telemetry reports what the flash
    did, not how long the program waited. What a transfer costs the compute thread is timed there apart: the
    call that starts it (a page-out builds its entry), and the call that takes its result, beyond the time it
    waited for the transfer itself (the I/O thread's meter reading after it, the hand-back, the wake-up).
    """

    def __init__(self, partition: Partition, pages, meter_read: Callable, rss: Callable[[], int]) -> None:
        self.partition = partition
        self.pages = pages
        self.meter_read = meter_read
        self.rss = rss
        self.moved: dict[int, int] = {}  # position -> bytes a page transfer or delete moved
        self.metered: dict[int, tuple] = {}  # position -> (before, after) meter readings around a transfer
        self.transfer_s: dict[int, float] = {}  # position -> seconds the transfer itself took
        self.started_s: dict[int, float] = {}  # position -> seconds of the compute thread starting the transfer
        # position -> seconds of the compute thread taking the transfer's result, beyond waiting for the transfer
        self.finished_s: dict[int, float] = {}
        self._ended_at: dict[int, float] = {}  # position -> perf_counter when the transfer itself ended
        self._writes: dict[int, tuple[int, Future]] = {}  # node -> (position, its page-out in flight)
        self._reads: dict[int, tuple[int, Future]] = {}  # node -> (position, its page-in in flight)
        self._pending: list[Future] = []  # deletes
        self._io: ThreadPoolExecutor | None = None

    def begin_step(self) -> None:
        """Forget the last step's timings and readings."""
        for per_position in (self.moved, self.metered, self.transfer_s, self.started_s, self.finished_s,
                             self._ended_at):
            per_position.clear()

    def start_page_out(self, position: int, node: int, names: tuple[str, ...], outputs: tuple, saved: tuple) -> None:
        called = time.perf_counter()
        builder = EntryBuilder(node)
        for name, tensor in zip(names, outputs, strict=True):
            builder.add_named(name, tensor)
        for tensor in saved:
            builder.add(tensor)
        entry = builder.build()
        name = self.partition.nodes[node].name
        self._writes[node] = (position, self._submit(position, lambda: self.pages.write(node, name, entry)))
        self.started_s[position] = time.perf_counter() - called

    def finish_page_out(self, node: int) -> None:
        self._finish(*self._writes.pop(node))

    def start_page_in(self, position: int, node: int) -> None:
        called = time.perf_counter()
        self._reads[node] = (position, self._submit(position, lambda: self.pages.read(node)))
        self.started_s[position] = time.perf_counter() - called

    def finish_page_in(self, node: int):
        entry, _ = self._finish(*self._reads.pop(node))
        return entry

    def compute_thread_s(self, position: int) -> float | None:
        """Seconds of the compute thread a transfer took (starting it, and taking its result beyond waiting for
        it); None for an instruction that is not a transfer this step ran."""
        if position not in self.started_s:
            return None
        return self.started_s[position] + self.finished_s.get(position, 0.0)

    def _finish(self, position: int, future: Future):
        called = time.perf_counter()
        result = future.result()
        self.finished_s[position] = max(time.perf_counter() - max(called, self._ended_at[position]), 0.0)
        return result

    def free_flash(self, position: int, node: int) -> None:
        def delete() -> int:
            started = time.perf_counter()
            self.moved[position] = self.pages.delete(node)
            self.transfer_s[position] = time.perf_counter() - started  # the unlink's own time, as for transfers
            return 0
        self._pending.append(self._io_thread().submit(delete))

    def drain(self) -> None:
        """Wait for every transfer and delete; re-raise the first failure."""
        futures = [future for _, future in (*self._writes.values(), *self._reads.values())] + self._pending
        self._writes.clear()
        self._reads.clear()
        self._pending.clear()
        first: BaseException | None = None
        for future in futures:
            try:
                future.result()
            except BaseException as error:  # noqa: BLE001 - every transfer is waited for before one is raised
                first = first or error
        if first is not None:
            raise first

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None

    def _submit(self, position: int, transfer: Callable) -> Future:
        def run():
            before = self.meter_read()
            started = time.perf_counter()
            result = transfer()
            self.transfer_s[position] = time.perf_counter() - started
            self.metered[position] = (before, self.meter_read())
            self.moved[position] = result if isinstance(result, int) else result[1]
            self._ended_at[position] = time.perf_counter()  # the I/O thread's last work for it: not the compute's
            return result
        return self._io_thread().submit(run)

    def _io_thread(self) -> ThreadPoolExecutor:
        if self._io is None:
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poet-paging")
        return self._io


@dataclass
class LoweredStep:
    """One step's straight-line program: ``run(inputs, labels, divisor, clock_s, rss) -> loss tensor``."""

    source: str
    run: Callable
    runtime: LoweringRuntime
    notes: LoweringNotes
    rss_position: int  # the instruction after which RSS is read: where tracked RAM first peaks
    peak_tracked_bytes: int
    compute_positions: tuple[int, ...]
    in_use_bytes: tuple[int, ...]  # tracked RAM after each instruction: the interpreted step's, plus prefetches
    # position -> the transfers started early beside it (prefetches before it, page-outs after it), which its
    # clock reading includes
    early_starts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # position of a RAM free -> the page-out whose write it finishes (its clock reading includes taking the result)
    finished_writes: dict[int, int] = field(default_factory=dict)

    def instruction_s(self, position: int, clock_s: Sequence[float]) -> float:
        """Seconds of the compute thread the instruction at ``position`` took in a run that read ``clock_s``,
        without what it spent on transfers beside it (starting them, taking a write's result beyond waiting for
        it): theirs, in ``runtime.compute_thread_s``. A RAM free keeps its wait for the write."""
        runtime = self.runtime
        seconds = clock_s[position + 1] - clock_s[position]
        seconds -= sum(runtime.started_s.get(transfer, 0.0) for transfer in self.early_starts.get(position, ()))
        if position in self.finished_writes:
            seconds -= runtime.finished_s.get(self.finished_writes[position], 0.0)
        return seconds


class _Source:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.namespace: dict[str, object] = {"torch": torch}
        self._constants: dict[int, str] = {}

    def line(self, text: str) -> None:
        self.lines.append("    " + text)

    def const(self, value, hint: str) -> str:
        key = id(value)
        name = self._constants.get(key)
        if name is None:
            name = self._constants[key] = f"{hint}_{len(self._constants)}"
            self.namespace[name] = value
        return name


def lower_step(partition: Partition, ops: list[PlannedOp], functions: dict[int, NodeFunctions | None],
               notes: LoweringNotes, runtime: LoweringRuntime, plain_run: Callable,
               accumulate_grad: Callable, trim: Callable[[int], object] | None = None,
               ram_budget_bytes: float = 0.0, overlap: bool = True) -> LoweredStep:
    """Generate the straight-line program of ``ops`` from what the interpreted step noted.

    ``plain_run(node, recompute, *inputs)`` runs a program without a backward (no functions) as the interpreted
    step does; ``accumulate_grad(param, grad, shared=...)`` is AccumulateGrad's rule. ``overlap``: page
    transfers run behind compute (see :class:`LoweringRuntime`); without it each waits at its instruction."""
    src = _Source()
    ns = src.namespace
    programs = partition.programs
    nodes = partition.nodes
    out_slot = {(index, name): f"v{index}_{j}"
                for index, program in programs.items() for j, name in enumerate(program.output_values)}
    grad_slot = {(program.bwd_index, name): f"w{program.bwd_index}_{j}"
                 for program in programs.values() if program.bwd_index is not None
                 for j, name in enumerate(program.grad_input_values)}
    own_in_entry: dict[int, list[int]] = {}  # fwd node -> own saved positions its entry holds now
    keep_alive: dict[int, list[str]] = {}  # fwd node -> locals its live record keeps (fixed, pinned)
    own_on_flash: dict[int, list[int]] = {}  # node -> own saved positions its page file holds
    writing: dict[int, int] = {}  # node -> position of its page-out in flight
    finished_writes: dict[int, int] = {}  # RAM free's position -> the page-out whose write it finishes
    in_use = list(notes.in_use_bytes)
    workspace = instruction_workspace_bytes(nodes, ops)
    writes_after, reads_before = (transfer_starts(ops, in_use, ram_budget_bytes, workspace) if overlap
                                  else ({}, {}))
    ns["_plain"] = plain_run
    ns["_acc"] = accumulate_grad
    ns["_rt"] = runtime
    ns["_view"] = _view
    ns["_trim"] = trim
    held = [u + w for u, w in zip(in_use, workspace, strict=True)]
    peak = max(held, default=0)
    rss_position = held.index(peak) if held else 0
    body = src.line

    def start_page_out(page_out: int) -> None:
        node = ops[page_out].node
        names, outputs, saved = _entry_locals(partition, node, out_slot, grad_slot, own_in_entry)
        own_on_flash[node] = own_in_entry.get(node, [])
        body(f"_rt.start_page_out({page_out}, {node}, {src.const(names, 'names')}, ({_tuple(outputs)}), "
             f"({_tuple(saved)}))")
        writing[node] = page_out

    body("clock_s[0] = _clock()")
    ns["_clock"] = time.perf_counter
    body("loss = None")
    for position, op in enumerate(ops):
        node = nodes[op.node]
        for page_in in reads_before.get(position, ()):
            body(f"_rt.start_page_in({page_in}, {ops[page_in].node})  # prefetch")
        body(f"# {position}: {op.kind} {node.name!r}" + (" (recompute)" if op.recompute else ""))
        if op.kind == "compute" and node.kind == "bwd":
            released = _released_with_backward(ops, position, node.forward_index, writing, writes_after)
            _lower_backward(src, partition, ops, position, functions, notes, out_slot, grad_slot, keep_alive,
                            own_in_entry if released else None)
        elif op.kind == "compute":
            _lower_forward(src, partition, op, position, functions, notes, out_slot, own_in_entry, keep_alive)
        elif op.kind == "page_out":
            if op.node not in writing:  # not started early
                start_page_out(position)
            if not overlap:
                body(f"_rt.finish_page_out({op.node})")
                del writing[op.node]
        elif op.kind == "page_in":
            if not any(position in started for started in reads_before.values()):
                body(f"_rt.start_page_in({position}, {op.node})")
            own_in_entry[op.node] = own_on_flash[op.node]
            names, outputs, saved = _entry_locals(partition, op.node, out_slot, grad_slot, own_in_entry)
            body(f"e = _rt.finish_page_in({op.node})")
            for name, local in zip(names, outputs, strict=True):
                body(f"{local} = e.tensor({name!r})")
            own = own_in_entry.get(op.node, ())
            note = _last_forward_note(notes, ops, position, op.node) if own else None
            for k in own:
                body(f"s{op.node}_{k} = e.view_tensor({src.const(note.saved[k][1], 'view')})")
            body("del e")
        elif op.location == "ram":
            if op.node in writing:  # its storages are released once the page file has them
                body(f"_rt.finish_page_out({op.node})")
                finished_writes[position] = writing.pop(op.node)
            _, outputs, saved = _entry_locals(partition, op.node, out_slot, grad_slot, own_in_entry)
            if outputs or saved:
                body(f"del {', '.join((*outputs, *saved))}")
            own_in_entry.pop(op.node, None)
            if trim is not None and notes.moved_bytes[position]:
                body("_trim(0)")
        else:
            body(f"_rt.free_flash({position}, {op.node})")
        for page_out in writes_after.get(position, ()):
            start_page_out(page_out)
        body(f"clock_s[{position + 1}] = _clock()")
        if position == rss_position:
            body("rss[0] = _rt.rss()")
    body("_rt.drain()")
    body("return loss")
    source = "def lowered_step(inputs, labels, divisor, clock_s, rss):\n" + "\n".join(src.lines) + "\n"
    code = compile(source, f"<lowered step of {partition.name}>", "exec")
    exec(code, ns)  # noqa: S102 - the program is generated here from the validated schedule
    early_starts = {position: tuple((*reads_before.get(position, ()), *writes_after.get(position, ())))
                    for position in {*reads_before, *writes_after}}
    return LoweredStep(source, ns["lowered_step"], runtime, notes, rss_position, peak,
                       tuple(position for position, op in enumerate(ops) if op.kind == "compute"), tuple(in_use),
                       early_starts, finished_writes)


def _tuple(items: list[str]) -> str:
    return "".join(f"{item}, " for item in items)


def _entry_locals(partition: Partition, node: int, out_slot, grad_slot, own_in_entry
                  ) -> tuple[tuple[str, ...], list[str], list[str]]:
    """The names and locals of a node's entry, in the order the interpreted entry adds them."""
    pnode = partition.nodes[node]
    if pnode.kind == "bwd":
        program = partition.programs[pnode.forward_index]
        names = tuple(program.grad_input_values)
        return names, [grad_slot[(node, name)] for name in names], []
    program = partition.programs[node]
    names = tuple(program.output_values) if program.run is not None else tuple(partition.batch_values)
    outputs = [out_slot[(node, name)] for name in program.output_values] if program.run is not None else \
        [f"v{node}_{j}" for j in range(len(names))]
    return names, outputs, [f"s{node}_{k}" for k in own_in_entry.get(node, ())]


def _last_forward_note(notes: LoweringNotes, ops: list[PlannedOp], position: int, node: int) -> ForwardNote:
    for earlier in range(position - 1, -1, -1):
        op = ops[earlier]
        if op.kind == "compute" and op.node == node and earlier in notes.forward:
            return notes.forward[earlier]
    raise AssertionError(f"no noted compute of node {node} before instruction {position}")


def _lower_forward(src: _Source, partition: Partition, op: PlannedOp, position: int, functions, notes,
                   out_slot, own_in_entry, keep_alive) -> None:
    body = src.line
    n = op.node
    program = partition.programs[n]
    if program.run is None:  # the input node: the batch
        for j in range(len(partition.batch_values)):
            body(f"v{n}_{j} = inputs[{j}]")
        return
    fed = ", ".join("labels" if value == partition.label_value else out_slot[(partition.value_producer[value], value)]
                    for value in program.input_values)
    own_in_entry[n] = []
    function = functions.get(n) if program.bwd_index is not None else None
    if function is None:
        body(f"r = _plain({n}, {op.recompute}, {fed})")
        for j, name in enumerate(program.output_values):
            body(f"{out_slot[(n, name)]} = r[{j}]")
            if name == partition.loss_value and not op.recompute:
                body(f"loss = {out_slot[(n, name)]}")
        body("del r")
        return
    rng = f"rng{n}"
    if program.random:
        if op.recompute:
            body(f"restore = torch.get_rng_state(); torch.set_rng_state({rng})")
        else:
            body(f"{rng} = torch.get_rng_state()")
    call = f"r = {src.const(function.call_forward, 'fwd')}(*{src.const(function.arguments, 'args')}, {fed})"
    if program.random and op.recompute:
        body("try:")
        body(f"    {call}")
        body("finally:")
        body("    torch.set_rng_state(restore)")
    else:
        body(call)
    count = function.output_count
    for j, name in enumerate(program.output_values):
        body(f"{out_slot[(n, name)]} = r[{j}]")
        if name == partition.loss_value and not op.recompute:
            body(f"loss = {out_slot[(n, name)]}")
    if function.buffers and not op.recompute:  # statistics move once per step
        for i, buffer in enumerate(function.buffers):
            body(f"{src.const(buffer, 'buffer')}.copy_(r[{count + i}])")
    if op.graph and function.backward is not None:
        note = notes.forward[position]
        base = count + len(function.buffers)
        own: list[int] = []
        keep: list[str] = []
        for k, where in enumerate(note.saved):
            if where[0] == "own":
                body(f"s{n}_{k} = r[{base + k}]")
                own.append(k)
            elif where[0] == "keep":
                body(f"k{n}_{k} = r[{base + k}]")
                keep.append(f"k{n}_{k}")
        own_in_entry[n] = own
        keep_alive[n] = keep
    body("del r")


def _released_with_backward(ops: list[PlannedOp], position: int, forward: int, writing: dict[int, int],
                            writes_after: dict[int, list[int]]) -> bool:
    """Whether the backward at ``position`` of forward node ``forward`` may release that node's own saved tensors
    inside its call: it is not retained, and the schedule's next instruction on the node frees its RAM entry, with
    no page-out of it in flight or started before then."""
    if ops[position].retain or forward in writing:
        return False
    for later in range(position, len(ops)):
        if any(ops[page_out].node == forward for page_out in writes_after.get(later, ())):
            return False
        if later > position and ops[later].node == forward:
            return ops[later].kind == "free" and ops[later].location == "ram"
    return False


def _lower_backward(src: _Source, partition: Partition, ops: list[PlannedOp], position: int, functions, notes,
                    out_slot, grad_slot, keep_alive, own_in_entry: dict[int, list[int]] | None) -> None:
    """A backward compute. Its arguments go to the function in one list it empties (``call_backward_boxed``); the
    gradients, and with ``own_in_entry`` given (:func:`_released_with_backward`) the forward node's own and kept
    saved tensors, are no longer held by the step's locals, so the function frees each at its last use."""
    body = src.line
    op = ops[position]
    b = op.node
    n = partition.nodes[b].forward_index
    program = partition.programs[n]
    function = functions[n]
    forward_note = _last_forward_note(notes, ops, position, n)  # the compute whose saved tensors it reads
    saved: list[str] = []
    for k, where in enumerate(forward_note.saved):
        if where[0] == "own":
            saved.append(f"s{n}_{k}")
        elif where[0] == "keep":
            saved.append(f"k{n}_{k}")
        elif where[0] == "buffer":
            saved.append(src.const(function.buffers[where[1]], "buffer"))
        else:
            _, producer, view = where
            saved.append(_producer_view(src, partition, notes, producer, view, out_slot))
    grads: list[str] = []
    for i, output_position in enumerate(function.differentiable_outputs):
        name = program.output_values[output_position]
        shape, dtype = forward_note.output_meta[output_position]
        g = f"g{i}"
        if name == partition.loss_value:
            body(f"{g} = torch.ones({tuple(shape)!r}, dtype={src.const(dtype, 'dtype')})")
            body(f"if divisor != 1: {g} = {g} / divisor")
        else:
            terms = [grad_slot[(partition.programs[c].bwd_index, name)] for c in partition.grad_senders.get(name, ())]
            body(f"{g} = {' + '.join(terms)}" if len(terms) > 1 else f"{g} = {terms[0]}")
        stride = function.gradient_strides[i]
        body(f"if {g}.stride() != {stride!r}: {g} = torch.empty_strided({tuple(shape)!r}, {stride!r}, "
             f"dtype={src.const(dtype, 'dtype')}).copy_({g})")
        grads.append(g)
    body(f"a = [{_tuple(saved)}{_tuple(grads)}]")
    dropped = list(grads)
    if not op.retain:  # the record's kept tensors go with this backward
        dropped += keep_alive.pop(n, [])
    if own_in_entry is not None:  # released: the free that follows has nothing of them left to drop
        dropped += [f"s{n}_{k}" for k in own_in_entry.pop(n, [])]
    if dropped:
        body(f"del {', '.join(dropped)}")
    body(f"R = {src.const(function.call_backward_boxed, 'bwd')}(a)")
    body("del a")
    returned = _returned_none(function.backward)
    offset = len(function.arguments)
    for name in program.grad_input_values:
        result = offset + program.input_values.index(name)
        local = grad_slot[(b, name)]
        if returned[result]:
            shape, dtype = forward_note.input_meta[name]
            body(f"{local} = torch.zeros({tuple(shape)!r}, dtype={src.const(dtype, 'dtype')})")
        else:
            body(f"{local} = R[{result}]")
    if op.accumulate:
        shared = notes.backward[position].shared
        for i, param in enumerate(function.params):
            if not returned[i] and shared[i] is not None:
                body(f"_acc({src.const(param, 'param')}, R[{i}], shared={shared[i]})")
    body("del R")


def _producer_view(src: _Source, partition: Partition, notes: LoweringNotes, producer: int, view: TensorView,
                   out_slot) -> str:
    """A saved tensor living in an input's entry: that local itself when the view is the whole of it, else a
    view rebuilt over the storage the local holds now (it may have been paged in or recomputed)."""
    views = notes.entry_views[producer]
    names = partition.programs[producer].output_values if partition.programs[producer].run is not None \
        else partition.batch_values
    for j, name in enumerate(names):
        if views[name].storage_index == view.storage_index:
            local = out_slot[(producer, name)] if partition.programs[producer].run is not None else f"v{producer}_{j}"
            if views[name] == view:
                return local
            return f"_view({local}, {src.const(view, 'view')})"
    raise AssertionError(f"a saved tensor of node {producer} is in none of its outputs' storages")


def _view(tensor: torch.Tensor, view: TensorView) -> torch.Tensor:
    return torch.empty(0, dtype=view.dtype).set_(tensor.untyped_storage(), view.offset, view.shape, view.stride)


def _returned_none(backward) -> list[bool]:
    (output,) = (n for n in backward.graph.nodes if n.op == "output")
    return [value is None for value in output.args[0]]
