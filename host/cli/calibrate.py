"""`poet calibrate`: fit a board's profile to its own measurements, on the coordinator."""

from __future__ import annotations

import argparse
import json
import time

from host.cli.common import (
    EXIT_OK,
    CliError,
    Console,
    add_json_arg,
    positive_int,
)
from host.cli.operator import (
    POLL_INTERVAL_S,
    num,
    operator_args,
    with_operator,
)
from host.fleet.client import CERTS_ENV, COORDINATOR_ENV, OperatorClient


# ------------------------------------------------------------------------------------------ calibrate
@with_operator
def cmd_calibrate(args, console: Console, op: OperatorClient) -> int:

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
    console.print(f"{'first run':<18} {'runs':>4} {'model':<16} {'schedule':<20} {'status':<8} {'p-out':>5} "
                  f"{'recomp':>6} {'MAPE before->after':>20}")
    for run in report["runs"]:
        mape = (f"{run['step_mape_before']:.1f}% -> {run['step_mape_after']:.1f}%"
                if run.get("step_mape_before") is not None else "-")
        console.print(f"{run['run_id']:<18} {len(run.get('run_ids') or [run['run_id']]):>4} {run['model']:<16} "
                      f"{run['schedule']:<20} {run['status']:<8} "
                      f"{num(run.get('page_outs'), 'd'):>5} {num(run.get('recomputes'), 'd'):>6} {mape:>20}")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:

    from host.fleet.limits import CALIBRATION_BATCH_SIZE as DEFAULT_BATCH_SIZE
    from host.fleet.limits import CALIBRATION_MODELS as DEFAULT_MODELS
    from host.fleet.limits import CALIBRATION_REPEATS
    from host.fleet.limits import CALIBRATION_STEPS as DEFAULT_STEPS

    calibrate = sub.add_parser(
        "calibrate", help="fit a board's profile to its own measurements (a new profile version)",
        description="The coordinator runs, on the board: a PROFILE job (its micro-benchmarks: profile version k), "
                    "then short TRAIN runs of calibration models on random samples made on the board, each under "
                    "three schedules solved on version k: keep-all (100% of the no-remat peak), remat-heavy "
                    "(recomputation only) and paging-heavy (paging only), the last two at the first of 50%, 65% "
                    f"and 80% of the peak the model fits in; each schedule runs {CALIBRATION_REPEATS} times, in rounds. "
                    "It fits "
                    "version k to the even steps of the runs, reports the step-time (and, where a meter measured, energy) MAPE before and after on the odd "
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
    operator_args(calibrate)
    add_json_arg(calibrate)
    calibrate.set_defaults(func=cmd_calibrate)
