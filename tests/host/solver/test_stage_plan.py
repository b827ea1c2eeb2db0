"""Stage plans: the lossless polish applied to a checked answer."""


def test_page_outs_never_paged_in_are_dropped_and_nothing_else():
    from host.solver.stage_plan import StagePlan, drop_unread_pages

    plan = StagePlan.empty(4)
    plan.page_out[1, 0] = plan.keep_flash[2, 0] = True  # paged out, kept, never read back
    plan.page_out[1, 2] = plan.keep_flash[2, 2] = plan.page_in[3, 2] = True  # read back at stage 3
    pruned = drop_unread_pages(plan)
    assert not pruned.page_out[:, 0].any() and not pruned.keep_flash[:, 0].any()
    assert pruned.page_out[1, 2] and pruned.keep_flash[2, 2] and pruned.page_in[3, 2]
    assert (pruned.recompute == plan.recompute).all() and (pruned.keep_ram == plan.keep_ram).all()
    assert drop_unread_pages(pruned) is None
