"""The fleet demo (`make demo`): a coordinator and two boards on loopback fine-tune one model each on its own data.

Run: ``python -m host.fleet.demo --dir DIR``. Every step is a real command a user would type:

1. ``poet certs init`` and ``poet certs issue`` for two boards and an operator;
2. ``poet-agent datasets make-demo`` writes each board its own class-skewed shard of scikit-learn's digits;
3. ``poet serve`` on 127.0.0.1 (a free port), then ``poet-agent run`` for board-a (no memory limit) and
   board-b, whose ``--memory-limit`` is too small for plain training of the demo model (its auto budget
   lands at about half the model's no-remat peak, so it gets a schedule that pages);
4. ``poet run --model digits_mlp --ram-budget auto --all --wait`` trains both and prints the table;
5. ``poet calibrate --agent board-b`` fits board-b's profile to its telemetry (a new profile version), and a
   second run on board-b is solved and predicted on it: its predicted step time is printed beside the measured;
6. everything stops with SIGTERM, and each process must exit 0.

The memory limit is given with ``--memory-limit`` (the board's declared limit, which the auto budget uses)
rather than a memory cgroup, which this demo does not assume it may create.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

MODEL = "digits_mlp"
DATASET = "digits"
OPTIMIZER = "adamw"
CALIBRATED_STEPS = 20  # the run after calibration: enough steps for a median step time
BOARDS = ("board-a", "board-b")
OPERATOR = "operator"
BOARD_B_SHARE_OF_PEAK = 0.5  # board-b's auto budget aims at this share of the no-remat peak
STARTUP_TIMEOUT_S = 120.0
SOLVE_TIME_LIMIT_S = 20  # per schedule: the demo stays within about 3 minutes even when a solve does not close


def console_script(name: str) -> str:
    """The console script beside this interpreter (the venv's), else the one on PATH."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


class Process:
    """A long-running command whose stderr is echoed with a prefix and watched for a line."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str], echo: bool = True) -> None:
        self.label = label
        self.echo = echo
        self.lines: list[str] = []
        self._seen = threading.Condition()
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            if self.echo:
                print(f"  {self.label:<11}| {line}", file=sys.stderr, flush=True)
            with self._seen:
                self.lines.append(line)
                self._seen.notify_all()

    def wait_for(self, text: str, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        with self._seen:
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                if self.proc.poll() is not None:
                    raise SystemExit(f"{self.label} exited with {self.proc.returncode} before printing {text!r}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SystemExit(f"{self.label} did not print {text!r} within {timeout_s:.0f} s")
                self._seen.wait(min(remaining, 0.5))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def run_command(argv: list[str], env: dict[str, str] | None = None, capture: bool = False) -> str:
    print("$ " + " ".join(Path(argv[0]).name if i == 0 else a for i, a in enumerate(argv)), file=sys.stderr,
          flush=True)
    done = subprocess.run(argv, env=env, check=True, text=True,
                          stdout=subprocess.PIPE if capture else None)
    return done.stdout or ""


def _model_figures() -> tuple[int, int]:
    """(fixed bytes with the demo's optimizer, no-remat peak bytes) of the demo model, as the coordinator counts them."""
    from host.costs import load_profile, price_graph
    from host.fleet.service import fixed_bytes
    from host.graph.resolve import resolve_model
    from host.solver.solve import no_remat_peak_bytes

    graph = resolve_model(MODEL).graph
    return fixed_bytes(graph, OPTIMIZER), no_remat_peak_bytes(price_graph(graph, load_profile("a72")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m host.fleet.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="working directory (replaced): certificates, boards, state")
    parser.add_argument("--steps", type=int, default=60, help="training steps per board (default 60)")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    certs = root / "certs"
    env = dict(os.environ, OMP_NUM_THREADS="1", POET_AGENT_MAX_BACKOFF_S="2")
    poet, agent = console_script("poet"), console_script("poet-agent")
    started = time.monotonic()

    print("== certificates", file=sys.stderr)
    run_command([poet, "certs", "init", "--dir", str(certs)], env)
    for board in BOARDS:
        run_command([poet, "certs", "issue", "--dir", str(certs), "--node", board], env)
    run_command([poet, "certs", "issue", "--dir", str(certs), "--operator", OPERATOR], env)

    print("== each board's own data (never sent anywhere)", file=sys.stderr)
    for index, board in enumerate(BOARDS, start=1):
        for sub in ("flash", "data", "state"):
            (root / board / sub).mkdir(parents=True)
        run_command([agent, "datasets", "make-demo", "--data-dir", str(root / board / "data"), "--name", DATASET,
              "--shard", f"{index}/{len(BOARDS)}", "--seed", "0"], env)

    processes: list[Process] = []
    exit_codes: dict[str, int] = {}
    try:
        print("== coordinator", file=sys.stderr)
        server = Process("coordinator", [poet, "serve", "--listen", "127.0.0.1:0", "--certs", str(certs),
                                          "--state-dir", str(root / "coordinator"),
                                          "--solve-time-limit", str(SOLVE_TIME_LIMIT_S)], env)
        processes.append(server)
        address = server.wait_for("listening on").split("listening on", 1)[1].strip()
        operator_env = dict(env, POET_COORDINATOR=address, POET_CERTS=str(certs / OPERATOR))

        def start_agent(board: str, extra: list[str]) -> Process:
            process = Process(board, [agent, "run", "--coordinator", address, "--certs", str(certs / board),
                                       "--flash-dir", str(root / board / "flash"),
                                       "--data-dir", str(root / board / "data"),
                                       "--state-dir", str(root / board / "state"), *extra], env)
            processes.append(process)
            process.wait_for("registered with")
            return process

        print("== board-a (no memory limit)", file=sys.stderr)
        start_agent(BOARDS[0], [])
        agents = json.loads(run_command([poet, "fleet", "list", "--json"], operator_env, capture=True))["agents"]
        runtime_rss = next(a for a in agents if a["name"] == BOARDS[0])["runtime_rss_bytes"]
        from host.fleet.limits import AUTO_MARGIN_BYTES

        fixed, peak = _model_figures()
        limit = int(runtime_rss + fixed + AUTO_MARGIN_BYTES + BOARD_B_SHARE_OF_PEAK * peak)
        print(f"== board-b: --memory-limit {limit} bytes = board-a's torch runtime {runtime_rss} + the model's fixed "
              f"{fixed} + margin {AUTO_MARGIN_BYTES} + {BOARD_B_SHARE_OF_PEAK:.0%} of its no-remat peak {peak}: "
              "too small for plain training", file=sys.stderr)
        start_agent(BOARDS[1], ["--memory-limit", str(limit)])

        print("== fine-tune on both boards, each on its own budget and data", file=sys.stderr)
        run_command([poet, "fleet", "list"], operator_env)
        run_command([poet, "run", "--model", MODEL, "--dataset", DATASET, "--steps", str(args.steps), "--ram-budget",
              "auto", "--all", "--optimizer", OPTIMIZER, "--wait"], operator_env)

        print("== calibration: board-b measures itself, its profile is fitted to its telemetry (a new version), "
              "and the next run is priced on it", file=sys.stderr)
        run_command([poet, "calibrate", "--agent", BOARDS[1], "--models", MODEL, "--batch-size", "512", "--wait"],
             operator_env)
        run_command([poet, "profiles", "list", "--agent", BOARDS[1]], operator_env)
        run_command([poet, "run", "--model", MODEL, "--dataset", DATASET, "--steps", str(CALIBRATED_STEPS), "--ram-budget",
              "auto", "--agents", BOARDS[1], "--optimizer", OPTIMIZER, "--wait"], operator_env)
    finally:
        for process in reversed(processes):
            exit_codes[process.label] = process.stop()
    print(f"== stopped: {', '.join(f'{k} exit {v}' for k, v in exit_codes.items())}; "
          f"{time.monotonic() - started:.0f} s in all", file=sys.stderr)
    return 0 if all(code == 0 for code in exit_codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
