"""The `poet` command: list models and platforms, profile this machine, solve and compare schedules."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

EXIT_OK = 0
EXIT_INTERNAL = 1  # a solver answer that failed validation (a bug: please report it)
EXIT_USAGE = 2  # bad input: unknown names, malformed values, impossible budgets
EXIT_INFEASIBLE = 3
EXIT_TIMEOUT = 4


class CliError(Exception):
    """A user-facing error: printed as one line naming the problem and the fix."""


# ---------------------------------------------------------------------------------------- helpers
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
               "g": 1024**3, "gb": 1000**3, "gib": 1024**3}


def parse_ram_budget(text: str, no_remat_peak_bytes: int | None = None) -> float:
    """Bytes, with an optional unit (KiB, MB, …), or a percentage of the no-remat peak ("50%")."""
    value = text.strip().lower().replace("_", "").replace(",", "")
    if value.endswith("%"):
        try:
            percent = float(value[:-1])
        except ValueError:
            raise CliError(f"--ram-budget {text!r} is not a valid percentage (e.g. 50%)") from None
        if no_remat_peak_bytes is None:
            raise CliError("--ram-budget as a percentage needs the model's no-remat peak")
        return percent / 100.0 * no_remat_peak_bytes
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)", value)
    if not match or match.group(2) not in _SIZE_UNITS:
        raise CliError(
            f"--ram-budget {text!r} is not a size: give bytes (3000000), a unit (3MB, 2.5MiB) "
            "or a share of the no-remat peak (50%)"
        )
    return float(match.group(1)) * _SIZE_UNITS[match.group(2)]


def _format_bytes(value: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit} ({value:,.0f} bytes)"
    return f"{value:,.0f} bytes"


def _load_priced(args):
    from host.costs import load_profile, price_graph
    from host.graph.resolve import resolve_model

    profile = load_profile(args.platform)
    input_shape = None
    if getattr(args, "input_shape", None):
        from host.graph.model_source import parse_input_shape

        input_shape = parse_input_shape(args.input_shape)
    resolved = resolve_model(
        args.model, input_shape=input_shape, batch_size=args.batch_size, granularity=args.granularity
    )
    return resolved, profile, price_graph(resolved.graph, profile)


class _LiveProgress:
    """One status line on stderr while the solver runs: elapsed time, incumbent, bound, gap."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last_print_s = 0.0

    def __call__(self, progress) -> None:
        if not self.enabled:
            return
        if not self.tty and progress.elapsed_s - self.last_print_s < 5.0:
            return
        self.last_print_s = progress.elapsed_s
        incumbent = f"{progress.incumbent_j:.6g} J" if progress.incumbent_j is not None else "none yet"
        bound = f"{progress.bound_j:.6g} J" if progress.bound_j is not None else "-"
        gap = f"{100 * progress.gap:.2f}%" if progress.gap is not None else "-"
        line = f"  solving  {progress.elapsed_s:6.1f} s   incumbent {incumbent}   bound {bound}   gap {gap}"
        sys.stderr.write(("\r" + line.ljust(100)) if self.tty else line + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()


# ---------------------------------------------------------------------------------------- commands
def cmd_models(args) -> int:
    from host.graph.poet2022 import POET2022_MODELS
    from host.graph.resolve import POET2022_PREFIX
    from host.graph.zoo import list_models

    print("Real PyTorch models (traced with torch.export):")
    for spec in list_models():
        shape = "x".join(str(d) for d in spec.input_shape)
        print(f"  {spec.name:<16} input {shape:<10} batch {spec.default_batch_size:<3} {spec.description}")
    print("\nReference graphs of the POET paper code (for number-for-number comparison):")
    print("  " + "  ".join(POET2022_PREFIX + name for name in POET2022_MODELS))
    print("\nYour own model: --model package.module:factory [--input-shape 32,64]")
    return EXIT_OK


def cmd_platforms(args) -> int:
    from host.costs import list_platforms, load_profile

    print(f"{'platform':<12} {'compute':>13} {'J/GFLOP':>9} {'page-in':>11} {'page-out':>11} {'mem W':>6}  description")
    for name in list_platforms():
        p = load_profile(name)
        j_per_gflop = (p.energy_per_flop_j * 1e9) if p.energy_per_flop_j else p.compute_power_w / p.flops_per_s["default"] * 1e9
        print(
            f"{name:<12} {p.flops_per_s['default'] / 1e6:>8.2f} MF/s {j_per_gflop:>9.3f} "
            f"{p.page_in_throughput_bytes_per_s / 1e6:>7.1f} MB/s {p.page_out_throughput_bytes_per_s / 1e6:>7.1f} MB/s "
            f"{p.memory_power_w:>6.3f}  {p.description}"
        )
    print("\nA profile file of your own works too: --platform path/to/profile.json (see `poet profile --local`).")
    return EXIT_OK


def cmd_profile(args) -> int:
    from host.costs import save_profile
    from host.costs.local_bench import profile_local_machine

    if not args.local:
        raise CliError("only `poet profile --local` is supported: it measures this machine")
    flash_dir = args.flash_dir or "."
    profile = profile_local_machine(
        flash_dir, name=args.name, quick=args.quick, progress=lambda message: print(f"  {message}", file=sys.stderr)
    )
    out = Path(args.out or f"{args.name}.profile.json")
    save_profile(profile, out)
    print(f"wrote {out}")
    print(f"  compute  {profile.flops_per_s['default'] / 1e9:.2f} GFLOP/s (default), " + ", ".join(
        f"{k} {v / 1e9:.2f}" for k, v in profile.flops_per_s.items() if k != "default"))
    print(f"  page-out {profile.page_out_latency_s * 1e3:.3f} ms + {profile.page_out_throughput_bytes_per_s / 1e6:.1f} MB/s")
    print(f"  page-in  {profile.page_in_latency_s * 1e3:.3f} ms + {profile.page_in_throughput_bytes_per_s / 1e6:.1f} MB/s")
    print(f"  energy   {profile.energy_source}")
    return EXIT_OK


def solve_options(args, ram_budget_bytes: float):
    from host.solver.solve import SolveOptions

    return SolveOptions(
        ram_budget_bytes=ram_budget_bytes,
        runtime_factor=args.runtime_budget,
        solver=args.solver,
        time_limit_s=args.time_limit,
        paging=not args.no_paging,
        remat=not args.no_remat,
        paging_in_runtime=getattr(args, "paging_in_runtime", False),
        mip_gap=getattr(args, "mip_gap", 1e-3),
    )


def cmd_solve(args) -> int:
    from device_agent.serde import write_schedule_file
    from host.solver.solve import no_remat_peak_bytes, solve_schedule

    if args.runtime_budget < 1.0:
        raise CliError(
            f"--runtime-budget {args.runtime_budget} is below 1.0: it is a factor of the plain forward+backward "
            "runtime, so 1.0 means no extra compute; use e.g. 1.2"
        )
    started = time.perf_counter()
    resolved, profile, priced = _load_priced(args)
    graph = resolved.graph
    peak = no_remat_peak_bytes(priced)
    budget = parse_ram_budget(args.ram_budget, peak)
    if not args.json:
        print(f"model     {args.model}: {graph.size} nodes, {len(graph.edges)} edges, "
              f"{graph.total_flops / 1e9:.3f} GFLOP per step")
        print(f"platform  {profile.name}: energy {profile.energy_source}")
        print(f"budget    RAM {_format_bytes(budget)} ({100 * budget / peak:.0f}% of the no-remat peak "
              f"{_format_bytes(peak)}); runtime ×{args.runtime_budget}")
    live = _LiveProgress(enabled=not args.json)
    result = solve_schedule(priced, solve_options(args, budget), progress=live)
    live.done()
    total_s = time.perf_counter() - started
    schedule, report = result.schedule, result.report
    if args.out and schedule is not None:
        write_schedule_file(schedule, args.out)
    plot_paths = []
    if args.plot and result.plan is not None and report is not None:
        from host.plots import plot_ram_timeline, plot_schedule_matrices

        plot_dir = Path(args.plot)
        plot_dir.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{args.model}_{profile.name}")
        plot_paths.append(plot_schedule_matrices(result.plan, plot_dir / f"{stem}_matrices.png",
                                                 f"{args.model} on {profile.name}: schedule matrices"))
        plot_paths.append(plot_ram_timeline(report.ram_timeline_bytes, budget, plot_dir / f"{stem}_ram.png",
                                            f"{args.model} on {profile.name}: controlled RAM"))
    summary = {
        "status": result.status,
        "model": args.model,
        "platform": profile.name,
        "energy_source": profile.energy_source,
        "objective_j": report.energy_j if report else None,
        "compute_j": report.compute_j if report else None,
        "paging_j": report.paging_j if report else None,
        "runtime_s": report.runtime_s if report else None,
        "runtime_budget_s": result.runtime_budget_s,
        "peak_ram_bytes": report.peak_ram_bytes if report else None,
        "ram_budget_bytes": budget,
        "no_remat_peak_bytes": peak,
        "minimum_ram_bytes": result.minimum_ram_bytes,
        "fixed_bytes": graph.fixed_bytes,
        "recomputes": report.recomputes if report else None,
        "page_ins": report.page_ins if report else None,
        "page_outs": report.page_outs if report else None,
        "solve_s": result.solve_s,
        "total_s": total_s,
        "gap": result.gap,
        "solver": schedule.solve.solver if schedule else args.solver,
        "formulation": schedule.solve.formulation if schedule else None,
        "nodes": graph.size,
        "edges": len(graph.edges),
        "message": result.message,
        "schedule_file": args.out if schedule is not None and args.out else None,
        "plots": [str(p) for p in plot_paths],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        _print_plan(summary, result)
    exit_codes = {"optimal": EXIT_OK, "feasible": EXIT_OK, "infeasible": EXIT_INFEASIBLE, "error": EXIT_INTERNAL}
    return exit_codes.get(result.status, EXIT_TIMEOUT)


def _print_plan(summary: dict, result) -> None:
    status = summary["status"]
    gap = summary["gap"]
    status_text = {
        "optimal": f"optimal (gap {100 * (gap or 0):.3f}%)",
        "feasible": f"feasible: the time limit stopped the solver, gap {100 * gap:.2f}%" if gap is not None
        else "feasible: the time limit stopped the solver",
        "infeasible": "infeasible",
        "timeout": "timeout: no schedule found within the time limit",
    }.get(status, status)
    print(f"status    {status_text}, solved in {summary['solve_s']:.2f} s")
    if result.message:
        print(f"          {result.message}")
    if result.report is None:
        return
    print(f"energy    {summary['objective_j']:.6g} J per step  (compute {summary['compute_j']:.6g} J, "
          f"paging {summary['paging_j']:.6g} J; {summary['energy_source']})")
    print(f"runtime   {summary['runtime_s']:.6g} s of {summary['runtime_budget_s']:.6g} s allowed")
    print(f"RAM       peak {_format_bytes(summary['peak_ram_bytes'])} of {_format_bytes(summary['ram_budget_bytes'])}"
          f"; fixed (weights, grads, optimizer) {_format_bytes(summary['fixed_bytes'])}")
    print(f"plan      {summary['recomputes']} recomputes, {summary['page_outs']} page-outs, "
          f"{summary['page_ins']} page-ins, {len(result.schedule.instructions)} instructions (validated)")
    if summary["schedule_file"]:
        print(f"wrote     {summary['schedule_file']}")
    for path in summary["plots"]:
        print(f"plot      {path}")


def cmd_pareto(args) -> int:
    from host.solver.pareto import pareto_sweep

    resolved, profile, priced = _load_priced(args)
    rows = pareto_sweep(
        priced,
        points=args.points,
        runtime_factor=args.runtime_budget,
        solver=args.solver,
        time_limit_s=args.time_limit,
        progress=(lambda message: print(f"  {message}", file=sys.stderr)) if not args.json else None,
    )
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{'RAM budget':>14}  {'method':<24} {'status':<11} {'energy J':>12} {'peak bytes':>12} "
              f"{'recomp':>6} {'pg-in':>5} {'pg-out':>6}")
        for row in rows:
            energy = f"{row['energy_j']:.6g}" if row["energy_j"] is not None else "-"
            peak = f"{row['peak_ram_bytes']:,}" if row["peak_ram_bytes"] is not None else "-"
            print(f"{row['ram_budget_bytes']:>14,.0f}  {row['method']:<24} {row['status']:<11} {energy:>12} {peak:>12} "
                  f"{row.get('recomputes') or 0:>6} {row.get('page_ins') or 0:>5} {row.get('page_outs') or 0:>6}")
    if args.plot:
        from host.plots import plot_pareto

        plot_dir = Path(args.plot)
        plot_dir.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{args.model}_{profile.name}")
        path = plot_pareto(rows, plot_dir / f"{stem}_pareto.png", f"{args.model} on {profile.name}")
        if not args.json:
            print(f"plot      {path}")
    return EXIT_OK


# ---------------------------------------------------------------------------------------- parser
def _add_model_args(parser: argparse.ArgumentParser, platform_required: bool = True) -> None:
    parser.add_argument("--model", required=True, help="zoo name, poet2022:<name>, or module:callable")
    parser.add_argument("--platform", required=platform_required, help="shipped platform name or a profile .json")
    parser.add_argument("--input-shape", help="for a module:callable returning a bare nn.Module: batch first, e.g. 32,64")
    parser.add_argument("--batch-size", type=int, help="batch size for zoo and poet2022 models (default: the model's)")
    parser.add_argument("--granularity", default="layer", choices=["layer", "block", "op"],
                        help="how traced ops are grouped into schedulable nodes (default: layer)")


def _add_solver_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-budget", type=float, default=1.2,
                        help="factor of the plain forward+backward runtime (>= 1.0; default 1.2)")
    parser.add_argument("--solver", default="highs", choices=["highs", "cbc", "gurobi"])
    parser.add_argument("--time-limit", type=float, default=None, help="solver time limit in seconds")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="poet", description="poet-edge: energy-optimal on-device training schedules")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("models", help="list the model zoo and the poet2022 reference graphs").set_defaults(func=cmd_models)
    sub.add_parser("platforms", help="list the shipped platform profiles").set_defaults(func=cmd_platforms)

    profile = sub.add_parser("profile", help="measure this machine and write a platform profile")
    profile.add_argument("--local", action="store_true", required=True)
    profile.add_argument("--flash-dir", help="directory on the storage to page to (default: current directory)")
    profile.add_argument("--name", default="local")
    profile.add_argument("--out", help="profile file to write (default: <name>.profile.json)")
    profile.add_argument("--quick", action="store_true", help="a short run (a few seconds)")
    profile.set_defaults(func=cmd_profile)

    solve = sub.add_parser("solve", help="solve the energy-optimal schedule for a model on a platform")
    _add_model_args(solve)
    solve.add_argument("--ram-budget", required=True, help="bytes (3000000), with a unit (3MB), or a share (50%%)")
    _add_solver_args(solve)
    solve.add_argument("--no-paging", action="store_true", help="ablation: recomputation only")
    solve.add_argument("--no-remat", action="store_true", help="ablation: paging only")
    solve.add_argument("--paging-in-runtime", action="store_true",
                       help="count paging time in the runtime budget (the paper leaves it out)")
    solve.add_argument("--mip-gap", type=float, default=1e-3, help="relative gap that counts as optimal (default 0.1%%)")
    solve.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    solve.add_argument("--plot", metavar="DIR", help="write PNGs of the schedule matrices and RAM over time")
    solve.add_argument("--out", metavar="SCHEDULE_FILE", help="write the validated schedule (poet.v1.Schedule JSON)")
    solve.set_defaults(func=cmd_solve)

    pareto = sub.add_parser("pareto", help="energy against RAM budget for POET and the baselines")
    _add_model_args(pareto)
    _add_solver_args(pareto)
    pareto.add_argument("--points", type=int, default=6, help="number of RAM budgets (default 6)")
    pareto.add_argument("--json", action="store_true")
    pareto.add_argument("--plot", metavar="DIR")
    pareto.set_defaults(func=cmd_pareto)

    from host.train_cli import add_train_commands  # imported here: train_cli imports this module

    add_train_commands(sub)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types whose message is already a complete, user-facing explanation."""
    from device_agent.serde import ScheduleFormatError
    from host.costs.profile import ProfileError
    from host.graph.model_source import ModelSourceError
    from host.graph.poet2022 import UnknownPoet2022ModelError
    from host.graph.resolve import UnknownModelNameError
    from host.graph.training_graph import GraphError
    from host.graph.zoo import UnknownModelError
    from host.solver.backends import UnknownSolverError
    from host.solver.solve import BudgetError

    errors: list[type[BaseException]] = [
        CliError, ProfileError, ModelSourceError, UnknownPoet2022ModelError, UnknownModelNameError, GraphError,
        UnknownModelError, UnknownSolverError, BudgetError, ScheduleFormatError,
    ]
    try:
        from host.graph.trace import TraceError

        errors.append(TraceError)
    except ImportError:
        pass
    try:
        from host.costs.local_bench import LocalBenchError

        errors.append(LocalBenchError)
    except ImportError:
        pass
    try:
        from host.solver.backends.pulp_backend import SolverUnavailableError

        errors.append(SolverUnavailableError)
    except ImportError:
        pass
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except _user_errors() as error:
        message = str(error).strip("'\"") if isinstance(error, KeyError) else str(error)
        print(f"poet {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"poet {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `poet models | head`
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
