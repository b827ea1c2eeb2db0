"""`poet mcu run`: train on Cortex-M firmware (QEMU's mps2-an386, or a board on a serial line) and compare."""

from __future__ import annotations

import argparse

from host.cli.common import (
    EXIT_OK,
    EXIT_VERIFY_FAILED,
    RAM_BUDGET_HELP,
    CliError,
    Console,
    add_ablation_args,
    add_json_arg,
    learning_rate,
    positive_int,
    ram_budget,
    runtime_factor,
    seconds,
    seed_int,
)


def _share(text: str) -> float:
    try:
        value = float(text.rstrip("%")) / (100.0 if text.endswith("%") else 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share (0.01 or 1%)") from None
    if not 0 <= value < 0.5:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share of the bytes in [0, 0.5) (e.g. 0.01 or 1%)")
    return value


def _momentum(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"momentum {text} is not in [0, 1)")
    return value


def cmd_mcu_run(args, console: Console) -> int:
    from host.mcu.run import run_mcu

    if not args.qemu and not args.serial:
        raise CliError("say where the board is: --qemu (boot the firmware on QEMU's mps2-an386) or --serial URL")
    report = run_mcu(args.model, steps=args.steps, ram_budget=args.ram_budget, batch_size=args.batch_size,
                     learning_rate=args.lr, momentum=args.momentum, runtime_budget=args.runtime_budget,
                     link_corrupt=args.link_corrupt, seed=args.seed, serial=None if args.qemu else args.serial,
                     work_dir=args.work_dir, time_limit_s=args.time_limit, paging=not args.no_paging,
                     remat=not args.no_remat, log=console.log)
    if args.json:
        console.print_json(report.to_json())
    else:
        c = report
        console.print(f"{c.model} on {c.board}{' (emulated)' if c.emulated else ''}, batch {c.batch_size}, "
                      f"{c.steps} steps")
        console.print(f"  RAM budget        {c.ram_budget_bytes:.0f} bytes of a {c.arena_bytes}-byte arena; "
                      f"high-water {c.arena_high_water_bytes} bytes")
        console.print(f"  per step          planned {c.planned.computes} computes, {c.planned.page_ins} page-ins, "
                      f"{c.planned.page_outs} page-outs; executed {c.executed.computes}, {c.executed.page_ins}, "
                      f"{c.executed.page_outs}")
        console.print(f"  parameters        max relative difference from PyTorch {c.max_rel_param_diff:.3g} "
                      f"(tolerance {c.tolerance:g})")
        console.print(f"  losses            {', '.join(f'{loss:.4f}' for loss in c.losses)}")
        console.print(f"  link              {c.frames_sent} frames sent, {c.frames_retransmitted} retransmitted, "
                      f"{c.crc_errors} CRC errors; {c.link['payload_bytes']} payload bytes in {c.link['seconds']} s")
        for problem in c.problems:
            console.print(f"  PROBLEM           {problem}")
        console.print("ok" if c.ok else "FAILED")
    return EXIT_OK if report.ok else EXIT_VERIFY_FAILED


def register(sub: argparse._SubParsersAction) -> None:
    mcu = sub.add_parser("mcu", help="train on Cortex-M firmware (QEMU or a serial board) and compare with PyTorch",
                         description="Microcontrollers: the Cortex-M firmware (device_agent/firmware/cortex_m).")
    mcu_sub = mcu.add_subparsers(dest="mcu_command", required=True, metavar="SUBCOMMAND")
    run = mcu_sub.add_parser(
        "run", help="build the firmware, boot it, solve for the board, train, compare with PyTorch",
        description="One shot: build the firmware if needed, boot it on QEMU's mps2-an386 (--qemu) or use a board "
                    "on a serial line (--serial), package the model as the coordinator does, solve its schedule for "
                    "the board (platform m4, within its activation arena), send the weights, the schedule and each "
                    "step's batch (seeded random samples of the model's shape), and compare the board's parameters "
                    "with plain PyTorch training of the same program on the same batches.",
        epilog="exit codes: 0 the board trained as PyTorch within the tolerance, 2 bad input (a model the firmware "
               "cannot train, a budget beyond the arena, a missing toolchain), 5 the parameters, counters or "
               "high-water mark disagree, 1 internal error")
    where = run.add_mutually_exclusive_group()
    where.add_argument("--qemu", action="store_true", help="boot the firmware on QEMU's mps2-an386 (Cortex-M4)")
    where.add_argument("--serial", metavar="URL", help="a board running the firmware: /dev/ttyACM0 or socket://H:P")
    run.add_argument("--model", default="mlp",
                     help="a zoo name or package.module:factory of an nn.Sequential of nn.Linear and nn.ReLU with a "
                          "cross-entropy loss (default: mlp)")
    run.add_argument("--steps", type=positive_int, default=3, metavar="N", help="training steps, >= 1 (default 3)")
    run.add_argument("--ram-budget", type=ram_budget, required=True, metavar="BUDGET",
                     help="RAM for the activations, within the board's arena: " + RAM_BUDGET_HELP)
    run.add_argument("--batch-size", type=positive_int, metavar="N", help="batch size (default: the model's)")
    run.add_argument("--lr", type=learning_rate, default=0.05, help="SGD learning rate (default 0.05)")
    run.add_argument("--momentum", type=_momentum, default=0.9, help="SGD momentum, in [0, 1) (default 0.9)")
    run.add_argument("--runtime-budget", type=runtime_factor, default=2.0, metavar="FACTOR",
                     help="allowed runtime as a factor of plain training's on the m4 profile (default 2.0)")
    run.add_argument("--time-limit", type=seconds, default=60.0, metavar="SECONDS",
                     help="solver time limit (default 60 s)")
    run.add_argument("--link-corrupt", type=_share, default=0.0, metavar="P",
                     help="put a fault-injecting proxy on the link that corrupts a share P of the bytes (0.01 or "
                          "1%%) and drops a tenth as many; QEMU only (default 0)")
    run.add_argument("--seed", type=seed_int, default=0, help="seed of the batches and of the proxy (default 0)")
    run.add_argument("--work-dir", metavar="DIR",
                     help="keep the packaged model, the flash file and QEMU's log here (default: a temporary dir)")
    add_ablation_args(run)
    add_json_arg(run)
    run.set_defaults(func=cmd_mcu_run)
