"""`poet train`, `poet verify` and `poet demo`: real training steps under a POET schedule on this machine."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from device_agent.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS
from host.cli.common import (
    EXIT_INFEASIBLE,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_VERIFY_FAILED,
    RAM_BUDGET_HELP,
    Console,
    add_ablation_args,
    add_json_arg,
    add_model_args,
    add_solver_args,
    directory_path,
    file_path,
    learning_rate,
    model_keywords,
    positive_int,
    ram_budget,
    runtime_factor,
    seconds,
    seed_int,
    solve_keywords,
)
from host.cli.display import format_bytes
from host.cli.solve import status_text
from host.run.errors import SolveFailedError
from host.solver.deadline import DEMO_TIME_LIMIT_S

if TYPE_CHECKING:  # host.run.train loads torch: a command imports it when it runs, not to parse its flags
    from host.run.train import TrainReport


def _run(args, console: Console, body) -> int:
    """A failed solve prints its reason and exits 3 (infeasible) or 4 (time limit, no schedule)."""
    try:
        return body(args, console)
    except SolveFailedError as error:
        console.status.close()
        print(f"poet {args.command}: {error}", file=sys.stderr)
        return EXIT_INFEASIBLE if error.status == "infeasible" else EXIT_TIMEOUT


def _run_keywords(args) -> dict[str, Any]:
    return dict(optimizer=args.optimizer, accumulate_steps=args.accumulate, lr=args.lr, flash_dir=args.flash_dir, schedule=args.schedule,
                threads=args.threads, allocator=args.allocator, **solve_keywords(args), **model_keywords(args))


def _micro(report) -> str:
    """`` x N micro-batches`` when a step accumulates gradients."""
    return f" x {report.accumulate_steps} micro-batches" if report.accumulate_steps > 1 else ""


def _budget_check(parser: argparse.ArgumentParser):
    def check(args) -> None:
        if args.ram_budget is None and not args.schedule and not getattr(args, "plain", False):
            parser.error("--ram-budget is required unless --schedule gives a schedule (which carries its budget)")

    return check


def cmd_train(args, console: Console) -> int:
    return _run(args, console, _train)


def _train(args, console: Console) -> int:
    from host.run.train import train

    report = train(args.model, args.platform, args.ram_budget, steps=args.steps, plain=args.plain,
                   events=args.events, cgroup=args.cgroup, inductor=args.inductor, log=console.log,
                   progress=console.status,
                   **_run_keywords(args))
    console.status.close()
    if args.json:
        console.print_json(report.to_dict())
    else:
        print_train(console, report)
    return EXIT_OK


def print_train(console: Console, report: TrainReport) -> None:
    measured = report.measured
    compiled = ", inductor kernels: not bitwise eager" if report.inductor else ""
    console.print(f"model     {report.model}  ({report.mode}, {report.steps} steps{_micro(report)}, {report.optimizer}"
                  f"{compiled})")
    if report.solve_status:
        console.print(f"solve     {status_text(report.solve_status, report.solve_gap)}")
    console.print(f"loss      {report.losses[0]:.6g} -> {report.losses[-1]:.6g}")
    if report.mode == "plain":
        console.print(f"time      {measured.step_s:.4f} s/step (median)")
        console.print(f"energy    {measured.energy_j:.4g} J/step ({report.measured_energy_source} on this machine)")
        console.print(f"RSS       peak {format_bytes(measured.rss_peak_bytes, exact=False)}; no-remat peak of "
                      f"controlled tensors {format_bytes(report.no_remat_peak_bytes, exact=False)}")
        return
    predicted = report.predicted
    where = ("this machine" if report.predicted_platform == "local"
             else f"platform {report.predicted_platform} (the measurement is on this machine)")
    console.print(f"predicted for {where}; measured here, medians over steps")
    console.print(f"{'':<16}{'predicted':>16}{'measured':>16}")
    console.print(f"{'peak RAM':<16}{format_bytes(predicted.peak_ram_bytes, exact=False):>16}"
                  f"{format_bytes(measured.peak_tracked_bytes, exact=False):>16}"
                  f"   budget {format_bytes(report.ram_budget_bytes, exact=False)}, "
                  f"fixed {format_bytes(report.fixed_bytes, exact=False)}")
    console.print(f"{'step time':<16}{predicted.step_s:>14.4g} s{measured.step_s:>14.4g} s")
    console.print(f"{'energy':<16}{predicted.energy_j:>14.4g} J{measured.energy_j:>14.4g} J"
                  f"   predicted: {report.predicted_energy_source}; measured: {report.measured_energy_source}")
    console.print(f"{'instructions':<16}{'planned':>16}{'executed':>16}")
    for key in ("computes", "recomputes", "page_outs", "page_ins"):
        console.print(f"  {key:<14}{report.planned[key]:>16}{report.executed[key]:>16}")
    console.print(f"RSS       peak {format_bytes(measured.rss_peak_bytes, exact=False)}")
    if report.events_file:
        console.print(f"events    {report.events_file}")


def cmd_verify(args, console: Console) -> int:
    return _run(args, console, _verify)


def _verify(args, console: Console) -> int:
    from host.run.train import verify

    report = verify(args.model, args.platform, args.ram_budget, steps=args.steps, log=console.log,
                    progress=console.status, **_run_keywords(args))
    console.status.close()
    if args.json:
        console.print_json(report.to_dict())
    else:
        verdict = "OK" if report.ok else "FAILED"
        console.print(f"verify    {verdict}: {report.model}, {report.steps} steps{_micro(report)} of {report.optimizer}")
        exact = " (bitwise equal)" if report.bitwise_equal else ""
        console.print(f"params    max abs diff {report.max_abs_param_diff:.3g}, max rel diff "
                      f"{report.max_rel_param_diff:.3g} (tolerance {report.tolerance_rel:g}){exact}")
        console.print(f"RAM       tracked peak {report.peak_tracked_bytes:,} of {report.ram_budget_bytes:,.0f} bytes "
                      f"(predicted {report.predicted_peak_bytes:,.0f})")
        console.print(f"counters  planned {report.planned}\n          executed {report.executed}")
        if report.step_time_ratio is not None:
            console.print(f"time      {report.step_time_ratio:.3f}x plain PyTorch per step")
    return EXIT_OK if report.ok else EXIT_VERIFY_FAILED


def cmd_demo(args, console: Console) -> int:
    return _run(args, console, _demo)


def _demo(args, console: Console) -> int:
    from host.run.train import demo

    report = demo(args.model, flash_dir=args.flash_dir, steps=args.steps, batch_size=args.batch_size,
                  ram_budget=args.ram_budget, runtime_budget=args.runtime_budget, time_limit_s=args.time_limit,
                  threads=args.threads, log=console.log, progress=console.status)
    console.status.close()
    if args.json:
        console.print_json(report.to_dict())
    else:
        print_train(console, report)
    return EXIT_OK


# ---------------------------------------------------------------------------------------- parser
FLASH_DIR_HELP = "directory on the storage to page to; created if missing (default: current directory)"
THREADS_HELP = "torch CPU threads, >= 1 (default: torch's choice)"


def _add_run_args(parser: argparse.ArgumentParser) -> None:
    """The flags train and verify share."""
    add_model_args(parser, model_help="zoo name (see `poet models`) or package.module:factory (importable from the "
                                      "current directory)",
                   platform_help="the platform to solve and price for: a shipped name, a profile .json, or "
                                         "local (default: local, i.e. measure this machine quickly; with "
                                         "--schedule, the platform it was solved for)")
    parser.add_argument("--ram-budget", type=ram_budget, metavar="BUDGET",
                        help="RAM for the controlled tensors: " + RAM_BUDGET_HELP
                             + "; required unless --schedule (default: the schedule's budget)")
    add_solver_args(parser)
    add_ablation_args(parser)
    parser.add_argument("--schedule", metavar="FILE", type=file_path,
                        help="run this schedule (from `poet solve --out`) instead of solving (default: solve here)")
    parser.add_argument("--flash-dir", type=directory_path, default=".", metavar="DIR", help=FLASH_DIR_HELP)
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default=DEFAULT_OPTIMIZER,
                        help=f"sgd (momentum 0.9) or adamw (default: {DEFAULT_OPTIMIZER})")
    parser.add_argument("--accumulate", type=positive_int, default=1, metavar="N",
                        help="micro-batches per optimizer step (gradient accumulation), >= 1; the schedule is solved "
                             "for one micro-batch, so an N times larger batch fits the same RAM; here each micro-batch "
                             "is the model's example batch (default 1)")
    parser.add_argument("--lr", type=learning_rate, default=None, metavar="LR",
                        help="learning rate, > 0 (default: 0.01 for sgd, 0.001 for adamw)")
    parser.add_argument("--seed", type=seed_int, default=0, metavar="N",
                        help="seed of the weights, the batch and the training RNG, >= 0 (default 0)")
    parser.add_argument("--threads", type=positive_int, metavar="N", help=THREADS_HELP)
    parser.add_argument("--allocator", choices=["keep", "default", "return"], default=None,
                        help="freed memory: keep it for reuse (fastest; RSS stays at its high-water mark), leave it "
                             "to glibc's default heuristics, or return it to the OS after every free so RSS follows "
                             "the schedule (default: keep; return with --cgroup)")
    add_json_arg(parser)


def register(sub: argparse._SubParsersAction) -> None:
    train_parser = sub.add_parser("train", help="train a model here under its POET schedule, with real paging",
                                  description="Train a model's real steps on this machine under its POET schedule, "
                                              "paging to --flash-dir; report predicted against measured.")
    _add_run_args(train_parser)
    train_parser.add_argument("--steps", type=positive_int, default=5, metavar="N", help="training steps, >= 1 (default 5)")
    train_parser.add_argument("--plain", action="store_true",
                              help="ordinary PyTorch training of the same model instead, for comparison")
    train_parser.add_argument("--events", metavar="FILE", type=file_path,
                              help="write per-instruction telemetry as JSON lines (default: none)")
    train_parser.add_argument("--cgroup", metavar="DIR",
                              help="join this cgroup after tracing and solving, so its memory limit applies to "
                                   "training only (default: none)")
    train_parser.add_argument("--compile", dest="inductor", action="store_true",
                              help="run the node functions through inductor (torch.compile's compiler): fused "
                                   "kernels, faster on coarse nodes (--granularity block), not bitwise equal to "
                                   "eager; the first step compiles for seconds per distinct node (default: off)")
    train_parser.set_defaults(func=cmd_train, check=_budget_check(train_parser))

    verify_parser = sub.add_parser("verify", help="check scheduled training against plain PyTorch",
                                   description="Train under the schedule and plainly from the same weights and data; "
                                               "check parameters, executed counters and the RAM budget (exit 5 if "
                                               "not).")
    _add_run_args(verify_parser)
    verify_parser.add_argument("--steps", type=positive_int, default=3, metavar="N", help="training steps, >= 1 (default 3)")
    verify_parser.set_defaults(func=cmd_verify, check=_budget_check(verify_parser))

    demo_parser = sub.add_parser("demo", help="profile this machine, solve at 50%% of the no-remat peak, train",
                                 description="Profile this machine, solve a model's schedule for it, and train a few "
                                             "steps with real paging: predicted against measured.")
    demo_parser.add_argument("--model", default="resnet18_cifar",
                             help="zoo name or package.module:factory (default: resnet18_cifar)")
    demo_parser.add_argument("--batch-size", type=positive_int, metavar="N", help="batch size, >= 1 (default: the model's)")
    demo_parser.add_argument("--ram-budget", type=ram_budget, default="50%", metavar="BUDGET",
                             help=RAM_BUDGET_HELP + " (default: 50%%)")
    demo_parser.add_argument("--runtime-budget", type=runtime_factor, default=2.0, metavar="FACTOR",
                             help="allowed runtime as a factor of the plain forward+backward runtime, >= 1.0 "
                                  "(default 2.0)")
    demo_parser.add_argument("--time-limit", type=seconds, default=DEMO_TIME_LIMIT_S, metavar="SECONDS",
                             help=f"solver time limit in seconds (default {DEMO_TIME_LIMIT_S:g} s)")
    demo_parser.add_argument("--flash-dir", type=directory_path, default=".", metavar="DIR", help=FLASH_DIR_HELP)
    demo_parser.add_argument("--steps", type=positive_int, default=3, metavar="N", help="training steps, >= 1 (default 3)")
    demo_parser.add_argument("--threads", type=positive_int, metavar="N", help=THREADS_HELP)
    add_json_arg(demo_parser)
    demo_parser.set_defaults(func=cmd_demo)
