import pytest

from device_agent.schedule import Instruction
from host.solver.baselines import keep_all_plan
from host.solver.stage_plan import lower_plan, make_schedule
from host.solver.validator import ScheduleValidationError, validate_schedule

from .graphs import chain_graph, price_simply


def _schedule(graph, instructions, **kw):
    return make_schedule(graph, instructions, **kw)


def test_keep_all_plan_validates_and_counts_every_node_once():
    graph = chain_graph()
    priced = price_simply(graph)
    report = validate_schedule(_schedule(graph, lower_plan(keep_all_plan(graph), graph)), priced)
    assert report.computes == graph.size
    assert report.recomputes == 0 and report.page_ins == 0 and report.page_outs == 0
    assert report.energy_j == pytest.approx(priced.base_compute_j)
    assert report.runtime_s == pytest.approx(priced.base_runtime_s)
    assert report.ram_timeline_bytes[-1] == 0


def test_missing_dependency_is_rejected_with_its_name():
    graph = chain_graph()
    with pytest.raises(ScheduleValidationError, match=r"needs \['f0'\] in RAM"):
        validate_schedule(_schedule(graph, [Instruction("compute", 1)]), price_simply(graph))


def test_budget_is_checked_at_every_instruction():
    graph = chain_graph()
    instructions = lower_plan(keep_all_plan(graph), graph)
    with pytest.raises(ScheduleValidationError, match="exceeds the budget"):
        validate_schedule(_schedule(graph, instructions), price_simply(graph), ram_budget_bytes=150)


def test_page_in_needs_a_flash_copy_and_unknown_nodes_are_named():
    graph = chain_graph()
    priced = price_simply(graph)
    with pytest.raises(ScheduleValidationError, match="no copy on flash"):
        validate_schedule(_schedule(graph, [Instruction("page_in", 0)]), priced)
    with pytest.raises(ScheduleValidationError, match="unknown node 99"):
        validate_schedule(_schedule(graph, [Instruction("compute", 99)]), priced)


def test_leftover_tensors_and_missing_computes_are_errors():
    graph = chain_graph()
    priced = price_simply(graph)
    with pytest.raises(ScheduleValidationError, match="never computes"):
        validate_schedule(_schedule(graph, [Instruction("compute", 0), Instruction("free", 0)]), priced)
    full = lower_plan(keep_all_plan(graph), graph)
    with pytest.raises(ScheduleValidationError, match="must be freed"):
        validate_schedule(_schedule(graph, full[:-1]), priced)


def test_fingerprint_mismatch_names_the_fix():
    graph = chain_graph()
    schedule = _schedule(graph, lower_plan(keep_all_plan(graph), graph))
    other = chain_graph(bytes_each=101)
    with pytest.raises(ScheduleValidationError, match="solve the schedule again"):
        validate_schedule(schedule, price_simply(other))


def test_paging_round_trip_is_priced():
    graph = chain_graph(length=3)
    priced = price_simply(graph)
    ins = [Instruction("compute", 0), Instruction("page_out", 0), Instruction("free", 0, "ram"),
           Instruction("page_in", 0), Instruction("free", 0, "flash")]
    # finish the step plainly from here
    rest = [i for i in lower_plan(keep_all_plan(graph), graph) if not (i.kind == "compute" and i.node == 0)]
    report = validate_schedule(_schedule(graph, ins + rest), priced)
    assert report.page_outs == 1 and report.page_ins == 1
    assert report.paging_j == pytest.approx(priced.page_in_j[0] + priced.page_out_j[0])


def test_paging_in_the_runtime_counts_only_what_compute_does_not_hide():
    """With --paging-in-runtime, transfers run behind compute as the executor runs them: a page-out written
    while later nodes compute, and a page-in read ahead of its reader, cost the step nothing beyond compute."""
    graph = chain_graph(length=6, flops_each=10_000_000)  # each compute 10 ms; each transfer 0.2 ms
    priced = price_simply(graph)
    names = {node.name: node.index for node in graph.nodes}
    instructions = []
    for ins in lower_plan(keep_all_plan(graph), graph):
        if ins.kind == "compute" and ins.node == names["bwd:f1"]:
            instructions.append(Instruction("page_in", 0))  # read back for its last reader
        instructions.append(ins)
        if ins.kind == "compute" and ins.node == names["f1"]:
            instructions += [Instruction("page_out", 0), Instruction("free", 0, "ram")]
    instructions.append(Instruction("free", 0, "flash"))
    schedule = _schedule(graph, instructions)
    serial = validate_schedule(schedule, priced)
    assert serial.runtime_s == pytest.approx(serial.compute_s)  # the paper's runtime: compute only
    overlapped = validate_schedule(schedule, priced, paging_in_runtime=True)
    assert serial.paging_s > 0
    assert overlapped.runtime_s == pytest.approx(serial.compute_s)  # both transfers hidden
    # a budget the transfers' full sum would break, and the overlapped step meets
    validate_schedule(schedule, priced, paging_in_runtime=True,
                      runtime_budget_s=serial.compute_s + serial.paging_s / 2)
    slow = price_simply(graph, page_j_per_byte=1e-3)  # each transfer 0.1 s: longer than the computes around it
    waited = validate_schedule(schedule, slow, paging_in_runtime=True)
    assert waited.compute_s < waited.runtime_s < waited.compute_s + waited.paging_s
