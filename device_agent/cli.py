"""The `poet-agent` command (device side): one subcommand group per concern.

``run`` is the fleet agent (device_agent/agent/client.py); ``datasets`` manages the board's local
training data; ``bridge`` (the serial bridge) joins as its own group. Exit codes: 0 done (``run``:
stopped by SIGTERM), 1 internal error, 2 bad input, 3 (``run``) refused by the coordinator, 130 SIGINT.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2

DATASETS_EPILOG = """\
dataset format: DATA_DIR/NAME/ holds .npz shards, each with arrays x (samples, features...; float
or integer dtype, finite) and y (samples,; integer class labels or float targets), written with
numpy.savez(path, x=x, y=y). Shards named heldout*.npz form the optional held-out split; every
other .npz is training data. Files starting with '.' and non-.npz files are ignored. Shards are
never unpickled. NAME: letters, digits, '.', '_', '-' (at most 64).
"""


def _add_datasets(sub) -> None:
    datasets = sub.add_parser(
        "datasets", help="local training data (it never leaves the board)", epilog=DATASETS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = datasets.add_subparsers(dest="action", required=True)
    demo = actions.add_parser(
        "make-demo",
        help="write one board's class-skewed shard of scikit-learn's bundled digits set",
        description="Write DATA_DIR/NAME/ (train.npz, heldout.npz, source.json): shard I of N of scikit-learn's "
        "digits (no download), skewed toward classes c with c %% N == I-1, with a held-out fifth from the same "
        "distribution; x float32 in [0, 1] (64 features), y int64. Needs scikit-learn: "
        "pip install 'poet-edge[demo]'.",
        epilog=DATASETS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--data-dir", required=True, help="the agent's data dir (created if missing)")
    demo.add_argument("--name", default="digits", help="dataset name (default: digits)")
    demo.add_argument("--shard", default="1/1", metavar="I/N", help="this board's shard, counted from 1 (default: 1/1)")
    demo.add_argument("--seed", type=int, default=0, help="split seed; shards of one seed are disjoint (default: 0)")
    demo.add_argument("--force", action="store_true", help="replace an existing dataset of that name")
    listing = actions.add_parser(
        "list", help="print each dataset: name, shards, samples, held-out samples",
        epilog=DATASETS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    listing.add_argument("--data-dir", required=True, help="the agent's data dir")
    listing.add_argument("--json", action="store_true", help="print one JSON object with a `datasets` list")


def _run_datasets(args) -> int:
    from device_agent.agent.datasets import DatasetError, DatasetSummary, list_datasets

    if args.action == "make-demo":
        from device_agent.agent.demo_data import make_demo, parse_shard

        dataset = make_demo(args.data_dir, args.name, parse_shard(args.shard), args.seed, args.force)
        print(f"wrote {dataset.path}: {len(dataset)} training samples, {dataset.heldout_samples} held out "
              f"(shard {args.shard}, seed {args.seed})")
        return EXIT_OK
    found = list_datasets(args.data_dir)
    invalid = [(name, error) for name, error in found if isinstance(error, DatasetError)]
    summaries = [s for _, s in found if isinstance(s, DatasetSummary)]
    if args.json:
        print(json.dumps({
            "datasets": [asdict(s) | {"valid": True} for s in summaries]
            + [{"name": name, "valid": False, "error": str(error)} for name, error in invalid],
        }, indent=2))
    else:
        rows = [("NAME", "SHARDS", "SAMPLES", "HELDOUT_SAMPLES")]
        rows += [(s.name, str(s.shards), str(s.samples), str(s.heldout_samples)) for s in summaries]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if not summaries and not invalid:
            print(f"(no datasets in {args.data_dir})")
    for name, error in invalid:
        print(f"poet-agent: dataset {name} is unusable: {error}", file=sys.stderr)
    return EXIT_USAGE if invalid else EXIT_OK


RUN_EPILOG = """\
exit codes: 0 stopped by SIGTERM (a running job is cancelled after its checkpoint and resumes when the
agent starts again), 1 internal error, 2 bad flags, directories or certificate bundle, 3 refused by the
coordinator (PERMISSION_DENIED: this node was removed or its certificate is not accepted; not retried),
130 stopped by SIGINT. Unreachable coordinators, broken connections and TLS handshake failures are
retried forever with exponential backoff and full jitter (1 s doubling to --max-backoff-s), each retry
logged. Every event is one line on stderr: [agent NAME] ...; "registered with HOST:PORT" follows each
successful registration. State (STATE_DIR): models/<sha256>.pt2 (verified model archives),
runs/<run_id>/ (telemetry.db, the run's durable telemetry; result.pb, a result waiting to be reported;
the job's checkpoints).
"""


def _default_max_backoff_s() -> float:
    """``POET_AGENT_MAX_BACKOFF_S`` (tests shorten the backoff with it), else 20 s."""
    try:
        return float(os.environ.get("POET_AGENT_MAX_BACKOFF_S") or 20.0)
    except ValueError:
        return 20.0


def _add_run(sub) -> None:
    run = sub.add_parser(
        "run", help="run the fleet agent: register with the coordinator, pull jobs, train, stream telemetry",
        description="Dial the coordinator over mutual TLS, register this board, and run the jobs it hands out "
        "until stopped. The agent only dials out.", epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the coordinator's address")
    run.add_argument("--certs", required=True, metavar="BUNDLE_DIR",
                     help="this node's bundle (ca.pem, cert.pem, key.pem) from `poet certs issue --node NAME`")
    run.add_argument("--flash-dir", required=True, help="where training pages activations out (created if missing)")
    run.add_argument("--data-dir", required=True, help="the board's datasets (see `poet-agent datasets`)")
    run.add_argument("--state-dir", required=True,
                     help="models, telemetry buffers, pending results, checkpoints (created if missing)")
    run.add_argument("--platform", default="local", help="the profile name this board runs as (default: local)")
    run.add_argument("--memory-limit", metavar="BYTES",
                     help="RAM this agent may use: bytes or 512M, 2G, 512MiB, 1.5GB; the smaller of this and the "
                     "cgroup's memory.max is reported")
    run.add_argument("--max-backoff-s", type=float, default=_default_max_backoff_s(), metavar="S",
                     help="longest pause between reconnection attempts (default: 20, or POET_AGENT_MAX_BACKOFF_S)")
    run.add_argument("--threads", type=int, metavar="N",
                     help="torch threads for training and the PROFILE job's measurements (default: the cores this "
                     "agent may use minus one, at least 1, so the agent's own threads and whatever shares the board "
                     "never stall training; torch's own choice where OMP_NUM_THREADS is set)")


_TARGET = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9._-]+)):(?P<port>[0-9]{1,5})")


def _check_target(target: str) -> str:
    match = _TARGET.fullmatch(target or "")
    if not match or not 0 < int(match.group("port")) < 65536:
        raise ValueError(f"--coordinator {target!r} is not HOST:PORT (e.g. coordinator.lan:50051, 10.0.0.5:50051 "
                         "or [fd00::5]:50051)")
    return target


def _check_dir(flag: str, path: str, *, create: bool) -> Path:
    directory = Path(path)
    if create:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"{flag} {path}: cannot create it ({exc.strerror or exc})") from None
    if not directory.is_dir():
        hint = " (make a dataset with `poet-agent datasets make-demo --data-dir DIR`)" if flag == "--data-dir" else ""
        raise ValueError(f"{flag} {path} does not exist or is not a directory{hint}")
    if create:
        try:
            fd, name = tempfile.mkstemp(prefix=".poet-agent-write-check.", dir=directory)
            os.close(fd)
            os.unlink(name)
        except OSError as exc:
            raise ValueError(f"{flag} {path} is not writable by this user ({exc.strerror or exc})") from None
    return directory


def _run_agent(args) -> int:
    # gRPC's C core logs (e.g. every failed handshake at INFO) would interleave with the agent's own lines.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from device_agent.agent.client import EXIT_INTERRUPTED, EXIT_OK, Agent, AgentConfig
    from device_agent.agent.credentials import CertError, load_bundle
    from device_agent.agent.facts import default_training_threads, parse_bytes

    try:
        _check_target(args.coordinator)
        load_bundle(args.certs)
        if not (args.max_backoff_s > 0) or args.max_backoff_s == float("inf"):
            raise ValueError(f"--max-backoff-s must be a positive number of seconds, not {args.max_backoff_s}")
        memory_limit = parse_bytes(args.memory_limit) if args.memory_limit is not None else None
        if args.threads is not None and not 1 <= args.threads <= 1024:
            raise ValueError(f"--threads must be between 1 and 1024, not {args.threads}")
        threads = args.threads if args.threads is not None else default_training_threads()
        config = AgentConfig(
            coordinator=args.coordinator, certs=Path(args.certs),
            flash_dir=_check_dir("--flash-dir", args.flash_dir, create=True),
            data_dir=_check_dir("--data-dir", args.data_dir, create=False),
            state_dir=_check_dir("--state-dir", args.state_dir, create=True),
            platform=args.platform, memory_limit_bytes=memory_limit, max_backoff_s=args.max_backoff_s,
            training_threads=threads)
    except (ValueError, CertError) as exc:
        print(f"poet-agent run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    agent = Agent(config)
    signal.signal(signal.SIGTERM, lambda *_: agent.request_stop(EXIT_OK))
    signal.signal(signal.SIGINT, lambda *_: agent.request_stop(EXIT_INTERRUPTED))
    return agent.run()


def _add_bridge(sub) -> None:
    bridge = sub.add_parser(
        "bridge", help="present a microcontroller on a serial line to the coordinator as an agent",
        description="Connect to poet-edge firmware over a serial line (a port such as /dev/ttyACM0, or QEMU's "
        "socket://127.0.0.1:PORT), register it with the coordinator (its activation arena, flash and platform), "
        "and run its jobs on it: weights, the schedule and each step's batch go to the board (batches from "
        "--data-dir, which never leaves this machine), its telemetry goes to the coordinator. Runs until "
        "SIGTERM / Ctrl-C. Exit codes: 0 stopped, 1 internal error, 2 bad arguments or no board, 3 refused by the "
        "coordinator.",
    )
    bridge.add_argument("--serial", required=True, metavar="URL",
                        help="the board's serial line: a device (/dev/ttyACM0) or a pyserial URL (socket://HOST:PORT)")
    bridge.add_argument("--baud", type=int, default=115200, help="baud rate of a real port (default: 115200)")
    bridge.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the coordinator's address")
    bridge.add_argument("--certs", required=True, metavar="BUNDLE_DIR",
                        help="this board's certificate bundle (ca.pem, cert.pem, key.pem from `poet certs`)")
    bridge.add_argument("--data-dir", required=True, help="the board's datasets (see `poet-agent datasets`)")
    bridge.add_argument("--state-dir", required=True,
                        help="telemetry buffer, model archives and results (created if missing)")
    bridge.add_argument("--board", metavar="NAME",
                        help="the board expected on the line, e.g. mps2-an386 (default: whatever answers)")
    bridge.add_argument("--platform", default="m4",
                        help="the profile the board is priced on (default: m4, a Cortex-M4F)")
    bridge.add_argument("--connect-timeout-s", type=float, default=30.0, metavar="S",
                        help="how long to wait for the board to answer (default: 30)")
    bridge.add_argument("--max-backoff-s", type=float, default=_default_max_backoff_s(), metavar="S",
                        help="cap of the reconnect backoff to the coordinator")


def _run_bridge(args) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from device_agent.agent.client import EXIT_INTERRUPTED, Agent, AgentConfig
    from device_agent.agent.credentials import CertError, load_bundle
    from device_agent.serial_bridge.board import McuBoard, McuBoardError, McuProtocolError
    from device_agent.serial_bridge.bridge import McuJobRunner, board_facts
    from device_agent.serial_bridge.link import DEFAULT_ACK_TIMEOUT_S, Link, LinkError

    try:
        _check_target(args.coordinator)
        load_bundle(args.certs)
        if not (args.connect_timeout_s > 0) or args.connect_timeout_s == float("inf"):
            raise ValueError(f"--connect-timeout-s must be a positive number of seconds, not {args.connect_timeout_s}")
        if not (args.max_backoff_s > 0) or args.max_backoff_s == float("inf"):
            raise ValueError(f"--max-backoff-s must be a positive number of seconds, not {args.max_backoff_s}")
        if args.baud <= 0:
            raise ValueError(f"--baud must be a positive number, not {args.baud}")
        if "://" not in args.serial and not os.path.exists(args.serial):
            raise ValueError(f"no serial device {args.serial}: plug the board in, or give its port (e.g. "
                             "/dev/ttyACM0) or a pyserial URL (socket://HOST:PORT for QEMU)")
        data_dir = _check_dir("--data-dir", args.data_dir, create=False)
        state_dir = _check_dir("--state-dir", args.state_dir, create=True)
    except (ValueError, CertError) as exc:
        print(f"poet-agent bridge: {exc}", file=sys.stderr)
        return EXIT_USAGE

    def connect(max_retries: int | None = None):
        """A fresh session with the board: (McuBoard, McuBoardInfo); the caller closes ``board.link``."""
        options = {} if max_retries is None else {"max_retries": max_retries}
        link = Link.connect(args.serial, baudrate=args.baud, **options)
        try:
            board = McuBoard(link)
            info = board.hello()
            if args.board and info.board != args.board:
                raise ValueError(f"the board on {args.serial} is {info.board!r}, not {args.board!r} (--board); "
                                 "check the port, or drop --board to take whatever answers")
        except BaseException:
            link.close()
            raise
        return board, info

    deadline = time.monotonic() + args.connect_timeout_s
    while True:
        # each hello gives up by the deadline: its resends are spread over what is left of the wait
        remaining_s = deadline - time.monotonic()
        try:
            board, info = connect(max_retries=max(1, int(remaining_s / DEFAULT_ACK_TIMEOUT_S)))
            board.link.close()
            break
        except (ValueError, McuBoardError, McuProtocolError) as exc:
            print(f"poet-agent bridge: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except (LinkError, OSError) as exc:
            if time.monotonic() + 0.5 > deadline:
                reason = re.split(r"[:;] check ", " ".join(str(exc).split()))[0]  # the advice follows
                print(f"poet-agent bridge: no poet-edge firmware answered on {args.serial} within "
                      f"{args.connect_timeout_s:g} s ({reason}); check the port, the baud rate and that the board "
                      "runs the firmware (device_agent/firmware/cortex_m)", file=sys.stderr)
                return EXIT_USAGE
            time.sleep(0.5)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
    config = AgentConfig(coordinator=args.coordinator, certs=Path(args.certs), flash_dir=state_dir,
                         data_dir=data_dir, state_dir=state_dir, platform=args.platform,
                         max_backoff_s=args.max_backoff_s)
    agent: Agent | None = None
    runner = McuJobRunner(connect, data_dir=data_dir, state_dir=state_dir, platform=args.platform,
                          log=lambda message: agent.log(message), reconnect_timeout_s=args.connect_timeout_s)
    runner.session_id = int(info.session_id)
    agent = Agent(config, runner=runner, facts=board_facts(info, platform=args.platform))
    agent.log(f"bridging {info.board} on {args.serial}: arena {info.arena_bytes} bytes, flash {info.flash_bytes} "
              f"bytes, session {info.session_id:#010x}{' (emulated)' if info.emulated else ''}")
    signal.signal(signal.SIGTERM, lambda *_: agent.request_stop(EXIT_OK))
    signal.signal(signal.SIGINT, lambda *_: agent.request_stop(EXIT_INTERRUPTED))
    return agent.run()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="poet-agent", description="poet-edge device agent",
        epilog="exit codes: 0 done, 1 internal error, 2 bad input or unusable data (`run` adds 3: refused by "
        "the coordinator; see `poet-agent run --help`)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the agent version")
    _add_run(sub)
    _add_bridge(sub)
    _add_datasets(sub)
    _add_meters(sub)
    return parser


def _add_meters(sub) -> None:
    meters = sub.add_parser(
        "meters", help="list the board's energy meters, best first, with one reading each",
        description="Detect the energy meters (device_agent/meters/registry.py), best first, and print one reading "
        "of each: power_w (instantaneous power) for the power meters, energy_j (the counter, cumulative) for RAPL. "
        "vcgencmd is looked for on PATH. With none, energy is modelled (the fallback).",
    )
    meters.add_argument("--sysfs-root", default="/", metavar="DIR",
                        help="read DIR/sys instead of /sys (a fixture tree; default: /)")
    meters.add_argument("--json", action="store_true",
                        help='print one JSON object: {"meters": [{"name", "label", "detail", "power_w" or "energy_j"}], '
                        '"fallback"}')


def _run_meters(args) -> int:
    from device_agent.meters.modelled import SOURCE as MODELLED_SOURCE
    from device_agent.meters.registry import detect_meters

    rows = []
    for meter in detect_meters(args.sysfs_root, start_thread=False):
        row = {"name": meter.name, "label": meter.source, "detail": meter.detail}
        try:
            row.update(meter.reading_now())
        except Exception as exc:  # noqa: BLE001  (a meter that fails now is reported, not fatal)
            row["error"] = f"{type(exc).__name__}: {exc}"
        meter.close()
        rows.append(row)
    if args.json:
        print(json.dumps({"meters": rows, "fallback": MODELLED_SOURCE}))
        return EXIT_OK
    if not rows:
        print(f"no energy meter found under {args.sysfs_root}: energy is {MODELLED_SOURCE}")
        return EXIT_OK
    print(f"{'name':<10} {'label':<18} {'reading':>14}  detail")
    for row in rows:
        if "power_w" in row:
            reading = f"{row['power_w']:.3f} W"
        elif "energy_j" in row:
            reading = f"{row['energy_j']:.3f} J"
        else:
            reading = row["error"]
        print(f"{row['name']:<10} {row['label']:<18} {reading:>14}  {row['detail']}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "version":
        from importlib.metadata import version

        print(f"poet-agent {version('poet-edge')}")
        return EXIT_OK
    if args.command == "run":
        return _run_agent(args)
    if args.command == "bridge":
        return _run_bridge(args)
    if args.command == "meters":
        return _run_meters(args)
    from device_agent.agent.datasets import DatasetError

    try:
        return _run_datasets(args)
    except DatasetError as exc:
        print(f"poet-agent: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
