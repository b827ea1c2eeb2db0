"""Page transfers behind compute: where each starts, and how long a step then takes.

The lowered step (``lowering.py``) starts every transfer where :func:`transfer_starts` says and runs them on
one I/O thread; the host's cost model prices a step with :func:`overlapped_step_s`, which plays the same rule
forward in time. One rule, read by both, so a prediction hides exactly the transfers the executor hides.

An op is anything with ``kind`` (compute | page_out | page_in | free), ``node`` and ``location`` (ram | flash,
for frees): the executor's ``PlannedOp`` and the schedule's ``Instruction`` both are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["overlapped_step_s", "transfer_starts"]


class Op(Protocol):
    kind: str
    node: int
    location: str


def transfer_starts(ops: Sequence[Op], in_use: list[int], ram_budget_bytes: float,
                    workspace: Sequence[int] | None = None) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Where transfers start when they overlap compute: ``(writes_after, reads_before)``, by instruction position.

    Page-outs start after the instruction that completed their entry (never before a page file is deleted:
    flash holds at most the schedule's peak); page-ins start before the earliest instruction from which their
    buffers fit under the step's tracked peak (and the budget) until they are needed. ``in_use`` (tracked RAM
    after each instruction) is raised in place by each prefetch's bytes: a buffer is charged from its start.
    ``workspace`` (bytes an instruction holds only while it runs: a compute's temporaries) counts too: a
    prefetched buffer must fit beside them.
    """
    held = workspace if workspace is not None else [0] * len(in_use)
    writes_after: dict[int, list[int]] = {}
    reads_before: dict[int, list[int]] = {}
    # never above the step's peak as interpreted (which the schedule's prediction bounds), nor the budget
    peak = max((u + w for u, w in zip(in_use, held, strict=True)), default=0)
    limit = min(ram_budget_bytes, peak) if ram_budget_bytes else peak
    last_made: dict[int, int] = {}  # node -> last instruction that (re)created its entry
    last_ram_free: dict[int, int] = {}
    last_flash_free = -1
    for position, op in enumerate(ops):
        if op.kind == "page_out":
            start = max(last_made[op.node], last_flash_free)
            if start < position - 1:
                writes_after.setdefault(start, []).append(position)
        elif op.kind == "page_in":
            delta = in_use[position] - (in_use[position - 1] if position else 0)
            lowest = last_ram_free.get(op.node, -1) + 1
            start = position
            while (start - 1 >= lowest and start - 2 >= 0 and in_use[start - 2] + held[start - 2] + delta <= limit
                   and in_use[start - 1] + held[start - 1] + delta <= limit):
                start -= 1
            if start < position:
                reads_before.setdefault(start, []).append(position)
                for i in range(start, position):
                    in_use[i] += delta
        if op.kind == "compute" or op.kind == "page_in":
            last_made[op.node] = position
        elif op.kind == "free" and op.location == "ram":
            last_ram_free[op.node] = position
        elif op.kind == "free":
            last_flash_free = position
    return writes_after, reads_before


def overlapped_step_s(ops: Sequence[Op], seconds: Sequence[float], in_use: Sequence[int], ram_budget_bytes: float,
                      overlap: bool = True, workspace: Sequence[int] | None = None,
                      hidden_share: float = 1.0, compute_thread_s: Sequence[float] | None = None) -> float:
    """Seconds from a step's first instruction to its last transfer's end, when instruction ``i`` takes
    ``seconds[i]``: computes and RAM frees on the compute thread, page transfers and flash frees on the one I/O
    thread, in program order.

    As the lowered step runs it: a transfer starts where :func:`transfer_starts` puts it (or at its own
    instruction) once the I/O thread is free; the instruction of a page-in waits for its read, and the RAM free
    of a node being written waits for its write. Without ``overlap`` every transfer runs in place, so the step
    is the plain sum. ``workspace``: as for :func:`transfer_starts`.

    ``hidden_share`` (0 to 1) is the share of a transfer's time that really runs beside compute: 1 where the I/O
    thread has a core of its own; below 1 where it shares the compute's core (or the interpreter lock) with it, so
    the rest of each transfer's time also holds the compute thread back. 0 gives the plain sum.

    ``compute_thread_s[i]`` (transfers; 0 elsewhere) is what transfer ``i`` costs the compute thread besides its
    own time ``seconds[i]`` (telemetry's ``compute_thread_s``): a page-out's before its write starts (building its
    entry), a page-in's once its read has ended (taking the result; its start, a submit of microseconds, is charged
    there too, though a prefetch spends it earlier). Never hidden.
    """
    if not 0.0 <= hidden_share <= 1.0:
        raise ValueError(f"hidden_share must be between 0 and 1, got {hidden_share!r}")
    thread_s = compute_thread_s if compute_thread_s is not None else [0.0] * len(seconds)
    if not overlap or hidden_share == 0.0:
        return float(sum(seconds) + sum(thread_s))
    stolen_share = 1.0 - hidden_share
    writes_after, reads_before = transfer_starts(ops, list(in_use), ram_budget_bytes, workspace)
    compute_clock_s = io_clock_s = 0.0
    done_s: dict[int, float] = {}  # position of a transfer -> when it ends
    started: set[int] = set()
    writing: dict[int, int] = {}  # node -> position of its page-out in flight

    def submit(position: int) -> None:
        nonlocal io_clock_s, compute_clock_s
        if ops[position].kind == "page_out":
            compute_clock_s += thread_s[position]
        io_clock_s = max(io_clock_s, compute_clock_s) + seconds[position]
        done_s[position] = io_clock_s
        compute_clock_s += stolen_share * seconds[position]  # what the transfer takes from the compute thread
        started.add(position)

    for position, op in enumerate(ops):
        for read in reads_before.get(position, ()):
            submit(read)
        if op.kind == "page_out":
            if position not in started:
                submit(position)
            writing[op.node] = position
        elif op.kind == "page_in":
            if position not in started:
                submit(position)
            compute_clock_s = max(compute_clock_s, done_s[position]) + thread_s[position]
        elif op.kind == "free" and op.location == "flash":
            submit(position)
        else:
            if op.kind == "free" and op.node in writing:  # its storages go once the page file has them
                compute_clock_s = max(compute_clock_s, done_s[writing.pop(op.node)])
            compute_clock_s += seconds[position]
        for write in writes_after.get(position, ()):
            submit(write)
    return max(compute_clock_s, io_clock_s)
