"""`poet runs list|show`: the fleet's runs."""

from __future__ import annotations

import argparse

from host.cli.common import (
    EXIT_OK,
    Console,
    add_json_arg,
)
from host.cli.operator import (
    OPERATOR_EPILOG,
    num,
    operator_args,
    short_bytes,
    with_operator,
)
from host.fleet.client import OperatorClient


# ------------------------------------------------------------------------------------------ runs
@with_operator
def cmd_runs_list(args, console: Console, op: OperatorClient) -> int:
    from host.fleet.serde import run_info_to_json

    entries = [run_info_to_json(r) for r in op.call_pages("ListRuns", op.pb.ListRunsRequest(), "runs")]
    if args.json:
        console.print_json({"runs": entries})
        return EXIT_OK
    if not entries:
        console.print("no runs (submit one with `poet run`)")
        return EXIT_OK
    console.print(f"{'run_id':<18} {'board':<14} {'kind':<7} {'status':<12} {'steps':>9} {'budget':>10} {'final loss':>10}")
    for e in entries:
        budget = short_bytes(e["ram_budget_bytes"]) if e["ram_budget_bytes"] else "-"
        console.print(f"{e['run_id']:<18} {e['agent']:<14} {e['kind']:<7} {e['status']:<12} "
                      f"{e['steps_done']:>4}/{e['steps']:<4} {budget:>10} {num(e['final_loss'], '.4f'):>10}")
    return EXIT_OK


@with_operator
def cmd_runs_show(args, console: Console, op: OperatorClient) -> int:
    from host.fleet.serde import run_info_to_json

    entry = run_info_to_json(op.call("GetRun", op.pb.GetRunRequest(run_id=args.run_id)))
    if args.json:
        console.print_json(entry)
        return EXIT_OK
    for key, value in entry.items():
        if isinstance(value, dict):
            value = "  ".join(f"{k}={'-' if v is None else v}" for k, v in value.items())
        elif isinstance(value, list):  # telemetry_steps_missing: step ranges
            value = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in value) or "none"
        console.print(f"{key:<22} {'-' if value is None or value == '' else value}")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:

    runs = sub.add_parser("runs", help="list and show runs", description="Runs on the fleet's boards.",
                          epilog=OPERATOR_EPILOG)
    runs_sub = runs.add_subparsers(dest="runs_command", required=True, metavar="SUBCOMMAND")
    runs_list = runs_sub.add_parser("list", help="every run, oldest first", epilog=OPERATOR_EPILOG)
    operator_args(runs_list)
    add_json_arg(runs_list)
    runs_list.set_defaults(func=cmd_runs_list)
    show = runs_sub.add_parser("show", help="one run", epilog=OPERATOR_EPILOG)
    show.add_argument("run_id", metavar="RUN_ID")
    operator_args(show)
    add_json_arg(show)
    show.set_defaults(func=cmd_runs_show)
