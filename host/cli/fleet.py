"""The fleet's commands. This module is `poet fleet list|remove`; its :func:`register` also registers the other fleet
command groups, each in its own module: `poet serve` (serve.py), `poet run` (run.py), `poet runs` (runs.py), `poet
profiles` (profiles.py) and `poet calibrate` (calibrate.py). Operator commands reach the coordinator through
host/fleet/client.py (host/cli/operator.py builds it from --coordinator/--certs); a refusal or an unreachable
coordinator is one line naming the problem and the fix (exit 2).
"""

from __future__ import annotations

import argparse

from host.cli.common import (
    EXIT_OK,
    CliError,
    Console,
    add_json_arg,
)
from host.cli.operator import (
    OPERATOR_EPILOG,
    operator_args,
    short_bytes,
    with_operator,
)
from host.cli.run import parse_ram_budget  # noqa: F401  (host/flower imports it from here)
from host.fleet.client import OperatorClient


# ------------------------------------------------------------------------------------------ fleet
@with_operator
def cmd_fleet_list(args, console: Console, op: OperatorClient) -> int:
    from host.fleet.serde import agent_info_to_json

    agents = [agent_info_to_json(a) for a in op.call_pages("ListAgents", op.pb.ListAgentsRequest(), "agents")]
    if args.json:
        console.print_json({"agents": agents})
        return EXIT_OK
    if not agents:
        console.print("no agents (start `poet-agent run --coordinator ... --certs NODE_BUNDLE` on a board)")
        return EXIT_OK
    console.print(f"{'name':<16} {'platform':<12} {'online':<6} {'RAM total':>12} {'mem limit':>12} "
                  f"{'flash free':>12} {'cpus':>4}  meters")
    for a in agents:
        limit = short_bytes(a["memory_limit_bytes"]) if a["memory_limit_bytes"] else "none"
        console.print(f"{a['name']:<16} {a['platform']:<12} {'yes' if a['online'] else 'no':<6} "
                      f"{short_bytes(a['ram_total_bytes']):>12} {limit:>12} {short_bytes(a['flash_free_bytes']):>12} "
                      f"{a['cpu_count']:>4}  {','.join(a['meters'])}")
    return EXIT_OK


@with_operator
def cmd_fleet_remove(args, console: Console, op: OperatorClient) -> int:
    reply = op.call("RemoveAgent", op.pb.RemoveAgentRequest(name=args.name))
    if not reply.removed:
        raise CliError(f"no agent named {args.name!r} (see `poet fleet list`)")
    console.print(f"removed {args.name}: its certificate is refused from now on; its solving, queued and running runs failed")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    """Every fleet command group, in the order `poet --help` lists them."""
    from host.cli import calibrate, profiles, run, runs, serve, solver_worker

    serve.register(sub)
    solver_worker.register(sub)
    _register_fleet(sub)
    for group in (run, runs, profiles, calibrate):
        group.register(sub)


def _register_fleet(sub: argparse._SubParsersAction) -> None:
    from host.fleet.limits import (
        HEARTBEAT_TIMEOUT_S,
    )

    fleet = sub.add_parser("fleet", help="list and remove the boards of the fleet",
                           description="The boards registered with the coordinator.", epilog=OPERATOR_EPILOG)
    fleet_sub = fleet.add_subparsers(dest="fleet_command", required=True, metavar="SUBCOMMAND")
    listing = fleet_sub.add_parser("list", help="the registered boards and what they reported",
                                   description=f"Registered boards; online = seen within {HEARTBEAT_TIMEOUT_S:g} s.",
                                   epilog=OPERATOR_EPILOG)
    operator_args(listing)
    add_json_arg(listing)
    listing.set_defaults(func=cmd_fleet_list)
    remove = fleet_sub.add_parser("remove", help="remove a board: its certificate is refused from then on",
                                  description="Remove a board from the registry. Its certificate is refused from "
                                              "then on; its solving, queued and running runs fail. Exit 2 if there is no such "
                                              "board.", epilog=OPERATOR_EPILOG)
    remove.add_argument("name", metavar="NAME")
    operator_args(remove)
    remove.set_defaults(func=cmd_fleet_remove)
