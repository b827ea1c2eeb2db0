"""`poet run`: submit a run to boards of the fleet (a module:callable model is traced here and uploaded), and follow it
with --wait.
"""

from __future__ import annotations

import argparse
import time

from device_agent.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS
from host.cli.common import (
    EXIT_OK,
    CliError,
    Console,
    add_ablation_args,
    add_json_arg,
    granularity,
    learning_rate,
    positive_int,
    runtime_factor,
    seed_int,
)
from host.cli.operator import (
    EXIT_RUN_FAILED,
    POLL_INTERVAL_S,
    num,
    operator_args,
    short_bytes,
    with_operator,
)
from host.fleet.client import CERTS_ENV, COORDINATOR_ENV, OperatorClient
from host.fleet.status import RunStatus
from host.graph.granularity import GRANULARITY_HELP


# ------------------------------------------------------------------------------------------ run
def parse_ram_budget(text: str):
    """--ram-budget: the word auto, or what host.run.values.RamBudget takes (bytes, a unit, a percentage)."""
    from host.fleet.serde import fleet_pb2
    from host.run.values import RamBudget

    if text.strip().lower() == "auto":
        return fleet_pb2.RamBudget(auto=True)
    try:
        budget = RamBudget.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error}, or auto") from None
    if budget.share is not None:
        if budget.share > 1:
            raise argparse.ArgumentTypeError(f"{text!r}: a share of the no-remat peak is at most 100%")
        return fleet_pb2.RamBudget(fraction_of_peak=budget.share)
    return fleet_pb2.RamBudget(budget_bytes=budget.budget_bytes)


parse_ram_budget.__name__ = "RAM budget"


@with_operator
def cmd_run(args, console: Console, op: OperatorClient) -> int:
    from host.fleet import serde

    if args.kind != "profile":
        missing = [flag for flag, value in (("--model", args.model), ("--dataset", args.dataset),
                                            ("--steps", args.steps), ("--ram-budget", args.ram_budget))
                   if value is None]
        if missing:
            raise CliError(f"a {args.kind} run needs {', '.join(missing)}")
    agents = [a.strip() for a in (args.agents or "").split(",") if a.strip()]
    if not agents and not args.all:
        raise CliError("name the boards with --agents A,B or pass --all (see `poet fleet list`)")
    request = op.pb.SubmitRunRequest(
        model=args.model or "", dataset=args.dataset or "", steps=args.steps or 0,
        runtime_budget=args.runtime_budget or 0.0, agents=agents, all_agents=args.all,
        kind=serde.JOB_KIND_TO_PB[args.kind], optimizer=serde.OPTIMIZER_TO_PB[args.optimizer], lr=args.lr or 0.0,
        collect=serde.COLLECT_TO_PB[args.collect], seed=args.seed, batch_size=args.batch_size or 0,
        profile_version=args.profile_version or 0, no_paging=args.no_paging, no_remat=args.no_remat,
        granularity=args.granularity, compile=args.compile,
    )
    if args.ram_budget is not None:
        request.ram_budget.CopyFrom(args.ram_budget)
    console.log(f"submitting {args.kind} of {args.model or 'a profile'} to "
                f"{'every online board' if args.all else ', '.join(agents)} (the coordinator solves per board)")
    runs = op.submit(request, log=console.log)
    if not args.detach:
        runs = _wait_solved(op, runs, console)
    if args.wait:
        runs = _wait(op, runs, console)
    entries = [serde.run_info_to_json(r) for r in runs]
    if args.json:
        console.print_json({"runs": entries})
    else:
        _runs_table(console, entries)
    return EXIT_RUN_FAILED if any(e["status"] in (RunStatus.FAILED, RunStatus.DOES_NOT_FIT) for e in entries) else EXIT_OK


SOLVER_HINT_AFTER_S = 180.0  # a submission none of whose schedules is solved by then may have no worker


def _wait_solved(op: OperatorClient, runs: list, console: Console) -> list:
    """Poll the runs whose schedules are being solved until each has its schedule (or does not fit); progress on
    stderr."""
    from host.fleet.serde import RUN_STATUS_FROM_PB

    latest = {r.run_id: r for r in runs}
    started = time.monotonic()
    while True:
        solving = [r.run_id for r in latest.values() if RUN_STATUS_FROM_PB[r.status] == RunStatus.SOLVING]
        if not solving:
            if time.monotonic() - started > POLL_INTERVAL_S:
                console.log(f"schedules solved in {time.monotonic() - started:.0f} s")
            return [latest[r.run_id] for r in runs]
        waited_s = time.monotonic() - started
        hint = ("; none solved yet: is a solver worker running (`poet serve --solver-workers`, `poet solver-worker`)?"
                if waited_s > SOLVER_HINT_AFTER_S and len(solving) == len(latest) else "")
        console.status.line(f"  solving schedules: {len(solving)} of {len(latest)} run(s) waiting, {waited_s:.0f} s "
                            f"(Ctrl-C or --detach: the runs go on){hint}")
        time.sleep(POLL_INTERVAL_S)
        for run_id in solving:
            latest[run_id] = op.call("GetRun", op.pb.GetRunRequest(run_id=run_id))


def _wait(op: OperatorClient, runs: list, console: Console) -> list:
    """Poll the runs until each is done, failed or does_not_fit; progress per board on stderr."""
    from host.fleet.serde import RUN_STATUS_FROM_PB

    latest = {r.run_id: r for r in runs}
    reported: set[str] = set()
    while True:
        for run_id, run in latest.items():
            if not RUN_STATUS_FROM_PB[run.status].finished:
                latest[run_id] = op.call("GetRun", op.pb.GetRunRequest(run_id=run_id))
        parts = []
        for run in latest.values():
            status = RUN_STATUS_FROM_PB[run.status]
            if status.finished and run.run_id not in reported:
                reported.add(run.run_id)
                loss = f", final loss {run.final_loss:.4f}" if run.HasField("final_loss") else ""
                why = f": {run.error}" if run.error else ""
                console.log(f"  {run.agent}: {status}{loss}, {run.events_stored} events received{why}")
            if status == RunStatus.SOLVING:
                parts.append(f"{run.agent} solving its schedule")
            elif not status.finished:
                loss = f" loss {run.last_loss:.4f}" if run.HasField("last_loss") else ""
                parts.append(f"{run.agent} {status} step {run.steps_done}/{run.steps}{loss} events {run.events_stored}")
        if not parts:
            return [latest[r.run_id] for r in runs]
        console.status.line("  " + "  |  ".join(parts))
        time.sleep(POLL_INTERVAL_S)


def _runs_table(console: Console, entries: list[dict]) -> None:
    console.print(f"{'board':<14} {'status':<12} {'budget':>10} {'recomp':>6} {'p-in':>5} {'p-out':>5} "
                  f"{'step s pred/meas':>19} {'peak RAM pred/meas':>21} {'final loss':>10} {'acc before->after':>17}")
    for e in entries:
        pred, meas = e["predicted"], e["measured"]
        budget = short_bytes(e["ram_budget_bytes"]) if e["ram_budget_bytes"] else "-"
        step = f"{num(pred['step_s'], '.4f')}/{num(meas['step_s'], '.4f')}"
        peak = f"{short_bytes(pred['peak_ram_bytes'])}/{short_bytes(meas['peak_ram_bytes'])}"
        acc = f"{num(e['accuracy_before'], '.3f')}->{num(e['accuracy_after'], '.3f')}"
        console.print(f"{e['agent']:<14} {e['status']:<12} {budget:>10} {e['recomputes']:>6} {e['page_ins']:>5} "
                      f"{e['page_outs']:>5} {step:>19} {peak:>21} {num(e['final_loss'], '.4f'):>10} {acc:>17}")
        if e["status"] == RunStatus.DOES_NOT_FIT:
            console.print(f"  {e['agent']}: does not fit; needs at least {short_bytes(e['min_ram_budget_bytes'])}: "
                          f"{e['error']}")
        elif e["error"]:
            console.print(f"  {e['agent']}: {e['error']}")
    console.log("budget: the RAM the schedule controls per board; peak RAM: predicted by the solver / measured "
                "on the board; run ids: `poet runs list`")


def register(sub: argparse._SubParsersAction) -> None:
    from host.fleet.limits import (
        AUTO_MARGIN_BYTES,
        SOLVE_TIME_LIMIT_S,
    )

    run = sub.add_parser(
        "run", help="train, verify or profile on boards of the fleet",
        description="Submit a run to boards: a module:callable model is traced here and its archive uploaded (the "
                    "coordinator never runs your code; a zoo model it traces itself); the coordinator gives each "
                    "board its RAM budget, records one run per board and answers at once; its solver workers then solve a "
                    "schedule per board on that board's profile (its measured one, else its platform's, else this "
                    f"machine's; {SOLVE_TIME_LIMIT_S:g} s limit per distinct schedule; identical boards share one "
                    "solve, and a case solved before is not solved again), and each run goes from solving to queued. "
                    "This command waits for the schedules (not with --detach). The data stays on the boards.",
        epilog=f"Exit codes: 0 every run queued (with --detach: recorded; with --wait: done); {EXIT_RUN_FAILED} a run failed or does not "
               f"fit its board (does_not_fit, with the minimum budget); 2 bad input, or the coordinator refused or "
               f"is unreachable; 130/143 interrupted (the runs go on). The coordinator and bundle come from "
               f"--coordinator/--certs or ${COORDINATOR_ENV}/${CERTS_ENV}.")
    run.add_argument("--model", help="zoo name (see `poet models`), resolved on the coordinator, or "
                          "package.module:factory, traced here and uploaded (the coordinator never runs your code) "
                          "(no default: required for train and verify)")
    run.add_argument("--dataset", metavar="NAME", help="dataset directory name under each agent's --data-dir (no default: required for train and verify)")
    run.add_argument("--steps", type=positive_int, metavar="N", help="training steps, >= 1 (no default: required for train and verify)")
    run.add_argument("--ram-budget", type=parse_ram_budget, metavar="BYTES|PCT|auto",
                     help="bytes (3000000, 3MB, 2.5MiB), a percentage of the no-remat peak (50%%), or auto: per "
                          "board, its memory limit (or available RAM without one) minus the fixed bytes (weights, "
                          "their gradients, optimizer state, the batch) minus the torch runtime's resident memory it "
                          f"measured minus a margin of {AUTO_MARGIN_BYTES // 2**20} MiB (no default: required for train and verify)")
    run.add_argument("--runtime-budget", type=runtime_factor, metavar="FACTOR",
                     help="allowed runtime as a factor of the plain forward+backward runtime, >= 1.0 (default 1.2)")
    who = run.add_mutually_exclusive_group()
    who.add_argument("--agents", metavar="A,B", help="comma-separated board names (no default: give --agents or --all)")
    who.add_argument("--all", action="store_true", help="every online board")
    run.add_argument("--kind", default="train", choices=["train", "verify", "profile"],
                     help="train; verify (train plus a plain run, comparing parameters); profile (measure the board, "
                          "stored as its profile) (default: train)")
    run.add_argument("--optimizer", default=DEFAULT_OPTIMIZER, choices=list(OPTIMIZERS), help=f"(default: {DEFAULT_OPTIMIZER})")
    run.add_argument("--lr", type=learning_rate, metavar="X", help="learning rate (default 0.01)")
    run.add_argument("--collect", default="none", choices=["none", "weights", "delta"],
                     help="bring back the trained weights or their difference from the initial ones (default: none: "
                          "they stay on the board)")
    run.add_argument("--batch-size", type=positive_int, metavar="B", help="batch size (default: the model's)")
    run.add_argument("--seed", type=seed_int, default=0, metavar="S", help="seed of weights and data order (default 0)")
    run.add_argument("--profile-version", type=positive_int, metavar="N",
                     help="solve on stored profile version N of each board (see `poet profiles list`); refused when a "
                          "board has no such version (default: each board's latest version, else its shipped "
                          "platform, else this machine's)")
    add_ablation_args(run)
    run.add_argument("--granularity", default="layer", type=granularity, metavar="{layer,block,block:N,op}",
                     help=GRANULARITY_HELP)
    run.add_argument("--compile", action="store_true",
                     help="boards run the node functions through inductor (fused kernels; TRAIN only, not bitwise "
                          "eager; pays on coarse nodes: use with --granularity block; the first step compiles)")
    run.add_argument("--wait", action="store_true",
                     help="show progress per board on stderr until every run is done, failed or does_not_fit, then "
                          "a table (budget, recomputes, page-ins/outs, predicted vs measured step time and peak RAM, "
                          "final loss, accuracy before and after)")
    run.add_argument("--detach", action="store_true",
                     help="return as soon as the coordinator has recorded the runs, while their schedules are still "
                          "being solved (status solving; follow them with `poet runs list`)")
    operator_args(run)
    add_json_arg(run)
    run.set_defaults(func=cmd_run)
