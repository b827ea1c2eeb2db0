import pytest

from host.solver.deadline import Deadline
from host.solver.poet_milp import FormulationOptions, PoetFormulation
from host.solver.policy_search import (
    KEEP,
    PAGE,
    ejection_search,
    greedy_policy_plan,
    greedy_policy_search,
    model_stage_peaks,
    plan_energy_j,
    plan_from_policies,
    plan_runtime_s,
)
from host.solver.solve import evaluate_plan, minimum_ram_bytes, no_remat_peak_bytes

from .graphs import price_simply, random_training_graph, residual_graph, training_graph_from_forward


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("share", [0.5, 0.7])
def test_greedy_plan_fits_validates_and_warm_starts_the_milp(seed, share):
    priced = price_simply(random_training_graph(seed, 9))
    budget = max(minimum_ram_bytes(priced) * 1.2, share * no_remat_peak_bytes(priced))
    plan = greedy_policy_plan(priced, budget, None)
    if plan is None:
        pytest.skip("greedy found no plan at this budget (the MILP still may)")
    assert model_stage_peaks(plan, priced).max() <= budget
    report = evaluate_plan(plan, priced, ram_budget_bytes=budget)  # the lowering never exceeds the model
    assert report.energy_j == pytest.approx(priced.base_compute_j + plan_energy_j(plan, priced) - priced.compute_j.sum())
    formulation = PoetFormulation(priced, FormulationOptions(budget, None))
    assert formulation.start_from_plan(plan) is not None


def test_greedy_respects_the_ablations():
    priced = price_simply(random_training_graph(11, 9))
    budget = max(minimum_ram_bytes(priced) * 1.2, 0.6 * no_remat_peak_bytes(priced))
    remat_only = greedy_policy_plan(priced, budget, None, paging=False)
    assert remat_only is not None
    assert not remat_only.page_out.any() and not remat_only.page_in.any()
    assert remat_only.recompute.sum() > priced.graph.size  # it had to recompute something
    paging_only = greedy_policy_plan(priced, budget, None, remat=False)
    assert paging_only is not None
    assert paging_only.recompute.sum() == priced.graph.size  # each node computed exactly once
    assert paging_only.page_out.any()


def test_the_formulation_never_pages_a_zero_byte_tensor():
    """A 0-byte tensor (the batch, held by the caller) is kept for free: the model has no flash, page-in or page-out
    column for it. An executor cannot page the batch (a fleet calibration run failed with "node 0 has no page on
    flash" when a time-limited solve returned a schedule that paged it)."""
    graph = training_graph_from_forward("batch-first", [[]] + [[i - 1] for i in range(1, 6)], [0] + [100] * 5,
                                        [0] + [1000] * 5)
    priced = price_simply(graph)
    formulation = PoetFormulation(priced, FormulationOptions(0.5 * no_remat_peak_bytes(priced), None))
    zero = {n.index for n in graph.nodes if n.output_bytes == 0}
    assert 0 in zero
    for family in (formulation.vars.keep_flash, formulation.vars.page_in, formulation.vars.page_out):
        assert family and not [key for key in family if key[1] in zero]


def test_a_kept_gap_keeps_the_tensor_in_ram_across_that_gap_only():
    """relu0 of a residual block is read by conv1, add1, bwd:conv1 and bwd:relu0: paged, it is paged in before each
    read after a gap; with the gap that ends at bwd:conv1 kept, that page-in goes and the tensor stays in RAM."""
    priced = price_simply(residual_graph(1, [100] * 7))
    graph = priced.graph
    index = {node.name: node.index for node in graph.nodes}
    relu0, add1, bwd_conv1 = index["relu0"], index["add1"], index["bwd:conv1"]
    policy = [KEEP] * graph.size
    policy[relu0] = PAGE
    paged = plan_from_policies(priced, policy)
    kept = plan_from_policies(priced, policy, frozenset({(relu0, bwd_conv1)}))
    assert paged.page_in[add1 - 1, relu0] and paged.page_in[bwd_conv1 - 1, relu0]
    assert kept.page_in[add1 - 1, relu0] and not kept.page_in[bwd_conv1 - 1, relu0]
    assert kept.keep_ram[add1 + 1 : bwd_conv1 + 1, relu0].all()
    assert plan_energy_j(kept, priced) < plan_energy_j(paged, priced)


def test_the_local_search_keeps_a_tensor_across_single_gaps_where_that_fits():
    """resnet18_cifar at 40% on jetsontx2, greedy from keeping everything: a tensor's policy holds in every gap,
    and keeping one across the gaps where the budget has room took the plan from 0.5405 J to 0.5372 J."""
    from host.costs import price_graph
    from host.run.sources import ModelSource, load_platform

    priced = price_graph(ModelSource("resnet18_cifar").resolve().graph, load_platform("jetsontx2"))
    budget, runtime = 0.4 * no_remat_peak_bytes(priced), 1.2 * priced.base_runtime_s
    plan = greedy_policy_plan(priced, budget, runtime)
    assert model_stage_peaks(plan, priced).max() <= budget
    assert plan_energy_j(plan, priced) < 0.539


def test_the_local_search_never_takes_the_plan_over_the_runtime_budget():
    """Keeping a tensor across one gap can merge two short gaps into one that evicts, adding a recomputation.
    On this graph, at a runtime budget 0.56% above computing once, such a move took a fitting plan over the
    budget and the greedy returned nothing; the local search now refuses it and the plan stays within."""
    priced = price_simply(random_training_graph(335, 12), page_j_per_byte=1e-4)
    budget = max(minimum_ram_bytes(priced), 0.5442757615680235 * no_remat_peak_bytes(priced))
    runtime_budget_s = 1.005602603970087 * priced.base_runtime_s
    plan = greedy_policy_plan(priced, budget, runtime_budget_s)
    assert plan is not None
    assert plan_runtime_s(plan, priced, False) <= runtime_budget_s
    assert model_stage_peaks(plan, priced).max() <= budget


@pytest.mark.parametrize("size", [14, 20])
@pytest.mark.parametrize("seed", range(0, 60, 5))
def test_ejection_moves_yield_cheaper_plans_that_fit_and_validate(size, seed):
    priced = price_simply(random_training_graph(seed, size))
    budget = max(minimum_ram_bytes(priced) * 1.05, 0.5 * no_remat_peak_bytes(priced))
    runtime_budget_s = 1.5 * priced.base_runtime_s
    found = greedy_policy_search(priced, budget, runtime_budget_s)
    if found is None:
        pytest.skip("greedy found no plan at this budget")
    energy = plan_energy_j(found[0], priced)
    # every plan yielded is checked; the deadline only bounds how many (the last round takes up to 10 s on 20 nodes)
    for plan, _ in ejection_search(priced, found, budget, runtime_budget_s, deadline=Deadline(2.0)):
        assert plan_energy_j(plan, priced) < energy
        energy = plan_energy_j(plan, priced)
        assert model_stage_peaks(plan, priced).max() <= budget
        assert plan_runtime_s(plan, priced, False) <= runtime_budget_s
        report = evaluate_plan(plan, priced, ram_budget_bytes=budget)
        assert report.energy_j == pytest.approx(priced.base_compute_j + energy - priced.compute_j.sum())


def test_an_ejection_move_keeps_a_tensor_the_local_search_cannot_and_the_plan_costs_less():
    """Random graph 41 of 14 nodes at 70%: keeping one evicted tensor overflows stages no single or paired change of
    the local search repairs; the greedy, evicting others with that tensor held, finds a cheaper plan."""
    priced = price_simply(random_training_graph(41, 14))
    budget = max(minimum_ram_bytes(priced) * 1.05, 0.7 * no_remat_peak_bytes(priced))
    found = greedy_policy_search(priced, budget, None)
    plans = [plan for plan, _ in ejection_search(priced, found, budget, None)]
    assert plans
    kept_now = [i for i, policy in enumerate(found[1].policy) if policy != KEEP and not plans[-1].recompute[i + 1:, i].any()
                and not plans[-1].page_out[:, i].any()]
    assert kept_now  # a tensor the greedy evicted is in RAM throughout
    assert plan_energy_j(plans[-1], priced) < plan_energy_j(found[0], priced) * (1 - 1e-4)
    assert not list(ejection_search(priced, found, budget, None, deadline=Deadline(0.0)))


def test_ejection_moves_that_page_or_recompute_instead_find_a_cheaper_plan_than_keeping_moves_alone():
    """Random graph 20 of 14 nodes at 40%: no tensor the greedy evicts can be kept for less (the keeping moves alone
    return its 0.142978 J plan); switching evicted tensors to another eviction, and keeping one where the local search
    turns a dearer repair into a cheaper plan, lowers it to 0.14137 J."""
    priced = price_simply(random_training_graph(20, 14))
    budget = max(minimum_ram_bytes(priced) * 1.05, 0.4 * no_remat_peak_bytes(priced))
    found = greedy_policy_search(priced, budget, None)
    assert plan_energy_j(found[0], priced) == pytest.approx(0.142978, abs=1e-9)
    plans = [plan for plan, _ in ejection_search(priced, found, budget, None)]
    assert plans
    assert plan_energy_j(plans[-1], priced) == pytest.approx(0.14137, abs=1e-9)
    assert model_stage_peaks(plans[-1], priced).max() <= budget
    # here a backward node would be switched to recomputation, were it allowed
    backward = [i for i, node in enumerate(priced.graph.nodes) if node.kind == "bwd"]
    assert all(plan.recompute[:, i].sum() == 1 for plan in plans for i in backward)


@pytest.mark.parametrize("seed, share", [(4, 0.5), (32, 0.4), (36, 0.6)])
def test_ejection_moves_respect_the_ablations_and_never_recompute_a_backward_node(seed, share):
    """Random graphs of 14 nodes where the ejection search improves the greedy under each ablation: with paging off
    no plan pages, with recomputation off no node is computed twice, and no backward node is ever recomputed."""
    priced = price_simply(random_training_graph(seed, 14))
    budget = max(minimum_ram_bytes(priced) * 1.05, share * no_remat_peak_bytes(priced))
    backward = [i for i, node in enumerate(priced.graph.nodes) if node.kind == "bwd"]
    assert backward
    for paging, remat in [(False, True), (True, False), (True, True)]:
        found = greedy_policy_search(priced, budget, None, paging=paging, remat=remat)
        plans = [plan for plan, _ in ejection_search(priced, found, budget, None, paging=paging, remat=remat)]
        assert plans or (paging and remat)  # each ablation's moves found a cheaper plan
        for plan in plans:
            assert paging or not (plan.page_out.any() or plan.page_in.any())
            assert remat or plan.recompute.sum() == priced.graph.size
            assert all(plan.recompute[:, i].sum() == 1 for i in backward)
            assert model_stage_peaks(plan, priced).max() <= budget


def test_the_greedy_undoes_a_recomputation_whose_chain_peaks_at_the_worst_stage():
    """From the eviction cover's evictions on a residual block at 26% of its peak, the worst stage overflows while
    it recomputes a chain for its inputs; no tensor held across it frees enough. Keeping or paging one of the
    recomputed tensors does: the greedy finds a schedule 0.15% above the bound, where it used to get stuck."""
    from host.solver.eviction_bound import eviction_cover

    priced = price_simply(residual_graph(1, [100, 200, 400, 100, 200, 100, 400]), page_j_per_byte=1e-6)
    budget = max(minimum_ram_bytes(priced), 0.26014 * no_remat_peak_bytes(priced))
    runtime = 2.0 * priced.base_runtime_s
    cover = eviction_cover(priced, budget, runtime)
    found = greedy_policy_search(priced, budget, runtime, start=cover.start(priced.graph.size))
    assert found is not None
    plan = found[0]
    assert model_stage_peaks(plan, priced).max() <= budget
    report = evaluate_plan(plan, priced, ram_budget_bytes=budget, runtime_budget_s=runtime)
    assert report.energy_j == pytest.approx(0.60283, rel=1e-5)
    assert report.energy_j <= cover.bound_j * 1.002


def test_each_plan_the_ejection_search_yields_comes_with_the_policies_that_make_it_and_resumes_from_them():
    """Random graph 41 of 14 nodes at 70%: every plan yielded is the one its policies and kept gaps realise, so a
    search stopped after its first plan resumes from it and ends no dearer than the search that was not stopped."""
    priced = price_simply(random_training_graph(41, 14))
    budget = max(minimum_ram_bytes(priced) * 1.05, 0.7 * no_remat_peak_bytes(priced))
    found = greedy_policy_search(priced, budget, None)
    whole = list(ejection_search(priced, found, budget, None))
    assert whole
    for plan, start in whole:
        again = plan_from_policies(priced, start.policy, start.kept_gaps)
        assert (again.recompute == plan.recompute).all() and (again.keep_ram == plan.keep_ram).all()
        assert (again.page_out == plan.page_out).all()
    resumed = list(ejection_search(priced, whole[0], budget, None))
    last = resumed[-1][0] if resumed else whole[0][0]
    assert plan_energy_j(last, priced) <= plan_energy_j(whole[-1][0], priced) + 1e-12
