"""`poet serve`: the coordinator (host/fleet/server.py) until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import sys
import threading

from host.cli.common import (
    EXIT_OK,
    CliError,
    Console,
    directory_path,
    int_at_least,
    positive_int,
    seconds,
)


# ------------------------------------------------------------------------------------------ serve
def cmd_serve(args, console: Console) -> int:
    import logging

    from host.fleet.certs import CertError
    from host.fleet.server import split_listen, start_coordinator
    from host.fleet.store import StoreError

    try:
        split_listen(args.listen)
    except ValueError as error:
        raise CliError(f"--listen {error}") from None
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)  # its per-plugin INFO lines say nothing to an operator
    running = None
    try:  # SIGTERM may come at any moment from here on: host/cli/main.py raises KeyboardInterrupt for it
        try:
            running = start_coordinator(args.listen, args.certs, store_url=args.store, state_dir=args.state_dir,
                                        solve_time_limit_s=args.solve_time_limit, max_workers=args.max_workers,
                                        refine_profiles=not args.no_refine, solver_workers=args.solver_workers)
        except (CertError, StoreError) as error:
            raise CliError(str(error)) from None
        except RuntimeError as error:  # grpc: the address cannot be bound
            raise CliError(f"cannot listen on {args.listen} ({error}); pick another --listen HOST:PORT") from None
        print(f"listening on {running.address}", file=sys.stderr, flush=True)
        stopped = threading.Event()
        while not stopped.wait(1.0):
            pass
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: a requested, graceful stop
        console.log("shutting down")
    finally:
        if running is not None:
            running.stop()
    console.log("stopped")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    from host.fleet.limits import (
        DEFAULT_SOLVER_WORKERS,
        DEFAULT_STATE_DIR,
        MAX_MESSAGE_BYTES,
        MAX_WORKERS,
        OPERATOR_RESERVED_WORKERS,
        SOLVE_TIME_LIMIT_S,
        STOP_GRACE_S,
    )

    serve = sub.add_parser(
        "serve", help="run the fleet coordinator (gRPC, mutual TLS)",
        description="Run the coordinator boards dial (`poet-agent run`) and operators drive (`poet fleet`, "
                    "`poet run`, `poet runs`). Mutual TLS always: clients need a certificate from the same CA. "
                    "Once serving it prints exactly one line `listening on HOST:PORT` (the real port) on stderr. "
                    f"It serves grpc.health.v1 (SERVING once the store is open), bounds messages to "
                    f"{MAX_MESSAGE_BYTES // 2**20} MiB, and runs {MAX_WORKERS} worker threads (each long poll and "
                    "telemetry stream holds one).",
        epilog=f"SIGTERM or Ctrl-C stops it gracefully (calls in flight get {STOP_GRACE_S:g} s), closes the store and exits 0. "
               "Exit 2: bad flags, certificates or store.")
    serve.add_argument("--listen", required=True, metavar="HOST:PORT",
                       help="address to bind, e.g. 0.0.0.0:50051; port 0 picks a free port")
    serve.add_argument("--certs", required=True, type=directory_path, metavar="DIR",
                       help="what `poet certs init --dir DIR` wrote (DIR, or its coordinator/ bundle)")
    serve.add_argument("--store", metavar="URL",
                       help="run store URL: sqlite:///PATH or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB "
                            "(default: STATE_DIR/poet.db)")
    serve.add_argument("--state-dir", type=directory_path, default=DEFAULT_STATE_DIR, metavar="DIR",
                       help=f"model archives (models/SHA256.pt2), collected weights (results/RUN_ID.safetensors) "
                            f"and the default store (default: ./{DEFAULT_STATE_DIR})")
    serve.add_argument("--solve-time-limit", type=seconds, default=SOLVE_TIME_LIMIT_S, metavar="S",
                       help=f"seconds per distinct schedule; at the limit the best schedule found is used, reported "
                            f"with its proven gap (default {SOLVE_TIME_LIMIT_S:g})")
    serve.add_argument("--max-workers", type=_server_workers, default=MAX_WORKERS, metavar="N",
                       help=f"server threads, > {OPERATOR_RESERVED_WORKERS}; boards together hold at most N - "
                            f"{OPERATOR_RESERVED_WORKERS} (the rest are kept for operators and health checks), about "
                            f"two each (a long poll and a telemetry stream), so N = 2 x boards + "
                            f"{OPERATOR_RESERVED_WORKERS} serves every board at once; more boards retry (default "
                            f"{MAX_WORKERS})")
    serve.add_argument("--no-refine", action="store_true",
                       help="do not refine calibrated boards' profiles from their TRAIN and VERIFY runs (by default "
                            "each such run's telemetry refits the board's profile, stored as a new version when it "
                            "predicts better)")
    serve.add_argument("--solver-workers", type=int_at_least(0), default=DEFAULT_SOLVER_WORKERS, metavar="N",
                       help="schedules solved at once in this process (each solve runs HiGHS in a process of its "
                            "own, so N uses up to N cores); 0 leaves solving to `poet solver-worker` processes "
                            f"sharing the store (default {DEFAULT_SOLVER_WORKERS})")
    serve.set_defaults(func=cmd_serve)


def _server_workers(text: str) -> int:
    from host.fleet.admission import board_calls_for

    count = positive_int(text)
    try:
        board_calls_for(count)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return count
