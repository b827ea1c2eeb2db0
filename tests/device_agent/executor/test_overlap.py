"""overlap.py: where transfers start behind compute, and the step time that follows (the cost model's rule)."""

from __future__ import annotations

import pytest

from device_agent.executor.overlap import overlapped_step_s, transfer_starts
from device_agent.schedule import Instruction

C, PO, PI, F = "compute", "page_out", "page_in", "free"


def _ops():
    """a, b, c computed; a paged out after b and back in before its reader d; everything freed."""
    return [Instruction(C, 0), Instruction(C, 1), Instruction(PO, 0), Instruction(F, 0), Instruction(C, 2),
            Instruction(C, 3), Instruction(PI, 0), Instruction(C, 4), Instruction(F, 0, "flash"),
            *(Instruction(F, i) for i in (0, 1, 2, 3, 4))]


IN_USE = [10, 20, 20, 10, 20, 30, 40, 50, 50, 40, 30, 20, 10, 0]


def test_a_page_out_starts_after_its_entry_is_made_and_a_page_in_as_early_as_ram_allows():
    writes_after, reads_before = transfer_starts(_ops(), list(IN_USE), 0.0)
    assert writes_after == {0: [2]}  # right after computing node 0, behind node 1's compute
    assert reads_before == {4: [6]}  # from the instruction after its RAM free: the peak (50) is never passed


def _blocked_ops():
    """As _ops, but node 2 is large and freed just before the page-in: reading earlier would pass the peak."""
    return [Instruction(C, 0), Instruction(C, 1), Instruction(PO, 0), Instruction(F, 0), Instruction(C, 2),
            Instruction(F, 2), Instruction(PI, 0), Instruction(C, 3), Instruction(F, 0, "flash"),
            *(Instruction(F, i) for i in (0, 1, 3))]


BLOCKED_IN_USE = [10, 20, 20, 10, 50, 10, 20, 25, 25, 15, 5, 0]


def test_a_prefetch_never_raises_ram_above_the_steps_peak_or_the_budget():
    assert transfer_starts(_blocked_ops(), list(BLOCKED_IN_USE), 0.0) == ({0: [2]}, {})
    in_use = list(IN_USE)
    assert transfer_starts(_ops(), in_use, 50.0)[1] == {4: [6]}
    assert in_use[4:6] == [30, 40]  # the buffer is charged from the instruction that starts it


def test_transfers_hide_behind_compute_and_the_step_waits_only_for_what_is_left():
    ops = _ops()
    seconds = [1.0 if op.kind == C else 0.0 for op in ops]
    seconds[2], seconds[6] = 0.5, 0.5  # each transfer shorter than the compute it runs behind
    assert overlapped_step_s(ops, seconds, IN_USE, 0.0, overlap=False) == pytest.approx(6.0)
    assert overlapped_step_s(ops, seconds, IN_USE, 0.0) == pytest.approx(5.0)  # both hidden
    seconds[2] = 3.0  # a slow write: node 0's RAM free (after node 1) waits for it
    assert overlapped_step_s(ops, seconds, IN_USE, 0.0) == pytest.approx(3.0 + 1 + 1 + 1 + 1)


def test_a_read_that_cannot_start_early_is_waited_for_in_place():
    ops = _blocked_ops()
    seconds = [1.0 if op.kind == C else 0.0 for op in ops]
    seconds[6] = 2.0
    # the read starts at its own instruction, once node 2 is freed, and node 3 waits for it
    assert overlapped_step_s(ops, seconds, BLOCKED_IN_USE, 0.0) == pytest.approx(3.0 + 2.0 + 1.0)


def test_a_transfer_that_shares_the_computes_core_holds_it_back_by_the_share_not_hidden():
    ops = _ops()
    seconds = [1.0 if op.kind == C else 0.0 for op in ops]
    seconds[2], seconds[6] = 0.5, 0.5
    assert overlapped_step_s(ops, seconds, IN_USE, 0.0, hidden_share=1.0) == pytest.approx(5.0)
    assert overlapped_step_s(ops, seconds, IN_USE, 0.0, hidden_share=0.0) == pytest.approx(6.0)  # the plain sum
    # half of each 0.5 s transfer is taken from the compute thread; the rest still runs behind it
    assert overlapped_step_s(ops, seconds, IN_USE, 0.0, hidden_share=0.5) == pytest.approx(5.5)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="hidden_share"):
            overlapped_step_s(ops, seconds, IN_USE, 0.0, hidden_share=bad)


def test_a_step_never_takes_more_than_the_plain_sum_and_takes_longer_as_less_is_hidden():
    import random

    rng = random.Random(7)
    for _ in range(500):
        for ops, in_use in ((_ops(), IN_USE), (_blocked_ops(), BLOCKED_IN_USE)):
            seconds = [rng.random() for _ in ops]
            steps = [overlapped_step_s(ops, seconds, in_use, 0.0, hidden_share=share) for share in (1.0, 0.6, 0.2, 0.0)]
            assert steps[-1] == pytest.approx(sum(seconds))
            assert all(a <= b + 1e-9 for a, b in zip(steps, steps[1:], strict=False)), steps


def test_what_a_transfer_costs_the_compute_thread_is_never_hidden():
    """A page-out's compute-thread time comes before its write starts, a page-in's after its read ends."""
    ops = _ops()
    seconds = [1.0 if op.kind == C else 0.0 for op in ops]
    seconds[2], seconds[6] = 0.5, 0.5
    thread_s = [0.0] * len(ops)
    thread_s[2], thread_s[6] = 0.25, 0.25
    # both writes and reads still run behind compute; their 0.25 s on the compute thread adds up
    assert overlapped_step_s(ops, seconds, IN_USE, 0.0, compute_thread_s=thread_s) == pytest.approx(5.5)
    assert overlapped_step_s(ops, seconds, IN_USE, 0.0, overlap=False, compute_thread_s=thread_s) == pytest.approx(6.5)
    blocked = _blocked_ops()
    seconds = [1.0 if op.kind == C else 0.0 for op in blocked]
    seconds[6] = 2.0
    thread_s = [0.0] * len(blocked)
    thread_s[6] = 0.5
    # the read starts at its own instruction; taking its result follows it, and node 3 follows that
    assert overlapped_step_s(blocked, seconds, BLOCKED_IN_USE, 0.0, compute_thread_s=thread_s) == pytest.approx(
        3.0 + 2.0 + 0.5 + 1.0)
