"""The `poet` command: the parser, the output channels, and how errors and signals become exit codes.

Results go to stdout and nothing else does: for the whole run, file descriptor 1 points at stderr
(C libraries such as HiGHS print there) and results are written to a private handle on the real
stdout. SIGTERM is handled like Ctrl-C (the executor removes its page files on the way out), with
exit code 143 instead of 130.
"""

from __future__ import annotations

import argparse
import signal
import sys

from host.cli import catalog, certs, fleet, mcu, solve, train
from host.cli.common import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, CliError, Console
from host.cli.display import LiveStatus

COMMAND_GROUPS = (catalog, solve, train, certs, fleet, mcu)  # each registers its commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="poet",
        description="poet-edge: energy-optimal on-device training schedules (POET, ICML 2022). Energy in joules, "
                    "time in seconds, memory in bytes.",
        epilog="exit codes: 0 a schedule was found (optimal or feasible), 1 internal error, 2 bad input, "
               "3 infeasible, 4 time limit with no schedule, 5 verify failed, 130 interrupted (Ctrl-C), "
               "143 terminated (SIGTERM)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.register(sub)
    return parser


class _Termination:
    """SIGTERM raises KeyboardInterrupt once, so it unwinds (and cleans up) exactly like Ctrl-C."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum, frame) -> None:
        if self.signal is not None:
            return  # already unwinding: let the cleanup finish
        self.signal = signum
        raise KeyboardInterrupt

    def install(self):
        try:
            return signal.signal(signal.SIGTERM, self)
        except ValueError:  # not the main thread: leave signals alone
            return None


def main(argv: list[str] | None = None) -> int:
    from host.fdio import stdout_to_stderr
    from host.run.errors import UserError

    parser = build_parser()
    args = parser.parse_args(argv)
    check = getattr(args, "check", None)
    if check is not None:
        check(args)  # checks across flags; exits 2 naming them, like argparse
    termination = _Termination()
    previous = termination.install()
    try:
        with stdout_to_stderr() as out, LiveStatus() as status:
            console = Console(out=out, status=status)
            try:
                return args.func(args, console)
            except (CliError, UserError) as error:
                status.close()
                message = str(error).strip("'\"") if isinstance(error, KeyError) else str(error)
                print(f"poet {args.command}: error: {message}", file=sys.stderr)
                return EXIT_USAGE
            except KeyboardInterrupt:
                status.close()
                what = "terminated" if termination.signal is not None else "interrupted"
                print(f"poet {args.command}: {what}", file=sys.stderr)
                return 128 + termination.signal if termination.signal is not None else EXIT_INTERRUPTED
            except BrokenPipeError:  # e.g. `poet models | head`
                return EXIT_OK
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
