"""`poet solve` and `poet pareto`: the energy-optimal schedule, and energy against RAM budget."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from device_agent.optimizers import OPTIMIZER_STATE
from host.cli.common import (
    EXIT_OK,
    RAM_BUDGET_HELP,
    SOLVE_EXIT_CODES,
    Console,
    add_ablation_args,
    add_json_arg,
    add_model_args,
    add_solver_args,
    directory_path,
    file_path,
    int_at_least,
    mip_gap,
    model_keywords,
    ram_budget,
    solve_keywords,
)
from host.cli.display import format_bytes
from host.run.solve import DEFAULT_OPTIMIZER, ModelSource, SolveSettings, pareto, prepare_solve, run_solve


def _stem(model: str, platform: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{model}_{platform}")


def cmd_solve(args, console: Console) -> int:
    """Trace, price, solve; then write the schedule and plots, print the plan, and exit by its status."""
    settings = SolveSettings(**solve_keywords(args))
    source = ModelSource(args.model, **model_keywords(args))
    problem = prepare_solve(source, args.platform, args.ram_budget, settings, log=console.log,
                            optimizer=args.optimizer)
    graph, peak, budget = problem.graph, problem.no_remat_peak_bytes, problem.ram_budget_bytes
    if not args.json:
        console.print(f"model     {args.model}: {graph.size} nodes, {len(graph.edges)} edges, "
                      f"{graph.total_flops / 1e9:.3f} GFLOP per step")
        console.print(f"platform  {problem.profile.name}: energy {problem.profile.energy_source}")
        console.print(f"budget    RAM {format_bytes(budget)} ({100 * budget / peak:.0f}% of the no-remat peak "
                      f"{format_bytes(peak)}); runtime ×{args.runtime_budget:g}")
    try:
        report = run_solve(problem, progress=console.status)
    finally:
        console.status.close()
    if args.out and report.schedule is not None:
        report.save(args.out)
    plot_paths = []
    if args.plot and report.plan is not None and report.validation is not None:
        from host.plots import plot_ram_timeline, plot_schedule_matrices

        plot_dir = Path(args.plot)
        plot_dir.mkdir(parents=True, exist_ok=True)
        stem = _stem(args.model, report.platform)
        plot_paths.append(plot_schedule_matrices(report.plan, plot_dir / f"{stem}_matrices.png",
                                                 f"{args.model} on {report.platform}: schedule matrices",
                                                 schedule=report.schedule))
        plot_paths.append(plot_ram_timeline(report.validation.ram_timeline_bytes, budget, plot_dir / f"{stem}_ram.png",
                                            f"{args.model} on {report.platform}: controlled RAM",
                                            schedule=report.schedule))
    summary = report.to_dict()
    summary["schedule_file"] = args.out if report.schedule is not None and args.out else None
    summary["plots"] = [str(p) for p in plot_paths]
    if args.json:
        console.print_json(summary)
    else:
        _print_plan(console, summary, len(report.schedule.instructions) if report.schedule else 0)
    if report.interrupted:
        raise KeyboardInterrupt  # printed and written: now exit as interrupted (130, or 143 for SIGTERM)
    return SOLVE_EXIT_CODES.get(report.status, SOLVE_EXIT_CODES["timeout"])


def status_text(status: str, gap: float | None, interrupted: bool = False) -> str:
    """One phrase: the status and, when a schedule exists, its gap."""
    stopped = "interrupted" if interrupted else "the time limit stopped the solver"
    if status == "optimal":
        return f"optimal (gap {100 * (gap or 0):.3f}%)"
    if status == "feasible":
        return f"feasible: {stopped}, gap {100 * gap:.2f}%" if gap is not None else f"feasible: {stopped}"
    if status == "timeout":
        return "interrupted before any schedule was found" if interrupted else \
            "timeout: no schedule found within the time limit"
    return status


def _print_plan(console: Console, summary: dict, instructions: int) -> None:
    console.print(f"status    {status_text(summary['status'], summary['gap'], summary['interrupted'])}, "
                  f"solved in {summary['solve_s']:.2f} s")
    if summary["message"]:
        console.print(f"          {summary['message']}")
    if summary["objective_j"] is None:
        return
    console.print(f"energy    {summary['objective_j']:.6g} J per step  (compute {summary['compute_j']:.6g} J, "
                  f"paging {summary['paging_j']:.6g} J; {summary['energy_source']})")
    console.print(f"runtime   {summary['runtime_s']:.6g} s of {summary['runtime_budget_s']:.6g} s allowed")
    console.print(f"RAM       peak {format_bytes(summary['peak_ram_bytes'])} of "
                  f"{format_bytes(summary['ram_budget_bytes'])}, controlled by the schedule")
    fixed = fixed_text(summary["fixed_bytes"], summary["fixed_breakdown_bytes"], summary["optimizer"])
    console.print(f"fixed     {fixed}")
    console.print(f"plan      {summary['recomputes']} recomputes, {summary['page_outs']} page-outs, "
                  f"{summary['page_ins']} page-ins, {instructions} instructions (validated)")
    baselines = summary.get("baselines") or []
    fitting = sorted((b for b in baselines if b["status"] == "feasible"), key=lambda b: b["predicted_energy_j"])
    if fitting:
        best = fitting[0]
        console.print(f"baseline  best of {len(baselines)} priced ({len(fitting)} fit): {best['name']}, "
                      f"{best['predicted_energy_j']:.6g} J (`--json` lists them)")
    elif baselines:
        console.print(f"baseline  none of the {len(baselines)} priced fits the budgets (`--json` lists them)")
    if summary["schedule_file"]:
        console.print(f"wrote     {summary['schedule_file']}")
    for path in summary["plots"]:
        console.print(f"plot      {path}")


def fixed_text(fixed_bytes: int, breakdown: dict[str, int], optimizer: str) -> str:
    """The fixed bytes and what they hold, the optimizer's state named by its optimizer."""
    def short(value: int) -> str:
        return format_bytes(value, exact=False)

    return (f"{format_bytes(fixed_bytes)} beside the budget: weights {short(breakdown['params'])}, their gradients "
            f"{short(breakdown['param_grads'])}, {optimizer} state {short(breakdown['optimizer_state'])}, batch, "
            f"buffers and statistics {short(breakdown['other'])}")


def cmd_pareto(args, console: Console) -> int:
    keywords = model_keywords(args)
    keywords.pop("seed")
    report = pareto(args.model, args.platform, points=args.points, runtime_budget=args.runtime_budget,
                    time_limit_s=args.time_limit, solver=args.solver, formulation=args.formulation,
                    optimizer=args.optimizer, log=console.log, **keywords)
    rows = report.rows
    plot_path = None
    if args.plot:
        from host.plots import plot_pareto

        plot_dir = Path(args.plot)
        plot_dir.mkdir(parents=True, exist_ok=True)
        plot_path = plot_pareto(rows, plot_dir / f"{_stem(args.model, report.platform)}_pareto.png",
                                f"{args.model} on {report.platform}")
    if args.json:
        payload = report.to_dict()
        payload["plot"] = str(plot_path) if plot_path else None
        console.print_json(payload)
        return EXIT_OK
    console.print(f"{'RAM budget':>14}  {'method':<24} {'status':<11} {'energy J':>12} {'peak bytes':>12} "
                  f"{'recomp':>6} {'pg-in':>5} {'pg-out':>6}")
    for row in rows:
        energy = f"{row['energy_j']:.6g}" if row["energy_j"] is not None else "-"
        peak = f"{row['peak_ram_bytes']:,}" if row["peak_ram_bytes"] is not None else "-"
        console.print(f"{row['ram_budget_bytes']:>14,.0f}  {row['method']:<24} {row['status']:<11} {energy:>12} "
                      f"{peak:>12} {row.get('recomputes') or 0:>6} {row.get('page_ins') or 0:>5} "
                      f"{row.get('page_outs') or 0:>6}")
    console.print(f"fixed     {fixed_text(report.fixed_bytes, report.fixed_breakdown_bytes, report.optimizer)}")
    if plot_path:
        console.print(f"plot      {plot_path}")
    return EXIT_OK


def add_optimizer_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--optimizer", choices=list(OPTIMIZER_STATE), default=DEFAULT_OPTIMIZER,
                        help="the optimizer training will use (as `poet train --optimizer`); its state is part of the "
                             f"fixed bytes: sgd keeps a momentum buffer per trainable weight, adamw two and a step "
                             f"count (default: {DEFAULT_OPTIMIZER})")


def _state_the_time_limit(parser: argparse.ArgumentParser) -> None:
    """`poet solve`'s --time-limit bounds the whole solve, not only the MILP: say so in its help."""
    for action in parser._actions:
        if "--time-limit" in action.option_strings:
            action.help = ("wall-clock limit of the whole solve in seconds (warm start, baselines, model building, "
                           "MILP, polishing and validation; tracing the model is not counted); when it passes, the "
                           "best validated schedule so far is used with its gap, never costlier than the best "
                           f"baseline (default {action.default:g} s)")


def register(sub: argparse._SubParsersAction) -> None:
    solve = sub.add_parser("solve", help="solve the energy-optimal schedule for a model on a platform",
                           description="Solve the energy-optimal training schedule (what to keep, recompute and "
                                       "page to flash) of a model on a platform, under a RAM and a runtime budget.")
    add_model_args(solve)
    solve.add_argument("--ram-budget", type=ram_budget, required=True, metavar="BUDGET",
                       help="RAM for the controlled tensors (activations, their gradients, paged-in buffers): "
                            + RAM_BUDGET_HELP)
    add_solver_args(solve)
    _state_the_time_limit(solve)
    add_ablation_args(solve)
    solve.add_argument("--paging-in-runtime", action="store_true",
                       help="count paging time in the runtime budget, transfers behind compute as the executor runs them: a step takes the longer of its computes and the transfers they wait for (default: not counted, as in the paper)")
    solve.add_argument("--mip-gap", type=mip_gap, default=1e-3, metavar="GAP",
                       help="relative gap that counts as optimal, in [0, 1] (default 0.001 = 0.1%%)")
    add_optimizer_arg(solve)
    add_json_arg(solve)
    solve.add_argument("--plot", metavar="DIR", type=directory_path,
                       help="write PNGs of the schedule matrices and RAM over time to this directory, created if "
                            "missing (default: no plots)")
    solve.add_argument("--out", metavar="SCHEDULE_FILE", type=file_path,
                       help="write the validated schedule (poet.v1.Schedule JSON) for `poet train --schedule` "
                            "(default: not written)")
    solve.set_defaults(func=cmd_solve)

    sweep = sub.add_parser("pareto", help="energy against RAM budget for POET and the baselines",
                           description="Energy against RAM budget, from the hard floor to the no-remat peak: POET, "
                                       "its ablations, and the baselines.")
    add_model_args(sweep)
    add_solver_args(sweep, threads=False)
    sweep.add_argument("--points", type=int_at_least(2), default=6, metavar="N", help="number of RAM budgets, >= 2 (default 6)")
    add_optimizer_arg(sweep)
    add_json_arg(sweep)
    sweep.add_argument("--plot", metavar="DIR", type=directory_path,
                       help="write a PNG of the frontier to this directory, created if missing (default: no plot)")
    sweep.set_defaults(func=cmd_pareto)
