"""Calibration bench, through the fleet: how well a board's profile predicts its training steps, before and
after `poet calibrate`.

Everything runs as a user runs it, on loopback with mutual TLS: ``poet serve``, one ``poet-agent run`` (the
board: this machine), then

1. ``poet calibrate --agent board --models mlp,resnet18_cifar,hf_bert`` (a PROFILE job: profile version k;
   TRAIN runs of each model under keep-all, remat-heavy and paging-heavy schedules solved on k; the fit on
   the runs' even steps: version k+1). Its report gives, per run, the measured median step time of the odd
   (held-out) steps and the step time versions k and k+1 predict for that run's schedule.
2. A model the calibration never saw (``--unseen``, a ``module:callable``) trains under the same three kinds
   of schedule, once solved and predicted on version k and once on version k+1 (``poet run
   --profile-version``), ``--unseen-repeats`` times (default 3, interleaved); the predicted step time is compared
   with the median of the runs' measured medians.

Prints a table: model, schedule, measured step s, predicted before / after, error before / after, and the
step-time MAPE of the seen and the unseen models. Energy is compared only where a meter measured it; this
machine has none, so the bench says so and reports time only.

    python bench/calibration.py [--steps 20] [--threads 1] [--plot DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from host.fleet.calibration import heavy_budget_after_refusal  # noqa: E402
from host.fleet.demo import Process, console_script, run_command  # noqa: E402

BOARD, OPERATOR = "board", "operator"
SEEN_MODELS = ("mlp", "resnet18_cifar", "hf_bert")
UNSEEN_MODEL = "host.graph.examples:small_cnn_images"
HEAVY_SHARES = ("50%", "65%", "80%")  # as `poet calibrate` does: the first share of the peak the model fits in
# (label, shares of the no-remat peak to try, extra `poet run` flags)
SCHEDULES = (("keep-all", ("100%",), ()), ("remat-heavy", HEAVY_SHARES, ("--no-paging",)),
             ("paging-heavy", HEAVY_SHARES, ("--no-remat",)))
HEAVY_RUNTIME_FACTOR = "4"
SOLVE_TIME_LIMIT_S = 30


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _poet_json(argv: list[str], env: dict[str, str]) -> tuple[int, dict]:
    log("$ poet " + " ".join(argv[1:]))
    done = subprocess.run(argv, env=env, text=True, stdout=subprocess.PIPE)
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        raise SystemExit(f"poet {argv[1]} exited {done.returncode} without a JSON object") from None


def _train_unseen(poet: str, env: dict[str, str], steps: int, budget: str, label: str, version: int,
                  flags: tuple[str, ...]) -> dict:
    """One run of the unseen model on the board; its entry of `poet run --json`."""
    _, reply = _poet_json(
        [poet, "run", "--model", UNSEEN_MODEL, "--dataset", ":synthetic", "--steps", str(steps),
         "--ram-budget", budget, "--runtime-budget", "1.2" if label == "keep-all" else HEAVY_RUNTIME_FACTOR,
         "--agents", BOARD, "--profile-version", str(version), *flags, "--wait", "--json"], env)
    return reply["runs"][0]


def _unseen_runs(poet: str, env: dict[str, str], versions: dict[str, int], steps: int, repeats: int) -> list[dict]:
    """The unseen model under each kind of schedule, solved and predicted on each profile version; each run
    ``repeats`` times (the runs interleaved), its measured step the median of the runs' median steps: one run of
    40 steps of 2-4 ms is 0.1 s, and on a machine shared with the coordinator the same schedule measured 2.26 and
    3.30 ms in two such runs, with the process's CPU time as long as the steps (the code ran slower, it was not
    descheduled)."""
    rows = []
    for label, shares, flags in SCHEDULES:
        row = {"model": UNSEEN_MODEL, "schedule": label, "seen_by_fit": False}
        for _ in range(repeats):
            for when, version in versions.items():
                for share in shares:  # the first share the model fits in, as `poet calibrate` does
                    run = _train_unseen(poet, env, steps, share, label, version, flags)
                    if run["status"] == "done":
                        break
                heavy = (heavy_budget_after_refusal(run.get("min_ram_budget_bytes"), run.get("ram_budget_bytes"),
                                                    float(share.rstrip("%")) / 100)
                         if run["status"] == "does_not_fit" else None)
                if heavy is not None:  # the floor is above every share: halfway from it to the peak, as `poet calibrate`
                    run = _train_unseen(poet, env, steps, str(heavy), label, version, flags)
                if run["status"] != "done":
                    raise SystemExit(f"the {label} run of {UNSEEN_MODEL} on profile v{version} ended {run['status']}: "
                                     f"{run.get('error') or run.get('detail')}")
                row[f"predicted_{when}_s"] = run["predicted"]["step_s"]  # one solve per version: the same each time
                row.setdefault(f"runs_measured_{when}_s", []).append(run["measured"]["step_s"])
                row.setdefault(f"runs_{when}", []).append(
                    {key: run.get(key) for key in ("run_id", "recomputes", "page_outs", "ram_budget_bytes")})
        for when in versions:
            row[f"measured_{when}_s"] = statistics.median(row[f"runs_measured_{when}_s"])
        rows.append(row)
    return rows


def _error_pct(predicted: float, measured: float) -> float:
    return 100.0 * abs(predicted - measured) / measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    parser.add_argument("--models", default=",".join(SEEN_MODELS),
                        help=f"calibration models (default {','.join(SEEN_MODELS)})")
    parser.add_argument("--batch-size", type=int, default=8, help="batch size of the calibration runs (default 8)")
    parser.add_argument("--threads", type=int, default=1,
                        help="the board's torch threads (default 1: the coordinator and this bench share the "
                             "machine's cores with it; 0: torch's default)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin the board to a core of its own (by default, with 2+ cores and taskset, the "
                             "board runs on the last core and the coordinator and the commands on the others: a real "
                             "board does not share its CPU with the coordinator)")
    parser.add_argument("--as-user", action="store_true",
                        help="calibrate as a user does with the defaults: `poet calibrate --agent board --wait --json` "
                             "(its default models, steps and batch size), the board not pinned and with torch's "
                             "default threads, sharing the machine with the coordinator; overrides --models, "
                             "--steps, --batch-size, --threads and pinning (the unseen model still runs)")
    parser.add_argument("--unseen-repeats", type=int, default=3,
                        help="runs of the unseen model per schedule and profile version, interleaved; its measured "
                             "step is the median of their medians (default 3)")
    parser.add_argument("--dir", help="working directory, kept afterwards (default: a temporary one, removed)")
    parser.add_argument("--plot", metavar="DIR", help="write predicted-vs-measured plots into DIR")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if args.as_user:
        from host.fleet.limits import CALIBRATION_STEPS

        args.models, args.steps, args.batch_size, args.threads, args.pin = None, CALIBRATION_STEPS, None, 0, False
    if args.unseen_repeats < 1:
        parser.error("--unseen-repeats must be at least 1")
    if args.steps < 4:
        parser.error("--steps must be at least 4 (a warm-up step, fitted steps and held-out steps)")

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.dir or scratch)
        root.mkdir(parents=True, exist_ok=True)
        report, unseen = _measure(root, args)
        if args.plot:
            _plots(Path(args.plot), root / "coordinator", report, log)

    rows = []
    for run in report["runs"]:
        if run.get("measured_step_s"):
            rows.append({"model": run["model"], "schedule": run["schedule"], "seen_by_fit": True,
                         "measured_step_s": run["measured_step_s"], "predicted_before_s": run["predicted_before_s"],
                         "predicted_after_s": run["predicted_after_s"],
                         "error_before_pct": _error_pct(run["predicted_before_s"], run["measured_step_s"]),
                         "error_after_pct": _error_pct(run["predicted_after_s"], run["measured_step_s"])})
    for row in unseen:
        rows.append({**row, "measured_step_s": row["measured_after_s"],
                     "error_before_pct": _error_pct(row["predicted_before_s"], row["measured_before_s"]),
                     "error_after_pct": _error_pct(row["predicted_after_s"], row["measured_after_s"])})
    summary = {}
    for label, seen in (("seen", True), ("unseen", False)):
        chosen = [r for r in rows if r["seen_by_fit"] is seen]
        if chosen:
            summary[label] = {"step_mape_before": statistics.fmean(r["error_before_pct"] for r in chosen),
                              "step_mape_after": statistics.fmean(r["error_after_pct"] for r in chosen)}
    result = {"cases": rows, "summary": summary, "calibration": {k: v for k, v in report.items() if k != "runs"},
              "energy_source": report.get("energy_source"), "torch_threads": args.threads, "steps": args.steps}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{'model':<38} {'schedule':<13} {'measured s':>10} {'pred before':>11} {'pred after':>10} "
          f"{'err before':>10} {'err after':>9}")
    for r in rows:
        name = r["model"] + ("" if r["seen_by_fit"] else " (unseen)")
        print(f"{name:<38} {r['schedule']:<13} {r['measured_step_s']:>10.5f} {r['predicted_before_s']:>11.5f} "
              f"{r['predicted_after_s']:>10.5f} {r['error_before_pct']:>9.1f}% {r['error_after_pct']:>8.1f}%")
    for label, figures in summary.items():
        print(f"{label}: step-time MAPE {figures['step_mape_before']:.1f}% -> {figures['step_mape_after']:.1f}%")
    if report.get("energy_mape_after") is None:
        print(f"energy: no meter on this board ({report.get('energy_source')}): time only")
    else:
        print(f"energy MAPE (calibration runs, held-out steps): {report['energy_mape_before']:.1f}% -> "
              f"{report['energy_mape_after']:.1f}% ({report.get('energy_source')})")
    return 0


def _cpu_split() -> tuple[list[int], list[int]]:
    """(the board's cores, everything else's): the last usable core for the board, when there are 2+ and taskset."""
    import shutil

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or shutil.which("taskset") is None:
        return [], []
    return cores[-1:], cores[:-1]


def _measure(root: Path, args) -> tuple[dict, list[dict]]:
    """Start the fleet in ``root``, calibrate the board, run the unseen model; (calibration report, unseen rows)."""
    certs = root / "certs"
    env = dict(os.environ, POET_AGENT_MAX_BACKOFF_S="2")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    poet, agent = console_script("poet"), console_script("poet-agent")
    board_cpus, host_cpus = _cpu_split() if args.pin else ([], [])
    board_prefix = ["taskset", "-c", ",".join(map(str, board_cpus))] if board_cpus else []
    if host_cpus:
        os.sched_setaffinity(0, host_cpus)  # the coordinator and the commands inherit this process's cores
        log(f"board pinned to core(s) {board_cpus}; coordinator and commands on {host_cpus}")
    for action, *who in (["init"], ["issue", "--node", BOARD], ["issue", "--operator", OPERATOR]):
        printed = run_command([poet, "certs", action, "--dir", str(certs), *who], env, capture=True)
        log(printed.rstrip())  # on stderr: stdout carries only the --json object
    for sub in ("flash", "data", "state"):
        (root / BOARD / sub).mkdir(parents=True, exist_ok=True)
    processes: list[Process] = []
    try:
        server = Process("coordinator", [poet, "serve", "--listen", "127.0.0.1:0", "--certs", str(certs),
                                         "--state-dir", str(root / "coordinator"),
                                         "--solve-time-limit", str(SOLVE_TIME_LIMIT_S)], env, echo=False)
        processes.append(server)
        address = server.wait_for("listening on").split("listening on", 1)[1].strip()
        board = Process(BOARD, [*board_prefix, agent, "run", "--coordinator", address, "--certs", str(certs / BOARD),
                                "--flash-dir", str(root / BOARD / "flash"), "--data-dir", str(root / BOARD / "data"),
                                "--state-dir", str(root / BOARD / "state")], env, echo=False)
        processes.append(board)
        board.wait_for("registered with")
        operator_env = dict(env, POET_COORDINATOR=address, POET_CERTS=str(certs / OPERATOR))
        chosen = [*(("--models", args.models) if args.models else ()), "--steps", str(args.steps),
                  *(("--batch-size", str(args.batch_size)) if args.batch_size else ())]
        code, report = _poet_json([poet, "calibrate", "--agent", BOARD, *chosen, "--wait", "--json"], operator_env)
        if code != 0:
            raise SystemExit(f"poet calibrate failed: {report}")
        log(f"calibrated: profile v{report['base_profile_version']} -> v{report['profile_version']}, held-out step "
            f"MAPE {report['step_mape_before']:.1f}% -> {report['step_mape_after']:.1f}%")
        versions = {"before": report["base_profile_version"], "after": report["profile_version"]}
        unseen = _unseen_runs(poet, operator_env, versions, args.steps, args.unseen_repeats)
    finally:
        for process in reversed(processes):
            process.stop()
    return report, unseen


def _plots(directory: Path, state_dir: Path, report: dict, log) -> None:
    """Per node compute, predicted on versions k and k+1 against measured (held-out steps), and each calibration
    run's per-step error, from the telemetry the coordinator stored."""
    from device_agent.serde import schedule_from_json
    from host.calibrate.fit import predict_step
    from host.costs import PlatformProfile, price_graph
    from host.fleet.calibration import runs_from_store, split_run
    from host.fleet.model_package import package_model
    from host.fleet.store import RunStore, sqlite_url
    from host.plots import plot_node_predictions, plot_step_errors

    store = RunStore(sqlite_url(state_dir))
    try:
        before, after = (PlatformProfile.from_dict(store.get_profile_version(BOARD, v).profile)
                         for v in (report["base_profile_version"], report["profile_version"]))
        run_ids = [r["run_id"] for r in report["runs"] if r.get("measured_step_s")]
        specs = {run_id: store.get_job(store.get_run(run_id).job_id).spec for run_id in run_ids}
        graphs: dict[tuple, object] = {}

        def graph_for_run(record):
            spec = specs[record.run_id]
            key = (spec["model"], spec.get("batch_size"))
            if key not in graphs:
                graphs[key] = package_model(spec["model"], state_dir / "bench-models",
                                            batch_size=spec.get("batch_size"), seed=int(spec.get("seed") or 0)).graph
            return graphs[key]

        def schedule_for_run(record):
            key = record.metrics["schedule_key"]
            stored = (specs[record.run_id].get("schedules") or {}).get(key)  # jobs of older releases
            return schedule_from_json(stored or store.get_solve(key).result["schedule_json"])

        runs = runs_from_store(store, run_ids, graph_for_run, schedule_for_run)
    finally:
        store.close()
    directory.mkdir(parents=True, exist_ok=True)
    heldout = report["heldout_steps"]
    points, series = [], {}
    for entry, run in zip([r for r in report["runs"] if r.get("measured_step_s")], runs, strict=True):
        held = split_run(run, heldout)
        priced_before, priced_after = price_graph(run.graph, before), price_graph(run.graph, after)
        seconds: dict[int, list[float]] = {}
        for event in held.instructions:
            if event["kind"] == "compute":
                seconds.setdefault(event["node"], []).append(event["duration_s"])
        points += [(statistics.median(v), float(priced_before.compute_s[n]), float(priced_after.compute_s[n]))
                   for n, v in seconds.items() if statistics.median(v) > 0]
        predicted_before, _ = predict_step(before, run.graph, run.schedule)
        predicted_after, _ = predict_step(after, run.graph, run.schedule)
        series[f"{entry['model'].rsplit(':', 1)[-1]} {entry['schedule']}"] = [
            (s["step"], 100 * (predicted_before / s["duration_s"] - 1), 100 * (predicted_after / s["duration_s"] - 1))
            for s in run.steps]
    log(f"plot {plot_node_predictions(points, directory / 'calibration_nodes.png', 'node computes on this board')}")
    log(f"plot {plot_step_errors(series, directory / 'calibration_steps.png', 'step time over each run')}")


if __name__ == "__main__":
    sys.exit(main())
