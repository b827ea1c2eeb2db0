"""The fleet's commands: `poet serve` (the coordinator), and the operator's `poet fleet`, `poet run`, `poet runs`.

Operator commands reach the coordinator at --coordinator HOST:PORT (or $POET_COORDINATOR) with the
operator bundle --certs DIR (or $POET_CERTS), over mutual TLS. A gRPC error becomes one line naming
the problem and the fix (exit 2).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from device_agent.executor.reference import OPTIMIZERS
from host.cli.common import (
    EXIT_OK,
    CliError,
    Console,
    add_ablation_args,
    add_json_arg,
    directory_path,
    learning_rate,
    positive_int,
    runtime_factor,
    seconds,
    seed_int,
)
from host.cli.display import format_bytes
from host.fleet.client import CERTS_ENV, COORDINATOR_ENV, OperatorClient

EXIT_RUN_FAILED = 6  # a run ended failed, or a board's budget is below the schedule's floor (does_not_fit)
POLL_INTERVAL_S = 1.0
FINISHED = ("done", "failed", "does_not_fit")


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
                                        refine_profiles=not args.no_refine)
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


# ------------------------------------------------------------------------------------------ the operator's client
def _with_operator(function):
    """Run a command with an OperatorClient (host/fleet/client.py) built from --coordinator/--certs; its errors
    become CliErrors."""
    from host.fleet.client import FleetClientError, OperatorClient

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


# ------------------------------------------------------------------------------------------ fleet
@_with_operator
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
        limit = _short_bytes(a["memory_limit_bytes"]) if a["memory_limit_bytes"] else "none"
        console.print(f"{a['name']:<16} {a['platform']:<12} {'yes' if a['online'] else 'no':<6} "
                      f"{_short_bytes(a['ram_total_bytes']):>12} {limit:>12} {_short_bytes(a['flash_free_bytes']):>12} "
                      f"{a['cpu_count']:>4}  {','.join(a['meters'])}")
    return EXIT_OK


@_with_operator
def cmd_fleet_remove(args, console: Console, op: OperatorClient) -> int:
    reply = op.call("RemoveAgent", op.pb.RemoveAgentRequest(name=args.name))
    if not reply.removed:
        raise CliError(f"no agent named {args.name!r} (see `poet fleet list`)")
    console.print(f"removed {args.name}: its certificate is refused from now on; its queued and running runs failed")
    return EXIT_OK


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


@_with_operator
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
    )
    if args.ram_budget is not None:
        request.ram_budget.CopyFrom(args.ram_budget)
    console.log(f"submitting {args.kind} of {args.model or 'a profile'} to "
                f"{'every online board' if args.all else ', '.join(agents)} (the coordinator solves per board)")
    runs = op.submit(request, log=console.log)
    if args.wait:
        runs = _wait(op, runs, console)
    entries = [serde.run_info_to_json(r) for r in runs]
    if args.json:
        console.print_json({"runs": entries})
    else:
        _runs_table(console, entries)
    return EXIT_RUN_FAILED if any(e["status"] in ("failed", "does_not_fit") for e in entries) else EXIT_OK


def _wait(op: OperatorClient, runs: list, console: Console) -> list:
    """Poll the runs until each is done, failed or does_not_fit; progress per board on stderr."""
    from host.fleet.serde import RUN_STATUS_FROM_PB

    latest = {r.run_id: r for r in runs}
    reported: set[str] = set()
    while True:
        for run_id, run in latest.items():
            if RUN_STATUS_FROM_PB[run.status] not in FINISHED:
                latest[run_id] = op.call("GetRun", op.pb.GetRunRequest(run_id=run_id))
        parts = []
        for run in latest.values():
            status = RUN_STATUS_FROM_PB[run.status]
            if status in FINISHED and run.run_id not in reported:
                reported.add(run.run_id)
                loss = f", final loss {run.final_loss:.4f}" if run.HasField("final_loss") else ""
                why = f": {run.error}" if run.error else ""
                console.log(f"  {run.agent}: {status}{loss}, {run.events_stored} events received{why}")
            if status not in FINISHED:
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
        budget = _short_bytes(e["ram_budget_bytes"]) if e["ram_budget_bytes"] else "-"
        step = f"{_num(pred['step_s'], '.4f')}/{_num(meas['step_s'], '.4f')}"
        peak = f"{_short_bytes(pred['peak_ram_bytes'])}/{_short_bytes(meas['peak_ram_bytes'])}"
        acc = f"{_num(e['accuracy_before'], '.3f')}->{_num(e['accuracy_after'], '.3f')}"
        console.print(f"{e['agent']:<14} {e['status']:<12} {budget:>10} {e['recomputes']:>6} {e['page_ins']:>5} "
                      f"{e['page_outs']:>5} {step:>19} {peak:>21} {_num(e['final_loss'], '.4f'):>10} {acc:>17}")
        if e["status"] == "does_not_fit":
            console.print(f"  {e['agent']}: does not fit; needs at least {_short_bytes(e['min_ram_budget_bytes'])}: "
                          f"{e['error']}")
        elif e["error"]:
            console.print(f"  {e['agent']}: {e['error']}")
    console.log("budget: the RAM the schedule controls per board; peak RAM: predicted by the solver / measured "
                "on the board; run ids: `poet runs list`")


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _short_bytes(value) -> str:
    if not value:
        return "-"
    return format_bytes(value, exact=False)


# ------------------------------------------------------------------------------------------ runs
@_with_operator
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
        budget = _short_bytes(e["ram_budget_bytes"]) if e["ram_budget_bytes"] else "-"
        console.print(f"{e['run_id']:<18} {e['agent']:<14} {e['kind']:<7} {e['status']:<12} "
                      f"{e['steps_done']:>4}/{e['steps']:<4} {budget:>10} {_num(e['final_loss'], '.4f'):>10}")
    return EXIT_OK


@_with_operator
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


# ------------------------------------------------------------------------------------------ profiles
@_with_operator
def cmd_profiles_list(args, console: Console, op: OperatorClient) -> int:
    from host.fleet.serde import profile_info_to_json

    reply = op.call("ListProfiles", op.pb.ListProfilesRequest(agent=args.agent or ""))
    entries = [profile_info_to_json(p, with_profile=False) for p in reply.profiles]
    if args.json:
        console.print_json({"profiles": entries})
        return EXIT_OK
    if not entries:
        console.print("no stored profiles (boards are priced on their shipped platform; `poet calibrate --agent NAME` "
                      "or `poet run --kind profile` stores one)")
        return EXIT_OK
    console.print(f"{'board':<14} {'version':>7} {'name':<16} {'created (UTC)':<20} {'source':<12} "
                  f"{'step MAPE before->after':>24}")
    for e in entries:
        prov = e["provenance"]
        mape = ""
        if prov.get("step_mape_before") is not None:
            mape = f"{prov['step_mape_before']:.1f}% -> {prov['step_mape_after']:.1f}%"
        console.print(f"{e['agent']:<14} {e['version']:>7} {e['name']:<16} {_utc(e['created_unix_s']):<20} "
                      f"{prov.get('source', '-'):<12} {mape:>24}")
    return EXIT_OK


@_with_operator
def cmd_profiles_show(args, console: Console, op: OperatorClient) -> int:
    from host.fleet.serde import profile_info_to_json

    entry = profile_info_to_json(op.call("GetProfile", op.pb.GetProfileRequest(agent=args.agent,
                                                                               version=args.version or 0)))
    if args.json:
        console.print_json(entry)
        return EXIT_OK
    console.print(f"{entry['agent']} profile v{entry['version']} ({entry['name']}), stored "
                  f"{_utc(entry['created_unix_s'])} UTC")
    for key, value in entry["provenance"].items():
        console.print(f"  provenance.{key:<22} {value}")
    for key, value in _flatten(entry["profile"]).items():
        if not key.startswith("sources."):
            console.print(f"  {key:<40} {value}")
    return EXIT_OK


@_with_operator
def cmd_profiles_diff(args, console: Console, op: OperatorClient) -> int:
    from host.fleet.serde import profile_info_to_json

    a, b = (profile_info_to_json(op.call("GetProfile", op.pb.GetProfileRequest(agent=args.agent, version=v)))
            for v in (args.a, args.b))
    changes = profile_diff(a["profile"], b["profile"])
    if args.json:
        console.print_json({"agent": args.agent, "a": args.a, "b": args.b, "changes": changes})
        return EXIT_OK
    if not changes:
        console.print(f"{args.agent}: versions {args.a} and {args.b} are the same")
        return EXIT_OK
    console.print(f"{'field':<44} {'v' + str(args.a):>14} {'v' + str(args.b):>14} {'change':>9}")
    for c in changes:
        rel = "-" if c["rel_change"] is None else f"{c['rel_change'] * 100:+.1f}%"
        console.print(f"{c['field']:<44} {_cell(c['a']):>14} {_cell(c['b']):>14} {rel:>9}")
    return EXIT_OK


def profile_diff(a: dict, b: dict) -> list[dict]:
    """Field by field (dotted paths, `sources.*` left out): {field, a, b, rel_change} for each field that differs;
    rel_change = (b - a) / |a| for numbers (null when a is 0 or a side is not a number or is missing)."""
    flat_a, flat_b = _flatten(a), _flatten(b)
    out = []
    for key in sorted(set(flat_a) | set(flat_b)):
        if key.startswith("sources."):
            continue
        va, vb = flat_a.get(key), flat_b.get(key)
        if va == vb:
            continue
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
        rel = (vb - va) / abs(va) if numbers and va else None
        out.append({"field": key, "a": va, "b": vb, "rel_change": rel})
    return out


def _flatten(value: dict, prefix: str = "") -> dict:
    flat = {}
    for key, item in value.items():
        if isinstance(item, dict):
            flat.update(_flatten(item, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = item
    return flat


def _cell(value) -> str:
    if isinstance(value, float):
        return format(value, ".4g")
    return "-" if value is None else str(value)[:14]


def _utc(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(unix_s))


# ------------------------------------------------------------------------------------------ calibrate
@_with_operator
def cmd_calibrate(args, console: Console, op: OperatorClient) -> int:
    import json

    models = [m.strip() for m in (args.models or "").split(",") if m.strip()]
    request = op.pb.CalibrateRequest(agent=args.agent, models=models, steps=args.steps or 0,
                                     batch_size=args.batch_size or 0)
    info = op.call("Calibrate", request)
    console.log(f"calibration {info.calibration_id} of {info.agent} started on the coordinator (it goes on if this "
                f"command exits)")
    if args.detach:
        entry = {"calibration_id": info.calibration_id, "agent": info.agent, "status": info.status}
        if args.json:
            console.print_json(entry)
        else:
            console.print(f"{info.calibration_id} {info.status}: `poet profiles list --agent {info.agent}` shows the "
                          f"stored version once it is done")
        return EXIT_OK
    stages_logged = 0

    def log_new_stages() -> None:  # each stage once, even one that began and ended between two polls
        nonlocal stages_logged
        for stage in info.stages[stages_logged:]:
            console.log(f"  {info.agent}: {stage}")
        stages_logged = max(stages_logged, len(info.stages))

    try:
        while info.status == "running":
            if args.wait:
                log_new_stages()
                if info.stage.partition(": ")[2]:  # the current stage's progress is a live line
                    console.status.line(f"  {info.agent}: {info.stage}")
            time.sleep(POLL_INTERVAL_S)
            info = op.call("GetCalibration", op.pb.GetCalibrationRequest(calibration_id=info.calibration_id))
    except KeyboardInterrupt:
        console.log(f"stopped waiting; calibration {info.calibration_id} goes on on the coordinator")
        raise
    if args.wait:
        log_new_stages()
    if info.status != "done":
        raise CliError(f"calibration {info.calibration_id} of {info.agent} failed: {info.error}")
    report = json.loads(info.report_json)
    if args.json:
        console.print_json(report)
        return EXIT_OK
    energy = ("no meter: time only" if report["energy_mape_before"] is None else
              f"{report['energy_mape_before']:.1f}% -> {report['energy_mape_after']:.1f}%")
    console.print(f"{report['agent']}: profile v{report['profile_version']} stored (fitted on v"
                  f"{report['base_profile_version']}); held-out step-time MAPE {report['step_mape_before']:.1f}% -> "
                  f"{report['step_mape_after']:.1f}%; energy MAPE {energy} ({report['energy_source']})")
    console.print(f"{'run':<18} {'model':<16} {'schedule':<20} {'status':<8} {'p-out':>5} {'recomp':>6} "
                  f"{'MAPE before->after':>20}")
    for run in report["runs"]:
        mape = (f"{run['step_mape_before']:.1f}% -> {run['step_mape_after']:.1f}%"
                if run.get("step_mape_before") is not None else "-")
        console.print(f"{run['run_id']:<18} {run['model']:<16} {run['schedule']:<20} {run['status']:<8} "
                      f"{_num(run.get('page_outs'), 'd'):>5} {_num(run.get('recomputes'), 'd'):>6} {mape:>20}")
    return EXIT_OK


# ------------------------------------------------------------------------------------------ parser
def _operator_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help=f"the coordinator's address (default: ${COORDINATOR_ENV})")
    parser.add_argument("--certs", metavar="DIR",
                        help=f"your operator bundle, from `poet certs issue --operator NAME` (default: ${CERTS_ENV})")


OPERATOR_EPILOG = (f"The coordinator and bundle come from --coordinator/--certs or ${COORDINATOR_ENV}/${CERTS_ENV}. "
                   "Exit codes: 0 ok, 2 bad input or the coordinator refused or is unreachable (one line says why), "
                   "130/143 interrupted.")


def register(sub: argparse._SubParsersAction) -> None:
    from host.fleet.limits import (
        AUTO_MARGIN_BYTES,
        DEFAULT_STATE_DIR,
        HEARTBEAT_TIMEOUT_S,
        MAX_MESSAGE_BYTES,
        MAX_WORKERS,
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
    serve.add_argument("--max-workers", type=positive_int, default=MAX_WORKERS, metavar="N",
                       help=f"server threads; each board holds about two (its long poll and its telemetry "
                            f"stream), so serve N/2 boards at once (default {MAX_WORKERS})")
    serve.add_argument("--no-refine", action="store_true",
                       help="do not refine calibrated boards' profiles from their TRAIN and VERIFY runs (by default "
                            "each such run's telemetry refits the board's profile, stored as a new version when it "
                            "predicts better)")
    serve.set_defaults(func=cmd_serve)

    fleet = sub.add_parser("fleet", help="list and remove the boards of the fleet",
                           description="The boards registered with the coordinator.", epilog=OPERATOR_EPILOG)
    fleet_sub = fleet.add_subparsers(dest="fleet_command", required=True, metavar="SUBCOMMAND")
    listing = fleet_sub.add_parser("list", help="the registered boards and what they reported",
                                   description=f"Registered boards; online = seen within {HEARTBEAT_TIMEOUT_S:g} s.",
                                   epilog=OPERATOR_EPILOG)
    _operator_args(listing)
    add_json_arg(listing)
    listing.set_defaults(func=cmd_fleet_list)
    remove = fleet_sub.add_parser("remove", help="remove a board: its certificate is refused from then on",
                                  description="Remove a board from the registry. Its certificate is refused from "
                                              "then on; its queued and running runs fail. Exit 2 if there is no such "
                                              "board.", epilog=OPERATOR_EPILOG)
    remove.add_argument("name", metavar="NAME")
    _operator_args(remove)
    remove.set_defaults(func=cmd_fleet_remove)

    run = sub.add_parser(
        "run", help="train, verify or profile on boards of the fleet",
        description="Submit a run to boards: a module:callable model is traced here and its archive uploaded (the "
                    "coordinator never runs your code; a zoo model it traces itself); the coordinator gives each "
                    "board its RAM budget, solves a schedule per board on that board's profile (its measured one, else its platform's, "
                    f"else this machine's; {SOLVE_TIME_LIMIT_S:g} s limit per distinct schedule; identical boards "
                    "share one solve) and queues one run per board. The data stays on the boards.",
        epilog=f"Exit codes: 0 every run queued (or, with --wait, done); {EXIT_RUN_FAILED} a run failed or does not "
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
    run.add_argument("--optimizer", default="sgd", choices=list(OPTIMIZERS), help="(default: sgd)")
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
    run.add_argument("--wait", action="store_true",
                     help="show progress per board on stderr until every run is done, failed or does_not_fit, then "
                          "a table (budget, recomputes, page-ins/outs, predicted vs measured step time and peak RAM, "
                          "final loss, accuracy before and after)")
    _operator_args(run)
    add_json_arg(run)
    run.set_defaults(func=cmd_run)

    runs = sub.add_parser("runs", help="list and show runs", description="Runs on the fleet's boards.",
                          epilog=OPERATOR_EPILOG)
    runs_sub = runs.add_subparsers(dest="runs_command", required=True, metavar="SUBCOMMAND")
    runs_list = runs_sub.add_parser("list", help="every run, oldest first", epilog=OPERATOR_EPILOG)
    _operator_args(runs_list)
    add_json_arg(runs_list)
    runs_list.set_defaults(func=cmd_runs_list)
    show = runs_sub.add_parser("show", help="one run", epilog=OPERATOR_EPILOG)
    show.add_argument("run_id", metavar="RUN_ID")
    _operator_args(show)
    add_json_arg(show)
    show.set_defaults(func=cmd_runs_show)

    profiles = sub.add_parser("profiles", help="the boards' stored profile versions",
                              description="Each board's stored profile versions: measured by a PROFILE job or "
                                          "fitted by `poet calibrate`, with where each came from. The coordinator "
                                          "solves a board's runs on its latest version unless `poet run "
                                          "--profile-version N` pins one.", epilog=OPERATOR_EPILOG)
    profiles_sub = profiles.add_subparsers(dest="profiles_command", required=True, metavar="SUBCOMMAND")
    plist = profiles_sub.add_parser("list", help="stored versions, by board then version", epilog=OPERATOR_EPILOG)
    plist.add_argument("--agent", metavar="NAME", help="only this board's versions (default: every board)")
    _operator_args(plist)
    add_json_arg(plist)
    plist.set_defaults(func=cmd_profiles_list)
    pshow = profiles_sub.add_parser("show", help="one version: the profile JSON and its provenance",
                                    epilog=OPERATOR_EPILOG)
    pshow.add_argument("agent", metavar="AGENT")
    pshow.add_argument("--version", type=positive_int, metavar="N", help="(default: the latest)")
    _operator_args(pshow)
    add_json_arg(pshow)
    pshow.set_defaults(func=cmd_profiles_show)
    pdiff = profiles_sub.add_parser("diff", help="two versions of a board's profile, field by field",
                                    description="Fields that differ between versions A and B, with the relative "
                                                "change (B - A) / |A| for numbers.", epilog=OPERATOR_EPILOG)
    pdiff.add_argument("agent", metavar="AGENT")
    pdiff.add_argument("a", type=positive_int, metavar="A")
    pdiff.add_argument("b", type=positive_int, metavar="B")
    _operator_args(pdiff)
    add_json_arg(pdiff)
    pdiff.set_defaults(func=cmd_profiles_diff)

    from host.fleet.limits import CALIBRATION_BATCH_SIZE as DEFAULT_BATCH_SIZE
    from host.fleet.limits import CALIBRATION_MODELS as DEFAULT_MODELS
    from host.fleet.limits import CALIBRATION_STEPS as DEFAULT_STEPS

    calibrate = sub.add_parser(
        "calibrate", help="fit a board's profile to its own measurements (a new profile version)",
        description="The coordinator runs, on the board: a PROFILE job (its micro-benchmarks: profile version k), "
                    "then short TRAIN runs of calibration models on random samples made on the board, each under "
                    "three schedules solved on version k: keep-all (100% of the no-remat peak), remat-heavy "
                    "(recomputation only) and paging-heavy (paging only), the last two at the first of 50%, 65% "
                    "and 80% of the peak the model fits in. It fits version k to the even steps of the runs, "
                    "reports the step-time (and, where a meter measured, energy) MAPE before and after on the odd "
                    "steps from 3, which the fit did not see, and stores the fit as version k+1 with its "
                    "provenance. The next runs on that board are solved on it. The calibration belongs to the "
                    "coordinator: it goes on if this command exits.",
        epilog=f"Exit codes: 0 stored; 2 bad input, the coordinator refused or the calibration failed (one line says "
               f"why); 130/143 interrupted (the calibration goes on). The coordinator and bundle come from "
               f"--coordinator/--certs or ${COORDINATOR_ENV}/${CERTS_ENV}.")
    calibrate.add_argument("--agent", required=True, metavar="NAME", help="the board (see `poet fleet list`)")
    calibrate.add_argument("--models", metavar="A,B",
                           help=f"calibration models, zoo names (see `poet models`) (default: {','.join(DEFAULT_MODELS)})")
    calibrate.add_argument("--steps", type=positive_int, metavar="N",
                           help=f"steps per calibration run, >= 4 (default {DEFAULT_STEPS})")
    calibrate.add_argument("--batch-size", type=positive_int, metavar="B",
                           help=f"batch size of the calibration runs (default {DEFAULT_BATCH_SIZE})")
    calibrate.add_argument("--wait", action="store_true", help="show what the calibration is doing on stderr")
    calibrate.add_argument("--detach", action="store_true",
                           help="return once the calibration started (its id); `poet profiles list` shows the result")
    _operator_args(calibrate)
    add_json_arg(calibrate)
    calibrate.set_defaults(func=cmd_calibrate)
