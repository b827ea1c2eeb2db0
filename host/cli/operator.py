"""What the operator's command groups share: the client built from --coordinator/--certs, those flags, and the
small formatting helpers of their tables. The client itself (no argparse) is host/fleet/client.py."""

from __future__ import annotations

import argparse
import functools

from host.cli.common import CliError, Console
from host.cli.display import format_bytes
from host.fleet.client import CERTS_ENV, COORDINATOR_ENV

EXIT_RUN_FAILED = 6  # a run ended failed, or a board's budget is below the schedule's floor (does_not_fit)
POLL_INTERVAL_S = 1.0
OPERATOR_EPILOG = (f"The coordinator and bundle come from --coordinator/--certs or ${COORDINATOR_ENV}/${CERTS_ENV}. "
                   "Exit codes: 0 ok, 2 bad input or the coordinator refused or is unreachable (one line says why), "
                   "130/143 interrupted.")


def with_operator(function):
    """Run a command with an OperatorClient (host/fleet/client.py) built from --coordinator/--certs; its errors
    become CliErrors."""
    from host.fleet.client import FleetClientError, OperatorClient

    @functools.wraps(function)
    def command(args, console: Console) -> int:
        try:
            operator = OperatorClient.from_settings(args.coordinator, args.certs)
        except FleetClientError as error:
            raise CliError(str(error)) from None
        try:
            return function(args, console, operator)
        except FleetClientError as error:
            raise CliError(str(error)) from None
        finally:
            operator.close()

    return command


def operator_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help=f"the coordinator's address (default: ${COORDINATOR_ENV})")
    parser.add_argument("--certs", metavar="DIR",
                        help=f"your operator bundle, from `poet certs issue --operator NAME` (default: ${CERTS_ENV})")


def num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def short_bytes(value) -> str:
    if not value:
        return "-"
    return format_bytes(value, exact=False)
