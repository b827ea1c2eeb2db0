"""`poet solver-worker`: solve a coordinator's queued schedules from another process or host (host/fleet/solving.py)
until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import sys
import threading

from host.cli.common import EXIT_OK, CliError, Console, positive_int


# ------------------------------------------------------------------------------------------ solver-worker
def cmd_solver_worker(args, console: Console) -> int:
    import logging

    from host.fleet.solving import SolverPool
    from host.fleet.store import RunStore, StoreError

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        store = RunStore(args.store)
    except StoreError as error:
        raise CliError(str(error)) from None
    pool = None
    try:
        pool = SolverPool(store, args.workers).start()
        print(f"solving queued schedules from {store.url} with {args.workers} worker(s)", file=sys.stderr, flush=True)
        stopped = threading.Event()
        while not stopped.wait(1.0):
            pass
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: solves in progress go back to the queue
        console.log("shutting down")
    finally:
        if pool is not None:
            pool.stop()
        store.close()
    console.log(f"stopped ({pool.solved if pool else 0} schedule(s) solved)")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    from host.fleet.limits import DEFAULT_SOLVER_WORKERS, SOLVE_LEASE_S

    worker = sub.add_parser(
        "solver-worker", help="solve the coordinator's queued schedules (from another process or host)",
        description="Solve the schedules submissions queued in a coordinator's run store: SubmitRun records each "
                    "run as solving and answers at once; workers (this command, and `poet serve --solver-workers`) "
                    "claim each distinct schedule once, solve it and store it, and the runs waiting for it are "
                    "queued for their boards. Several workers and coordinators on other hosts share one PostgreSQL "
                    "store, where each claims rows the others skip (FOR UPDATE SKIP LOCKED). A claim is a lease of "
                    f"{SOLVE_LEASE_S:g} s, renewed while the worker solves: a worker killed mid-solve loses it, and "
                    "another worker solves that schedule again. Once started it prints one line `solving queued "
                    "schedules from URL with N worker(s)` on stderr.",
        epilog="SIGTERM or Ctrl-C stops it: solves in progress go back to the queue, and it exits 0. Exit 2: bad "
               "flags or store.")
    worker.add_argument("--store", required=True, metavar="URL",
                        help="the coordinator's run store: postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB (or its "
                             "sqlite:///STATE_DIR/poet.db, on the coordinator's host)")
    worker.add_argument("--workers", type=positive_int, default=DEFAULT_SOLVER_WORKERS, metavar="N",
                        help=f"schedules solved at once (default {DEFAULT_SOLVER_WORKERS})")
    worker.set_defaults(func=cmd_solver_worker)

