"""The eviction bound: never above a schedule the MILP proves optimal, and above compute-once where the budget bites."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from host.solver.baseline_pricing import (
    GREEDY,
    GREEDY_FROM_COVER,
    GREEDY_FROM_RESUMED_COVER,
    GREEDY_FROM_STRONGER_COVER,
    price_baselines,
)
from host.solver.eviction_bound import CLOSED_RTOL, eviction_bound_j, eviction_cover, is_closed, stage_excess_bytes
from host.solver.milp import MilpResult
from host.solver.solve import SolveOptions, minimum_ram_bytes, no_remat_peak_bytes, solve_schedule

from .graphs import (
    chain_graph,
    inverted_residual_graph,
    price_simply,
    random_training_graph,
    residual_graph,
    training_graph_from_forward,
)

RTOL = 1e-6


def _milp_optimum(priced, budget, runtime_factor=1.2, time_limit_s=60.0, **ablation):
    """The MILP alone (no baselines, no eviction bound), solved to a tight gap."""
    result = solve_schedule(priced, SolveOptions(
        ram_budget_bytes=budget, runtime_factor=runtime_factor, mip_gap=1e-9, warm_start=False,
        shortcut_non_binding=False, time_limit_s=time_limit_s, **ablation))
    return result


_ABLATIONS = st.sampled_from([{}, {"paging": False}, {"remat": False}, {"paging_in_runtime": True}])


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), size=st.integers(3, 7), share=st.floats(0.25, 0.95),
       page_j_per_byte=st.sampled_from([1e-6, 1e-4, 1e-3]), runtime_factor=st.sampled_from([1.0, 1.2, 2.0]),
       ablation=_ABLATIONS)
def test_the_bound_never_exceeds_the_proven_optimum(seed, size, share, page_j_per_byte, runtime_factor, ablation):
    _bound_case(seed, size, share, page_j_per_byte, runtime_factor, ablation)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), size=st.integers(3, 7), share=st.floats(0.25, 0.95),
       page_j_per_byte=st.sampled_from([1e-6, 1e-4, 1e-3]), runtime_factor=st.sampled_from([1.0, 1.2, 2.0]),
       ablation=_ABLATIONS)
def test_the_bound_never_exceeds_the_proven_optimum_many_graphs(seed, size, share, page_j_per_byte, runtime_factor,
                                                                ablation):
    _bound_case(seed, size, share, page_j_per_byte, runtime_factor, ablation)


def _bound_case(seed, size, share, page_j_per_byte, runtime_factor, ablation) -> None:
    """Both eviction bounds lie between compute-once and the MILP's proven optimum, the second above the first."""
    priced = price_simply(random_training_graph(seed, size), page_j_per_byte=page_j_per_byte)
    budget = max(minimum_ram_bytes(priced), share * no_remat_peak_bytes(priced))
    bound = eviction_bound_j(priced, budget, runtime_factor * priced.base_runtime_s,
                             remat=ablation.get("remat", True), paging=ablation.get("paging", True),
                             paging_in_runtime=ablation.get("paging_in_runtime", False))
    stronger = eviction_bound_j(priced, budget, runtime_factor * priced.base_runtime_s,
                                remat=ablation.get("remat", True), paging=ablation.get("paging", True),
                                paging_in_runtime=ablation.get("paging_in_runtime", False), second_restorations=True)
    optimum = _milp_optimum(priced, budget, runtime_factor, **ablation)
    if optimum.status == "infeasible":
        return  # no schedule to bound (the covering problem may still have a solution)
    assert optimum.status == "optimal", optimum.message
    assert bound is not None and stronger is not None
    assert priced.compute_j.sum() * (1 - RTOL) <= bound <= stronger * (1 + RTOL)
    assert stronger <= optimum.objective_j * (1 + RTOL)


def test_paying_for_each_forced_eviction_reaches_the_optimum_where_compute_once_is_far_below():
    priced = price_simply(random_training_graph(0, 5), page_j_per_byte=1e-3)
    budget = max(minimum_ram_bytes(priced), 0.4 * no_remat_peak_bytes(priced))
    optimum = _milp_optimum(priced, budget)
    bound = eviction_bound_j(priced, budget, 1.2 * priced.base_runtime_s)
    compute_once = priced.compute_j.sum()
    assert optimum.objective_j > 2 * compute_once  # the budget costs more than computing everything once
    assert bound == pytest.approx(optimum.objective_j, rel=RTOL)


@pytest.mark.parametrize("seed", range(8))
def test_the_bound_never_exceeds_the_proven_optimum_where_dead_inputs_chain(seed):
    """The random graphs above have no tensor that dies at its next forward node; a traced ResNet has chains of
    them (a ReLU's input is an add's output, whose input is a BatchNorm's), and the bound walks those chains."""
    import random

    rng = random.Random(seed)
    blocks = rng.choice([1, 2])
    priced = price_simply(residual_graph(blocks, [rng.choice([100, 200, 400]) for _ in range(3 + 4 * blocks)]),
                          page_j_per_byte=rng.choice([1e-6, 1e-5, 1e-4, 1e-3]))
    budget = max(minimum_ram_bytes(priced), rng.uniform(0.2, 0.8) * no_remat_peak_bytes(priced))
    optimum = _milp_optimum(priced, budget, 1.5)
    assert optimum.status == "optimal", optimum.message
    bound = eviction_bound_j(priced, budget, 1.5 * priced.base_runtime_s)
    stronger = eviction_bound_j(priced, budget, 1.5 * priced.base_runtime_s, second_restorations=True)
    assert priced.compute_j.sum() * (1 - RTOL) <= bound <= stronger * (1 + RTOL)
    assert stronger <= optimum.objective_j * (1 + RTOL)


def _block_at_its_floor():
    """One residual block at its hard floor (800 bytes), where the optimum (0.88173 J) pages relu0's output twice."""
    priced = price_simply(residual_graph(1, [400, 400, 400, 400, 100, 200, 400]), page_j_per_byte=1e-4)
    return priced, minimum_ram_bytes(priced)


def test_a_live_input_read_by_a_recomputation_between_two_absences_is_restored_twice():
    """Recomputing relu0's output for conv1's backward reads bn0's output, recomputing that reads conv0's output,
    which conv0's backward reads later. Absent before the recomputation and again at conv1's backward (the
    floor leaves no room), conv0's output is restored twice: 0.80183 J, where one restoration per gap gives
    0.76173 J. The optimum is 0.88173 J."""
    priced, budget = _block_at_its_floor()
    runtime = 1.2 * priced.base_runtime_s
    once = eviction_bound_j(priced, budget, runtime)
    twice = eviction_bound_j(priced, budget, runtime, second_restorations=True)
    optimum = _milp_optimum(priced, budget)
    assert optimum.status == "optimal"
    assert once == pytest.approx(0.76173, rel=1e-5)
    assert twice == pytest.approx(0.80183, rel=1e-5)
    assert twice <= optimum.objective_j * (1 + RTOL)


@pytest.mark.slow  # the MILP proves the optimum in about 50 s (over 60 s on a loaded machine: it is given 240 s)
def test_a_live_input_read_below_a_recomputed_tensors_dead_inputs_is_restored_twice():
    """Three residual blocks at 40% of their no-remat peak. A recomputed live tensor (a block's ReLU output) reads
    dead ones below it (the add, the BatchNorm), whose recomputations read live convolution outputs in turn: those
    are restored twice where they are absent before and again after. Followed only through the recomputed
    tensor's own inputs, the bound was 1.50273 J; through its dead inputs it is 1.60263 J; with the chains a solved
    cover needs (recomputations through live tensors too) 1.60273 J; the optimum is 1.60293 J."""
    priced = price_simply(residual_graph(3, [100, 400, 100, 400, 100, 200, 200, 400, 200, 400, 100, 400, 200, 100,
                                             200]), page_j_per_byte=1e-3)
    budget = max(minimum_ram_bytes(priced), 0.39642 * no_remat_peak_bytes(priced))
    bound = eviction_bound_j(priced, budget, 1.5 * priced.base_runtime_s, second_restorations=True)
    optimum = _milp_optimum(priced, budget, 1.5, time_limit_s=240.0)
    assert optimum.status == "optimal", optimum.message
    assert bound == pytest.approx(1.60273, rel=1e-5)
    assert bound <= optimum.objective_j * (1 + RTOL)


@pytest.mark.slow  # six MILPs solved to optimality
@pytest.mark.parametrize("seed", range(6))
def test_the_bound_never_exceeds_the_proven_optimum_on_an_inverted_residual_block(seed):
    """MobileNetV2's block: a live tensor (the expand convolution's output) read by the recomputation of another
    live one (its BatchNorm's output), which a dead chain's recomputation (ReLU6, padding) reads."""
    import random

    rng = random.Random(seed)
    priced = price_simply(inverted_residual_graph([rng.choice([100, 200, 400]) for _ in range(8)]),
                          page_j_per_byte=rng.choice([1e-5, 1e-4, 1e-3]))
    budget = max(minimum_ram_bytes(priced), rng.uniform(0.0, 0.6) * no_remat_peak_bytes(priced))
    optimum = _milp_optimum(priced, budget, 1.5)
    assert optimum.status == "optimal", optimum.message
    stronger = eviction_bound_j(priced, budget, 1.5 * priced.base_runtime_s, second_restorations=True)
    assert stronger <= optimum.objective_j * (1 + RTOL)


def test_an_input_read_by_a_second_level_recomputation_between_two_absences_is_restored_twice():
    """Recomputing the padding for the depthwise backward recomputes the ReLU6 (dead), which reads the BatchNorm's
    output (live: the ReLU6's backward reads it), whose recomputation reads the expand convolution's output (live:
    the BatchNorm's backward reads it). Absent before and again at the depthwise backward (no room at 800 bytes),
    that output is restored twice: the bound reaches the optimum, 0.91853 J, where the first problem proves 0.91443 J
    (and so did the second before it counted this case)."""
    priced = price_simply(inverted_residual_graph([400, 200, 200, 400, 200, 100, 400, 400]), page_j_per_byte=1e-5)
    budget = 800
    assert minimum_ram_bytes(priced) <= budget
    runtime = 1.5 * priced.base_runtime_s
    optimum = _milp_optimum(priced, budget, 1.5)
    assert optimum.status == "optimal" and optimum.objective_j == pytest.approx(0.91853, rel=1e-6)
    assert eviction_bound_j(priced, budget, runtime) == pytest.approx(0.91443, rel=1e-6)
    assert eviction_bound_j(priced, budget, runtime, second_restorations=True) == pytest.approx(0.91853, rel=1e-6)


def test_a_solve_not_proven_by_the_first_bound_tries_second_restorations():
    priced, budget = _block_at_its_floor()
    phases = []
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.2, mip_gap=1e-9),
                            progress=lambda report: phases.append(report.phase))
    assert "stronger lower bound" in phases
    assert result.status == "optimal" and result.objective_j == pytest.approx(0.88173, rel=1e-6)
    assert result.bound_j >= eviction_bound_j(priced, budget, 1.2 * priced.base_runtime_s,
                                              second_restorations=True) * (1 - RTOL)
    # Proven by the first bound (the budget does not bind here): no second problem is solved.
    phases.clear()
    solve_schedule(priced, SolveOptions(ram_budget_bytes=no_remat_peak_bytes(priced) - 1, runtime_factor=1.2),
                   progress=lambda report: phases.append(report.phase))
    assert "stronger lower bound" not in phases


@pytest.mark.slow  # ~35 s: traces hf_bert, solves both covering problems alone (the second's chain round 20 s)
def test_the_second_covers_evictions_start_the_greedy_even_where_its_bound_is_no_higher(monkeypatch):
    """hf_bert at 45% on m4: both covering problems prove 0.0818268 J, with different evictions. The greedy from the
    first's stops 0.05% above the bound (0.0818692 J), outside a gap of 0.01%; from the second's at the bound, which
    proves it optimal. (The ejection moves run beside the second problem can reach the bound first: they find nothing
    here, so that the greedies alone are tested.)"""
    from host.costs.pricing import price_graph
    from host.run.sources import ModelSource, load_platform
    from host.solver import solve

    monkeypatch.setattr(solve, "ejection_search", lambda *args, **kwargs: iter(()))
    outcomes: list[str] = []

    def recorded_cover(*args, **kwargs):
        try:
            cover = eviction_cover(*args, **kwargs)
        except KeyboardInterrupt:
            outcomes.append("stopped")
            raise
        outcomes.append("answered")
        return cover

    monkeypatch.setattr(solve, "eviction_cover", recorded_cover)

    priced = price_graph(ModelSource("hf_bert").resolve().graph, load_platform("m4"))
    budget, runtime = 0.45 * no_remat_peak_bytes(priced), 1.2 * priced.base_runtime_s
    first = eviction_cover(priced, budget, runtime)
    second = eviction_cover(priced, budget, runtime, second_restorations=True)
    assert first.closed and second.closed and second.bound_j == pytest.approx(first.bound_j, rel=RTOL)
    assert first.start(priced.graph.size) != second.start(priced.graph.size)
    gap = 1e-4
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.2, time_limit_s=60,
                                                 mip_gap=gap))
    rows = {row.name: row for row in result.baselines}
    assert rows[GREEDY_FROM_COVER].energy_j > first.bound_j * (1 + 3 * gap)
    stronger_greedy_j = rows[GREEDY_FROM_STRONGER_COVER].energy_j
    assert stronger_greedy_j < rows[GREEDY_FROM_COVER].energy_j and stronger_greedy_j <= second.bound_j / (1 - gap)
    assert result.status == "optimal" and result.objective_j == pytest.approx(stronger_greedy_j, rel=1e-9)
    assert result.model_columns == 0, "the MILP was built although the bound already proved a baseline"
    # The greedy ran as the second problem's first round closed, and proved the answer while its round of chains of
    # recomputations ran on (it took the rest of its 40 s when the greedy waited for it).
    assert outcomes == ["answered", "stopped"], outcomes


@pytest.mark.slow  # ~13 s: traces hf_bert
def test_chains_of_recomputations_through_live_tensors_bound_one_layer_hf_bert_next_to_its_optimum(monkeypatch):
    """hf_bert with one encoder layer at 40% on m4, where the MILP finds 0.0611650 J and proves 0.0610885 J (120 s).
    Recomputing the head's LayerNorm output recomputes, through a dozen live tensors, the attention product that its
    backward reads again: twice in one gap. Followed only one live tensor deep, the bound is 0.0594725 J (2.6-2.8%
    below the optimum) and the greedy from the cover 0.0638809 J; with the chains a solved cover needs, the bound is
    0.0610590 J and the greedy from its cover within 0.2% of it, which proves that schedule within 0.2% of the optimum
    without the MILP."""
    import transformers

    from host.costs.pricing import price_graph
    from host.run.sources import ModelSource, load_platform
    from host.solver.policy_search import greedy_policy_search, plan_energy_j

    bert_config = transformers.BertConfig
    monkeypatch.setattr(transformers, "BertConfig", lambda **fields: bert_config(**{**fields, "num_hidden_layers": 1}))
    priced = price_graph(ModelSource("hf_bert").resolve().graph, load_platform("m4"))
    budget, runtime = 0.4 * no_remat_peak_bytes(priced), 1.2 * priced.base_runtime_s
    cover = eviction_cover(priced, budget, runtime, second_restorations=True, time_limit_s=120)
    assert cover.closed and cover.bound_j == pytest.approx(0.0610590, rel=1e-5)
    plan, _ = greedy_policy_search(priced, budget, runtime, start=cover.start(priced.graph.size))
    assert cover.bound_j <= plan_energy_j(plan, priced) <= cover.bound_j * 1.002


def _chain_case(seed: int):
    """A random graph, or a chain whose every activation its backward reads (so recomputing one recomputes the live
    ones below it), with a random budget, paging price and runtime factor."""
    import random

    rng = random.Random(seed)
    size = rng.randint(6, 12)
    if rng.random() < 0.5:
        graph = random_training_graph(seed + 1, size)
    else:
        graph = training_graph_from_forward("chain", [[]] + [[i - 1] for i in range(1, size)],
                                            [rng.choice([64, 128, 256, 512]) for _ in range(size)],
                                            [0] + [rng.choice([100, 1000, 10000]) for _ in range(size - 1)])
    priced = price_simply(graph, page_j_per_byte=rng.choice([1e-6, 1e-4, 1e-3]))
    budget = max(minimum_ram_bytes(priced), rng.uniform(0.2, 0.7) * no_remat_peak_bytes(priced))
    return priced, budget, rng.choice([1.2, 1.5, 3.0])


@pytest.mark.parametrize("seed", [503] + [pytest.param(seed, marks=pytest.mark.slow) for seed in (479, 487, 523, 540)])
def test_the_bound_with_chains_added_round_by_round_never_exceeds_the_proven_optimum(seed, monkeypatch):
    """Cases where solved covers need chains of recomputations (several rounds of them on seeds 479 and 487): the bound
    stays at or below the MILP's proven optimum. (Of 101 such cases this generator gave from seed 0 in 240 s, none
    exceeded it.)"""
    from host.solver import eviction_bound

    added: list[int] = []
    violated_chains = eviction_bound._violated_chains
    monkeypatch.setattr(eviction_bound, "_violated_chains",
                        lambda *args: added.append(len(found := violated_chains(*args))) or found)
    priced, budget, runtime_factor = _chain_case(seed)
    stronger = eviction_bound_j(priced, budget, runtime_factor * priced.base_runtime_s, second_restorations=True)
    assert sum(added) > 0, "no chain was added: the case no longer tests them"
    optimum = _milp_optimum(priced, budget, runtime_factor)
    assert optimum.status == "optimal", optimum.message
    assert stronger <= optimum.objective_j * (1 + RTOL)


def test_each_round_of_chains_starts_a_greedy_and_the_solve_keeps_the_cheapest():
    """A case where the greedy from the second round's cover (chains added) lands at 1.17753 J and from the first
    round's at 0.16533 J: both are tried, and the solve keeps one row for the second covering problem's greedies, the
    cheaper."""
    from host.solver.policy_search import greedy_policy_search, plan_energy_j

    priced, budget, runtime_factor = _chain_case(580)
    runtime = runtime_factor * priced.base_runtime_s
    cover = eviction_cover(priced, budget, runtime, second_restorations=True)
    starts = cover.starts(priced.graph.size)
    assert len(starts) == 2 and starts[0] == cover.start(priced.graph.size)
    greedy_j = [plan_energy_j(greedy_policy_search(priced, budget, runtime, start=start)[0], priced)
                for start in starts]
    assert greedy_j[1] < 0.2 * greedy_j[0]
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=runtime_factor,
                                                 time_limit_s=60, mip_gap=1e-9))
    rows = [row for row in result.baselines if row.name == GREEDY_FROM_STRONGER_COVER]
    assert len(rows) == 1 and rows[0].energy_j == pytest.approx(greedy_j[1], rel=1e-9)


def test_a_round_cut_short_by_its_deadline_starts_a_greedy_and_its_cover_is_no_bound(monkeypatch):
    """The case above with its second round stopped before it closes (its result replaced by one whose bound is far
    below its cover, as HiGHS returns at a deadline): that round's cover is a start of its own, after the closed
    round's, and the bound stays the closed round's. The solve runs a greedy from each, and keeps the cheaper (the
    first round's, 0.16533 J; the cut round's lands at 1.17753 J)."""

    import host.solver.backends.highs as highs
    from host.solver import solve

    solved: list[MilpResult] = []
    cut_call = 2  # alone, the second round is the covering problem's second solve
    solve_highs = highs.solve_highs

    def second_round_cut_short(problem, **options):
        result = solve_highs(problem, **options)
        if problem.name != "eviction bound":
            return result
        solved.append(result)
        if len(solved) == cut_call:
            return dataclasses.replace(result, status="feasible", bound=0.5 * result.objective)
        return result

    priced, budget, runtime_factor = _chain_case(580)
    runtime = runtime_factor * priced.base_runtime_s
    closed = eviction_cover(priced, budget, runtime, second_restorations=True)
    monkeypatch.setattr(highs, "solve_highs", second_round_cut_short)
    cut = eviction_cover(priced, budget, runtime, second_restorations=True)
    assert len(solved) == 2 and not cut.unclosed_round.closed
    # the first round's cover and bound, then the cut round's cover as the last start
    first_round = closed.earlier_rounds[0]
    assert cut.start(priced.graph.size) == first_round.start(priced.graph.size)
    assert cut.bound_j == pytest.approx(first_round.bound_j, rel=1e-9)
    assert cut.starts(priced.graph.size) == [first_round.start(priced.graph.size), closed.start(priced.graph.size)]
    solved.clear()
    cut_call = 3  # in a solve, the first covering problem is solved first
    greedy_starts = []
    price_greedy = solve.price_greedy
    monkeypatch.setattr(solve, "price_greedy", lambda *args: greedy_starts.append(args[-2]) or price_greedy(*args))
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=runtime_factor,
                                                 time_limit_s=60, mip_gap=1e-9))
    assert len(solved) == 3 and greedy_starts == cut.starts(priced.graph.size)
    rows = [row for row in result.baselines if row.name == GREEDY_FROM_STRONGER_COVER]
    assert len(rows) == 1 and rows[0].energy_j == pytest.approx(0.16533, rel=1e-4)


def test_ctrl_c_during_a_later_rounds_greedy_keeps_the_schedule_of_the_one_before(monkeypatch):
    """The case above, stopped (KeyboardInterrupt) while the greedy from the second round's cover runs (the one from
    the first round's ran as that round closed, beside the second): the answer is marked interrupted and keeps the
    greedy from the first round's cover (0.16533 J) among its baselines."""
    from host.solver import solve

    calls: list[int] = []
    price_greedy = solve.price_greedy

    def interrupted_on_the_second_call(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return price_greedy(*args)

    monkeypatch.setattr(solve, "price_greedy", interrupted_on_the_second_call)
    priced, budget, runtime_factor = _chain_case(580)
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=runtime_factor,
                                                 time_limit_s=60, mip_gap=1e-9))
    assert len(calls) == 2 and result.interrupted
    rows = [row for row in result.baselines if row.name == GREEDY_FROM_STRONGER_COVER]
    assert len(rows) == 1 and rows[0].energy_j == pytest.approx(0.16533, rel=1e-4)


def test_a_cover_cut_short_within_its_closing_tolerance_counts_as_closed():
    """HiGHS can stop at its time limit with its best cover 0.0045% above its bound (MobileNetV2 at 30% on jetsontx2):
    that cover is closed, and the solve goes on to the second problem; a cover farther from its bound is not."""
    def result(status, objective, bound):
        return MilpResult(status, None, objective, bound, None, 15.0)

    assert is_closed(result("optimal", 1.0, 1.0))
    assert is_closed(result("feasible", 0.9743873, 0.9743435))
    assert not is_closed(result("feasible", 1.0, 1.0 - 2 * CLOSED_RTOL))
    assert not is_closed(result("timeout", None, None)) and not is_closed(result("feasible", None, 0.5))


def _first_cover_cut_short(monkeypatch, starts: list) -> None:
    """HiGHS stops the first covering problem it is given at its first improving cover (a real limit of its own, as
    its time limit stops resnet50 at 30% on m4: a cover far above its bound); ``starts`` collects the start each
    covering problem is given."""
    import host.solver.backends.highs as highs

    solve_highs = highs.solve_highs

    def first_cut_short(problem, **options):
        if problem.name != "eviction bound":
            return solve_highs(problem, **options)
        starts.append(options.get("start"))
        if len(starts) == 1:
            monkeypatch.setitem(highs._EXTRA_OPTIONS, "mip_max_improving_sols", 1)
        try:
            return solve_highs(problem, **options)
        finally:
            highs._EXTRA_OPTIONS.pop("mip_max_improving_sols", None)

    monkeypatch.setattr(highs, "solve_highs", first_cut_short)


def _resnet18_cifar_at_40_percent_on_jetsontx2():
    from host.costs import price_graph
    from host.run.sources import ModelSource, load_platform

    priced = price_graph(ModelSource("resnet18_cifar").resolve().graph, load_platform("jetsontx2"))
    return priced, 0.4 * no_remat_peak_bytes(priced), 1.2 * priced.base_runtime_s


def test_a_cover_cut_short_is_resumed_from_its_best_cover_and_closes_at_the_uncut_bound(monkeypatch):
    """resnet18_cifar at 40% on jetsontx2: cut short, the first problem proves 0.51284 J with a cover far above it;
    resumed, HiGHS starts from that cover and closes at the bound of the problem solved whole (0.51291 J)."""
    priced, budget, runtime = _resnet18_cifar_at_40_percent_on_jetsontx2()
    whole = eviction_cover(priced, budget, runtime)
    starts: list = []
    _first_cover_cut_short(monkeypatch, starts)
    cut = eviction_cover(priced, budget, runtime)
    assert not cut.closed and cut.solution is not None and cut.bound_j < whole.bound_j * (1 - 1e-5)
    resumed = eviction_cover(priced, budget, runtime, resume=cut)
    assert starts[0] is None and starts[1] is cut.solution
    assert resumed.closed and resumed.solution is None
    assert resumed.bound_j == pytest.approx(whole.bound_j, rel=1e-7)
    # A resumed problem that proves less than the cover it resumes keeps that cover's bound.
    higher = dataclasses.replace(cut, bound_j=whole.bound_j * 1.01)
    assert eviction_cover(priced, budget, runtime, resume=higher).bound_j == higher.bound_j


@pytest.mark.slow  # ~35 s: a 30 s solve
def test_a_solve_whose_first_cover_did_not_close_resumes_it_and_then_tries_second_restorations(monkeypatch):
    """The first covering problem cut short: the solve solves it again from its best cover beside the ejection moves
    (the second problem needs a closed first), proves the uncut problem's bound, and runs a greedy from the resumed
    cover's evictions; closed, with time left, the problem with second restorations follows, and lifts the bound as
    it does after a first problem that closed (0.52070 J against 0.51291 J here; one CI run's second problem closed
    at 0.51603 J, so the test asks only that it lifts the bound, and that the solve takes that lift)."""
    priced, budget, runtime = _resnet18_cifar_at_40_percent_on_jetsontx2()
    whole = eviction_cover(priced, budget, runtime)
    second = eviction_cover(priced, budget, runtime, second_restorations=True)
    assert second.bound_j > whole.bound_j * (1 + 1e-3)
    starts: list = []
    _first_cover_cut_short(monkeypatch, starts)
    phases: list[str] = []
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.2, time_limit_s=30),
                            progress=lambda report: phases.append(report.phase))
    assert phases.index("lower bound, resumed") < phases.index("stronger lower bound")
    assert starts[1] is not None  # the first problem, then that problem from its cover
    assert result.bound_j > whole.bound_j * (1 + 1e-3)  # the first problem's bound, lifted by the second's
    assert any(row.name == GREEDY_FROM_RESUMED_COVER and row.feasible for row in result.baselines)


def test_after_a_resumed_cover_the_second_problem_runs_only_with_its_least_time_left():
    """Its least, 1.5 times the first problem's time, must fit before the share kept for its greedies, the ejection
    moves and the answer (75% of the limit less the reserve); after a first problem that closed it gets that least
    whatever is left, up to the limit."""
    import time

    from host.solver.solve import _stronger_bound_time_s

    options = SolveOptions(ram_budget_bytes=1.0, time_limit_s=120)
    now = time.perf_counter()
    # 20 s in: 70 s left before the 90 s mark
    assert 69 < _stronger_bound_time_s(options, 20.0, now - 20, 0.0, after_resumed=True) <= 70
    # 70 s in: 20 s left, less than 30 s
    assert _stronger_bound_time_s(options, 20.0, now - 70, 0.0, after_resumed=True) == 0.0
    assert 29 < _stronger_bound_time_s(options, 20.0, now - 70, 0.0) <= 30


def test_a_recomputed_input_of_a_recomputation_needs_its_own_inputs_in_turn():
    """Two residual blocks: recomputing relu2 reads add2's output, which no stage reads any more; recomputing that
    reads bn2's output, dead too. Each level is kept, paged or recomputed, and the bound meets the MILP's optimum
    (0.98233 J). Charging only the first level (add2's output) gives 0.98223 J."""
    priced = price_simply(residual_graph(2, [100, 400, 200, 100, 200, 200, 200, 400, 100, 400, 400]),
                          page_j_per_byte=1e-4)
    budget = 0.591738622 * no_remat_peak_bytes(priced)
    optimum = _milp_optimum(priced, budget, 1.5)
    assert optimum.status == "optimal"
    assert eviction_bound_j(priced, budget, 1.5 * priced.base_runtime_s) == pytest.approx(optimum.objective_j,
                                                                                          rel=RTOL)


def test_a_recomputations_input_that_no_stage_reads_any_more_is_paid_for_or_kept():
    """Traced mlp on m4 at its floor: recomputing a ReLU's output needs the input its last reader has passed.

    Counting the ReLU's bytes as freed for the price of one ReLU gives 1.93 mJ; the input must be restored
    too, or kept (holding as many bytes), and the bound meets the MILP's proven optimum, 2.15 mJ.
    """
    from host.costs.pricing import price_graph
    from host.run.sources import ModelSource, load_platform

    priced = price_graph(ModelSource("mlp").resolve().graph, load_platform("m4"))
    budget = minimum_ram_bytes(priced)
    optimum = _milp_optimum(priced, budget)
    assert optimum.status == "optimal", optimum.message
    bound = eviction_bound_j(priced, budget, 1.2 * priced.base_runtime_s)
    assert bound == pytest.approx(optimum.objective_j, rel=1e-5)
    assert bound > 1.1 * priced.compute_j.sum()


def test_a_budget_that_does_not_bind_forces_nothing():
    priced = price_simply(chain_graph(6))
    peak = no_remat_peak_bytes(priced)
    excess, _ = stage_excess_bytes(priced, peak)
    assert excess.max() <= 0
    assert eviction_bound_j(priced, peak, priced.base_runtime_s) == pytest.approx(priced.compute_j.sum())
    # One byte less and some stage must evict a live tensor.
    excess, live = stage_excess_bytes(priced, peak - 1)
    assert excess.max() == 1 and live[int(excess.argmax())]


def test_without_recomputation_or_paging_nothing_can_be_evicted():
    priced = price_simply(chain_graph(6))
    assert eviction_bound_j(priced, no_remat_peak_bytes(priced) - 1, None, remat=False, paging=False) is None


def test_a_solve_reports_the_eviction_bound_and_proves_a_baseline_optimal_with_it():
    """Where a baseline meets the eviction bound, the solve is optimal without building the MILP."""
    priced = price_simply(random_training_graph(3, 6), page_j_per_byte=1e-3)
    budget = max(minimum_ram_bytes(priced), 0.5 * no_remat_peak_bytes(priced))
    bound = eviction_bound_j(priced, budget, 1.2 * priced.base_runtime_s)
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.2, mip_gap=1e-3,
                                                 time_limit_s=60))
    assert result.status == "optimal"
    assert result.bound_j == pytest.approx(bound, rel=RTOL)
    assert result.gap <= 1e-3 and bound > 1.1 * priced.compute_j.sum()  # 1.006 J against 0.906 J
    assert result.model_columns == 0, "the MILP was built although the bound already proved a baseline"
    assert "forced evictions" in result.message


def test_the_greedy_also_starts_from_the_covers_evictions_and_does_better_on_resnet18_cifar():
    """Priced as a baseline of its own; on resnet18_cifar at 40% on jetsontx2 it is the cheaper start."""
    from host.costs import price_graph
    from host.run.sources import ModelSource, load_platform

    priced = price_graph(ModelSource("resnet18_cifar").resolve().graph, load_platform("jetsontx2"))
    budget, runtime = 0.4 * no_remat_peak_bytes(priced), 1.2 * priced.base_runtime_s
    cover = eviction_cover(priced, budget, runtime)
    assert cover.recomputed and cover.paged  # this bound recomputes some tensors and pages others
    rows = {row.name: row for row in price_baselines(priced, budget, runtime,
                                                     cover_start=cover.start(priced.graph.size))}
    assert rows[GREEDY].feasible and rows[GREEDY_FROM_COVER].feasible
    # measured: 0.5245 J from the cover, 0.5372 J from keeping everything; the bound 0.5129 J
    assert cover.bound_j <= rows[GREEDY_FROM_COVER].energy_j < rows[GREEDY].energy_j * (1 - 0.005)


@pytest.mark.slow  # ~10 s: traces MobileNetV2
def test_a_ctrl_c_while_the_bound_is_solved_lands_at_once():
    """The covering problem of MobileNetV2 at 30% on a72 takes HiGHS seconds; a Ctrl-C must not wait for it."""
    import os
    import signal
    import threading
    import time

    from host.costs import price_graph
    from host.run.sources import ModelSource, load_platform

    priced = price_graph(ModelSource("tests.models.huggingface:mobilenet_v2").resolve().graph, load_platform("a72"))
    budget, runtime = 0.3 * no_remat_peak_bytes(priced), 1.2 * priced.base_runtime_s
    landed = threading.Event()

    def ctrl_c_until_it_lands():
        # Under load, 2 of 3 runs of the solver's tests beside the CLI's saw no KeyboardInterrupt from a single signal
        # (Python drops one raised while the main thread runs a finalizer, the likely cause; not proven). A user
        # presses again: so does this, 0.4 s later, still well within the 2.5 s asked.
        for _ in range(3):
            if landed.wait(0.5 if _ == 0 else 0.4):
                return
            os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=ctrl_c_until_it_lands, daemon=True)
    started = time.perf_counter()
    sender.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            eviction_cover(priced, budget, runtime, time_limit_s=30)
            time.sleep(5)  # not reached if the interrupt landed while the bound was solved
    finally:
        landed.set()
        sender.join()
    assert time.perf_counter() - started < 2.5


def test_the_plain_greedy_is_skipped_when_the_greedy_from_the_cover_is_already_good_enough():
    priced = price_simply(random_training_graph(3, 6), page_j_per_byte=1e-3)
    budget = max(minimum_ram_bytes(priced), 0.5 * no_remat_peak_bytes(priced))
    runtime = 1.2 * priced.base_runtime_s
    start = eviction_cover(priced, budget, runtime).start(priced.graph.size)
    both = {row.name: row for row in price_baselines(priced, budget, runtime, cover_start=start)}
    assert both[GREEDY_FROM_COVER].feasible and GREEDY in both
    enough = {row.name for row in price_baselines(priced, budget, runtime, cover_start=start,
                                                  enough_j=both[GREEDY_FROM_COVER].energy_j)}
    assert GREEDY_FROM_COVER in enough and GREEDY not in enough
    assert "checkpoint_sequential(2)" in enough  # the other baselines are all priced
