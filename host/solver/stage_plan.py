"""The POET stage plan (the solver's matrices) and its lowering to an ordered Schedule.

A plan has one stage per node: stage t computes node t, plus any recomputations. Matrices are
T×T booleans indexed [stage, node], as in the paper (R, S_RAM, S_SD, M_in, M_out):

- ``recompute[t, i]``  node i is computed during stage t (``recompute[t, t]`` is always set)
- ``keep_ram[t, i]``   node i's output is in RAM when stage t starts
- ``keep_flash[t, i]`` node i's output is on flash when stage t starts
- ``page_in[t, i]``    node i is read back from flash at the end of stage t (in RAM from t+1)
- ``page_out[t, i]``   node i is written to flash during stage t (from RAM, or right after computing it)

Everything downstream of the solver sees only the lowered Schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from device_agent.schedule import Instruction, Schedule, ScheduleNode
from host.graph.training_graph import TrainingGraph


@dataclass
class StagePlan:
    recompute: np.ndarray
    keep_ram: np.ndarray
    keep_flash: np.ndarray
    page_in: np.ndarray
    page_out: np.ndarray

    @classmethod
    def empty(cls, size: int) -> StagePlan:
        def zeros() -> np.ndarray:
            return np.zeros((size, size), dtype=bool)

        plan = cls(zeros(), zeros(), zeros(), zeros(), zeros())
        np.fill_diagonal(plan.recompute, True)
        return plan

    @property
    def size(self) -> int:
        return self.recompute.shape[0]


def drop_unread_pages(plan: StagePlan) -> StagePlan | None:
    """The plan without page-outs of tensors it never pages in again, or None when it has none.

    Such a page-out costs energy and time and is never read: dropping it (and the flash copy it keeps)
    changes no RAM figure and no computation. A solver stopped at its time limit can return them.
    """
    unread = plan.page_out.any(axis=0) & ~plan.page_in.any(axis=0)
    if not unread.any():
        return None
    page_out, keep_flash = plan.page_out.copy(), plan.keep_flash.copy()
    page_out[:, unread] = False
    keep_flash[:, unread] = False
    return StagePlan(plan.recompute, plan.keep_ram, keep_flash, plan.page_in, page_out)


def lower_plan(plan: StagePlan, graph: TrainingGraph) -> list[Instruction]:
    """Turn a stage plan into compute / page_out / page_in / free instructions.

    Tensors are freed as early as the plan allows: after their last use inside a stage unless
    the plan keeps them for the next stage. The result never holds more than the plan's model.
    """
    size = graph.size
    deps = [node.deps for node in graph.nodes]
    instructions: list[Instruction] = []
    in_ram: set[int] = set()
    on_flash: set[int] = set()
    no_keep = np.zeros(size, dtype=bool)

    def free_ram(i: int) -> None:
        in_ram.discard(i)
        instructions.append(Instruction("free", i, "ram"))

    for stage in range(size):
        keep_next = plan.keep_ram[stage + 1] if stage + 1 < size else no_keep
        flash_next = plan.keep_flash[stage + 1] if stage + 1 < size else no_keep
        computed_here = [k for k in range(stage + 1) if plan.recompute[stage, k]]
        # Last position in this stage at which each tensor is read by a computation.
        last_read: dict[int, int] = {}
        for position, k in enumerate(computed_here):
            for d in deps[k]:
                last_read[d] = position

        for i in np.flatnonzero(plan.page_out[stage]):
            if i in in_ram and i not in on_flash:
                instructions.append(Instruction("page_out", int(i)))
                on_flash.add(int(i))
        # Drop what this stage neither reads nor carries on.
        for i in sorted(in_ram):
            if i not in last_read and not keep_next[i]:
                free_ram(i)
        for position, k in enumerate(computed_here):
            if k not in in_ram:
                instructions.append(Instruction("compute", k))
                in_ram.add(k)
            if plan.page_out[stage, k] and k not in on_flash:
                instructions.append(Instruction("page_out", k))
                on_flash.add(k)
            for d in deps[k]:
                if d in in_ram and last_read.get(d, -1) <= position and not keep_next[d]:
                    free_ram(d)
            if k in in_ram and last_read.get(k, -1) <= position and not keep_next[k]:
                free_ram(k)
        for i in sorted(in_ram):
            if not keep_next[i]:
                free_ram(i)
        for i in np.flatnonzero(plan.page_in[stage]):
            i = int(i)
            if keep_next[i] and i not in in_ram and i in on_flash:
                instructions.append(Instruction("page_in", i))
                in_ram.add(i)
        for i in sorted(on_flash):
            if not flash_next[i]:
                on_flash.discard(i)
                instructions.append(Instruction("free", i, "flash"))
    return instructions


def schedule_nodes(graph: TrainingGraph) -> list[ScheduleNode]:
    return [ScheduleNode(n.name, n.kind, n.output_bytes, n.deps, n.workspace_bytes) for n in graph.nodes]


def make_schedule(graph: TrainingGraph, instructions: list[Instruction], **fields) -> Schedule:
    return Schedule(
        graph_name=graph.name,
        graph_fingerprint=graph.fingerprint(),
        nodes=schedule_nodes(graph),
        instructions=instructions,
        fixed_bytes=graph.fixed_bytes,
        **fields,
    )
