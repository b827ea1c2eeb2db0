"""Submit and solve fan-out benchmark: N boards of P profiles submitted at once to a real coordinator, solved by
1, 2 and 4 solver workers. Prints a table (and one JSON object with --json).

What is real: ``poet serve`` (a subprocess, its SQLite store, ``--solver-workers W``, its HiGHS worker processes),
mutual TLS, the operator's SubmitRun and GetRun calls, the model traced by the coordinator and every solve. What is
simulated: the boards. They are registered in the store before the coordinator starts (none dials in), so nothing
trains; a board's profile is the shipped platform it names, ``--boards`` spread evenly over ``--platforms``, so the
submission holds one distinct schedule per platform.

Measured per worker count, each on a fresh state dir (no solve is cached from another row):

- ``submit_s``: the SubmitRun call, from sending to its reply (the model is traced inside it, once per coordinator:
  a ``--warm-up`` submission of the same model at another budget runs first, so this is the call a user makes
  against a running coordinator);
- ``all_solved_s``: from sending SubmitRun until no run is ``solving`` (GetRun polled every 0.1 s);
- ``solves``: distinct schedules solved; ``solve_s_sum``: their solve times added up, what one SubmitRun that
  solved inline, one schedule after the other, would have taken on top of ``submit_s``.

    python bench/solving.py                     # 50 boards, 5 platforms, resnet18_cifar at 50%, 1/2/4 workers
    python bench/solving.py --workers 1,2 --solve-time-limit 20 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OPERATOR = "bench-operator"


def prepare(root: Path, boards: int, platforms: list[str]) -> tuple[Path, Path, list[str]]:
    """Certificates (CA, coordinator, one operator) and a store with ``boards`` registered boards."""
    from host.fleet.certs import init_certs, issue_cert
    from host.fleet.store import RunStore, sqlite_url

    certs = root / "certs"
    init_certs(certs, [])
    issue_cert(certs, OPERATOR, "operator")
    state = root / "state"
    state.mkdir()
    names = [f"board-{i:03d}" for i in range(boards)]
    facts = {"cpu_count": 4, "meters": ["modelled"], "ram_total_bytes": 4 << 30, "ram_available_bytes": 2 << 30,
             "runtime_rss_bytes": 0}
    with RunStore(sqlite_url(state)) as store:
        for i, name in enumerate(names):
            platform = platforms[i % len(platforms)]
            store.register_agent(name, platform, {**facts, "platform": platform})
    return certs, state, names


def serve(certs: Path, state: Path, workers: int, solve_time_limit_s: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "host.cli", "serve", "--listen", "127.0.0.1:0", "--certs", str(certs),
         "--state-dir", str(state), "--solver-workers", str(workers), "--solve-time-limit", str(solve_time_limit_s)],
        cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        if line.startswith("listening on "):
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, line.split("listening on ", 1)[1].strip()
    raise RuntimeError(f"poet serve exited with {proc.wait()} before listening")


def submit_and_wait(client, names: list[str], model: str, share: float, timeout_s: float) -> dict:
    pb = client.pb
    request = pb.SubmitRunRequest(model=model, dataset="digits", steps=10, agents=names,
                                  ram_budget=pb.RamBudget(fraction_of_peak=share))
    started = time.monotonic()
    runs = list(client.call("SubmitRun", request, timeout_s=600).runs)
    submit_s = time.monotonic() - started
    statuses = {r.run_id: r.status for r in runs}
    while any(s == pb.RUN_STATUS_SOLVING for s in statuses.values()):
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"runs still solving after {timeout_s} s")
        time.sleep(0.1)
        for run_id, status in statuses.items():
            if status == pb.RUN_STATUS_SOLVING:
                statuses[run_id] = client.call("GetRun", pb.GetRunRequest(run_id=run_id)).status
    all_solved_s = time.monotonic() - started
    final = {}
    for status in statuses.values():
        name = pb.RunStatus.Name(status).removeprefix("RUN_STATUS_").lower()
        final[name] = final.get(name, 0) + 1
    return {"submit_s": submit_s, "all_solved_s": all_solved_s, "runs": final,
            "replied_solving": sum(r.status == pb.RUN_STATUS_SOLVING for r in runs), "run_ids": list(statuses)}


def one_row(args, workers: int, platforms: list[str]) -> dict:
    from host.fleet.client import OperatorClient
    from host.fleet.store import RunStore, sqlite_url

    with tempfile.TemporaryDirectory(prefix="poet-bench-solving-") as scratch:
        certs, state, names = prepare(Path(scratch), args.boards, platforms)
        proc, address = serve(certs, state, workers, args.solve_time_limit)
        try:
            with OperatorClient(address, certs / OPERATOR) as client:
                if args.warm_up:  # the coordinator traces the model once; the measured call is the next one
                    submit_and_wait(client, names[:1], args.model, args.share * 0.999, args.timeout)
                row = submit_and_wait(client, names, args.model, args.share, args.timeout)
            with RunStore(sqlite_url(state)) as store:
                keys = {store.get_run(run_id).run_metrics.schedule_key for run_id in row.pop("run_ids")}
                measured = [store.get_solve(key) for key in sorted(k for k in keys if k)]
        finally:
            proc.terminate()
            proc.wait(60)
    row.update(workers=workers, boards=args.boards, platforms=len(platforms),
               solves=len(measured), solve_s_sum=sum(s.result["solver"]["solve_s"] for s in measured))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--boards", type=int, default=50)
    parser.add_argument("--platforms", default="m4,a72,a72nocache,jetsontx2,m0",
                        help="the shipped platforms the boards name, evenly (default: all five)")
    parser.add_argument("--model", default="resnet18_cifar")
    parser.add_argument("--share", type=float, default=0.5, help="RAM budget as a share of the no-remat peak")
    parser.add_argument("--workers", default="1,2,4", help="solver worker counts, one row each")
    parser.add_argument("--solve-time-limit", type=float, default=30.0, help="per distinct schedule (s)")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="measure the coordinator's first submission (its trace included)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    platforms = [p.strip() for p in args.platforms.split(",") if p.strip()]
    rows = []
    for workers in [int(w) for w in args.workers.split(",")]:
        rows.append(one_row(args, workers, platforms))
        print(f"  {workers} worker(s) done", file=sys.stderr, flush=True)
    result = {"model": args.model, "share": args.share, "solve_time_limit_s": args.solve_time_limit,
              "cores": os.cpu_count(), "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.model} at {args.share:.0%} of the no-remat peak, {args.boards} boards on {len(platforms)} platforms, "
          f"{args.solve_time_limit:g} s per solve, {os.cpu_count()} cores")
    print(f"{'workers':>7} {'submit s':>9} {'all solved s':>13} {'solves':>6} {'sum of solve s':>15} "
          f"{'replied solving':>15}  runs")
    for r in rows:
        print(f"{r['workers']:>7} {r['submit_s']:>9.2f} {r['all_solved_s']:>13.1f} {r['solves']:>6} "
              f"{r['solve_s_sum']:>15.1f} {r['replied_solving']:>15}  {r['runs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
