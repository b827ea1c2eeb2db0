"""Fleet telemetry benchmark: N simulated agents stream telemetry to one real coordinator. Prints a table.

What is real: ``poet serve`` (a subprocess, its SQLite run store, its thread pool), mutual TLS with one
node certificate per agent (identity is the certificate's CN, so certificates cannot be shared), one
gRPC channel per agent (``device_agent.agent.client.channel_options``), the agent's durable telemetry
buffer (``TelemetrySink``, one state dir per agent, SQLite with ``synchronous=FULL``) and its sender
(``TelemetrySender``: batching, window, acknowledgements, resends). What is simulated: the job. The
bench registers the agents and creates one running run per agent directly in the store before the
coordinator starts (no PullJob, no model, no training), then each agent emits RSS-sample events with
``emit_many`` at ``--rate-hz`` ticks per second for ``--seconds``, and waits (at most ``--drain-s``)
for every event to be acknowledged.

Agents are split across ``--processes`` worker processes (default: one per core), each running its
agents as threads (an emitter and a sender per agent, plus gRPC's own thread per stream).

Measured:

- ``events_sent``: events the agents emitted (sequenced in their buffers); ``events_on_wire``: events
  the senders put on the wire, resends included (``resent`` = on wire - sent, when all were acked).
- ``events_stored``: rows in the coordinator's ``events`` table after the run (cross-checked against
  the runs' ``events_stored`` counters); ``stored_per_s``: stored / (last ``stored_at_s`` - start).
- ``lost``: sent - stored, counting distinct (run, seq) with seq <= what the agent emitted. Events not
  stored at the end are not gone (they wait, unacknowledged, in the agents' buffers); this is what the
  coordinator had not taken by the end of the drain.
- ``duplicated``: the store's key is (run, seq), so a duplicate row cannot exist; the coordinator drops
  a resent event. Reported as (sum of the runs' events_stored counters) - (distinct stored rows), which
  would show an event counted twice; resends themselves are ``resent``.
- ``ack_p50_s`` / ``ack_p99_s``: per event, from ``emit_many`` returning to the arrival of the first
  acknowledgement covering its seq (``TelemetrySink.apply_ack`` wrapped in the agent's process).
- coordinator CPU seconds and %% of one core, peak RSS (psutil, sampled every 0.25 s, and VmHWM where
  the kernel reports it), over the streaming window (connect to end of drain).

    python bench/fleet.py --agents 64 --rate-hz 10 --seconds 60
    python bench/fleet.py --agents 1000 --rate-hz 1 --seconds 60 --json

The bench never trains: torch is not imported.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

JOB_ID = "bench-fleet"


def agent_name(i: int) -> str:
    return f"bench-{i + 1:04d}"


def run_id_of(i: int) -> str:
    return f"bench-run-{i + 1:04d}"


def raise_nofile() -> tuple[int, int]:
    """Raise the soft open-files limit to the hard one (inherited by the workers and the coordinator)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)


# ---------------------------------------------------------------------------------------------- setup
def prepare(root: Path, agents: int) -> tuple[Path, Path, float]:
    """Certificates (CA, coordinator, one node bundle per agent) and a store with one running run per agent."""
    from host.fleet.certs import init_certs, issue_cert
    from host.fleet.store import RunStore, sqlite_url

    t0 = time.monotonic()
    certs = root / "certs"
    init_certs(certs, [])
    for i in range(agents):
        issue_cert(certs, agent_name(i), "node")
    state = root / "coordinator"
    state.mkdir()
    facts = {"platform": "local", "cpu_count": 1, "meters": ["bench"], "ram_total_bytes": 1 << 30,
             "ram_available_bytes": 1 << 30, "memory_limit_bytes": None, "runtime_rss_bytes": 0}
    store = RunStore(sqlite_url(state))
    try:
        store.create_job(JOB_ID, "train", {"bench": "fleet"})
        for i in range(agents):
            store.register_agent(agent_name(i), "local", facts)
            store.create_run(run_id_of(i), JOB_ID, agent_name(i), "train", status="running")
    finally:
        store.close()
    return certs, state, time.monotonic() - t0


def start_coordinator(certs: Path, state: Path, max_workers: int) -> tuple[subprocess.Popen, str]:
    code = "import sys; from host.cli import main; sys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "serve", "--listen", "127.0.0.1:0", "--certs", str(certs),
         "--state-dir", str(state), "--max-workers", str(max_workers)],
        cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError(f"poet serve exited with {proc.wait()} before listening")
        if line.startswith("listening on "):
            address = line.split("listening on ", 1)[1].strip()
            threading.Thread(target=_drain_pipe, args=(proc.stderr,), daemon=True).start()
            return proc, address
    proc.kill()
    raise RuntimeError("poet serve did not print its listening line within 60 s")


def _drain_pipe(pipe) -> None:
    for _ in pipe:  # keep the coordinator's stderr from filling the pipe; its log is not part of the bench
        pass


class Sampler(threading.Thread):
    """Samples the coordinator's CPU times and RSS."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        import psutil

        self.proc = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak_rss = 0
        self.threads_peak = 0
        self.stop_event = threading.Event()

    def cpu_s(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
                self.threads_peak = max(self.threads_peak, self.proc.num_threads())
            except Exception:  # noqa: BLE001 - the process ended
                return
            self.stop_event.wait(self.interval_s)

    def hwm_bytes(self) -> int | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None


# --------------------------------------------------------------------------------------------- worker
def worker_main(indices: list[int], certs: str, address: str, work_dir: str, rate_hz: float, seconds: float,
                events_per_tick: int, drain_s: float, connect_timeout_s: float, grpc_logs: bool, emit_threads: int, ready_q, start_ev,
                out_q) -> None:
    """Runs the given agents as threads; reports per-agent counts and ack latencies on ``out_q``."""
    raise_nofile()
    if not grpc_logs:  # gRPC core's own log lines (one per GOAWAY, per connection) would bury the table;
        os.environ["GRPC_VERBOSITY"] = "NONE"  # failed calls are counted as stream errors instead
    import grpc

    from device_agent.agent.client import Backoff, channel_options
    from device_agent.agent.credentials import channel_credentials
    from device_agent.agent.telemetry import TelemetrySender, TelemetrySink
    from device_agent.serde import rss_event_to_proto

    class TimedSink(TelemetrySink):
        """The real sink; records when each acknowledgement first covers a seq."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.emit_times: list[float] = []  # index = seq - 1: when emit_many was called for it
            self.ack_times: list[tuple[float, int]] = []  # (arrival, stored_through) each time it rose
            self.acked = 0

        def apply_ack(self, run_id, stream_id, stored_through_seq):
            now = time.monotonic()
            freed = super().apply_ack(run_id, stream_id, stored_through_seq)
            if stored_through_seq > self.acked:
                self.acked = int(stored_through_seq)
                self.ack_times.append((now, self.acked))
            return freed

        def latencies(self) -> list[float]:
            out, seq = [], 0
            for arrival, through in self.ack_times:
                through = min(through, len(self.emit_times))
                out.extend(arrival - self.emit_times[s] for s in range(seq, through))
                seq = max(seq, through)
            return out

    logs: list[str] = []
    log_lock = threading.Lock()

    def quiet_log(message: str) -> None:
        with log_lock:
            if len(logs) < 50:
                logs.append(message)

    class Sim:
        def __init__(self, i: int) -> None:
            self.i = i
            self.run_id = run_id_of(i)
            self.sink = TimedSink(Path(work_dir) / "agents" / agent_name(i), log=quiet_log)
            self.run = self.sink.for_run(self.run_id)
            self.channel = grpc.secure_channel(address, channel_credentials(Path(certs) / agent_name(i)),
                                               options=channel_options())
            self.sender = TelemetrySender(self.channel, self.sink, log=quiet_log)
            self.retries = 0
            self.errors: dict[str, int] = {}
            self.connected = False
            self.emit_errors = 0
            self.ticks_done = 0
            self.offset = 0.0
            self.late: list[float] = []  # how late each tick that missed its time was (the simulator's own lag)
            self.backoff = Backoff(max_s=5.0)

        def wait_retry(self, exc) -> None:
            self.retries += 1
            code = getattr(exc.code(), "name", "ERROR") if hasattr(exc, "code") else "ERROR"
            self.errors[code] = self.errors.get(code, 0) + 1
            self.sender._stop.wait(self.backoff.next_delay())

    sims = [Sim(i) for i in indices]
    # Connect every channel (TLS handshake) before the clock starts.
    t0 = time.monotonic()
    futures = [(s, grpc.channel_ready_future(s.channel)) for s in sims]
    for s, f in futures:
        try:
            f.result(timeout=max(0.1, connect_timeout_s - (time.monotonic() - t0)))
            s.connected = True
        except grpc.FutureTimeoutError:
            pass
    connect_s = time.monotonic() - t0
    senders = [threading.Thread(target=s.sender.run, args=(s.wait_retry,), daemon=True) for s in sims]
    for t in senders:
        t.start()
    ticks = max(1, round(rate_hz * seconds))
    period = 1.0 / rate_hz
    go = threading.Event()
    clock = {}

    stop_after = seconds + max(10.0, 0.5 * seconds)  # a simulator that falls this far behind stops emitting

    def emitter(group: list[Sim]) -> None:
        """Emits the ticks of a group of agents in time order (a small pool, not a thread per agent)."""
        go.wait()
        start = clock["start"]
        for k in range(ticks):
            for s in group:
                due = start + s.offset + k * period
                now = time.monotonic()
                if now - start > stop_after:
                    return
                if due > now:
                    time.sleep(due - now)
                else:
                    s.late.append(now - due)
                events = [rss_event_to_proto(50_000_000 + k, job_id=JOB_ID, unix_time_s=time.time())
                          for _ in range(events_per_tick)]
                called = time.monotonic()
                try:
                    s.run.emit_many(events)
                except Exception:  # noqa: BLE001 - counted, the bench goes on
                    s.emit_errors += 1
                    continue
                s.ticks_done += 1
                s.sink.emit_times.extend([called] * (s.run.emitted - len(s.sink.emit_times)))

    # The agents' ticks are spread over the period; each pool thread owns the agents i = t mod pool.
    for s in sims:
        s.offset = (s.i % 97) / 97 * period
    pool = max(1, min(len(sims), emit_threads))
    groups = [sorted(sims[t::pool], key=lambda s: s.offset) for t in range(pool)]
    emitters = [threading.Thread(target=emitter, args=(g,), daemon=True) for g in groups]
    for t in emitters:
        t.start()
    ready_q.put((os.getpid(), sum(s.connected for s in sims), connect_s))
    start_ev.wait()
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    clock["start"] = start = time.monotonic()
    go.set()
    for t in emitters:
        t.join()
    emit_end = time.monotonic()
    drain_deadline = emit_end + drain_s
    while time.monotonic() < drain_deadline:
        if all(s.sink.acked >= s.run.emitted for s in sims):
            break
        time.sleep(0.05)
    drain_end = time.monotonic()
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    for s in sims:
        s.sender.stop()
    for t in senders:
        t.join(timeout=5)
    result = {
        "pid": os.getpid(), "connect_s": connect_s, "emit_s": emit_end - start, "drain_s": drain_end - emit_end,
        "logs": logs[:10],
        "cpu_s": (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime),
        "agents": [{
            "i": s.i, "connected": s.connected, "emitted": s.run.emitted, "acked": s.sink.acked,
            "on_wire": s.sender.events_sent, "batches": s.sender.batches_sent, "acks": s.sender.acks_received,
            "retries": s.retries, "errors": s.errors, "emit_errors": s.emit_errors,
            "latencies": s.sink.latencies(), "late": s.late, "ticks": ticks, "ticks_done": s.ticks_done,
        } for s in sims],
    }
    for s in sims:
        s.sink.close()
        s.channel.close()
    out_q.put(result)


# --------------------------------------------------------------------------------------------- driver
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[k]


def bench(args) -> dict:
    nofile = raise_nofile()
    cores = os.cpu_count() or 1
    processes = max(1, min(args.processes or cores, args.agents))
    args.max_workers = args.max_workers or 2 * args.agents + 16
    root = Path(tempfile.mkdtemp(prefix="poet-fleet-bench-", dir=args.work_dir))
    server = None
    try:
        certs, state, prep_s = prepare(root, args.agents)
        server, address = start_coordinator(certs, state, args.max_workers)
        sampler = Sampler(server.pid)
        sampler.start()
        ctx = mp.get_context("spawn")
        ready_q, out_q, start_ev = ctx.Queue(), ctx.Queue(), ctx.Event()
        chunks = [list(range(p, args.agents, processes)) for p in range(processes)]
        workers = [ctx.Process(target=worker_main, daemon=True, args=(
            chunk, str(certs), address, str(root), args.rate_hz, args.seconds, args.events_per_tick,
            args.drain_s, args.connect_timeout_s, args.grpc_logs, args.emit_threads, ready_q, start_ev, out_q)) for chunk in chunks]
        for w in workers:
            w.start()
        ready = [ready_q.get(timeout=args.connect_timeout_s + 300) for _ in workers]
        connected = sum(r[1] for r in ready)
        import psutil

        machine0 = psutil.cpu_times()
        cpu0, wall0, unix0 = sampler.cpu_s(), time.monotonic(), time.time()
        start_ev.set()
        results = [out_q.get(timeout=args.seconds + args.drain_s + 300) for _ in workers]
        wall1 = time.monotonic()
        cpu1 = sampler.cpu_s()
        machine1 = psutil.cpu_times()
        hwm = sampler.hwm_bytes()
        sampler.stop_event.set()
        for w in workers:
            w.join(timeout=30)
        server.send_signal(signal.SIGTERM)
        server_rc = server.wait(timeout=60)
        server = None

        agents = [a for r in results for a in r["agents"]]
        emitted = {run_id_of(a["i"]): a["emitted"] for a in agents}
        db = sqlite3.connect(state / "poet.db")
        try:
            rows = dict(db.execute("SELECT run_id, COUNT(*) FROM events GROUP BY run_id").fetchall())
            distinct = db.execute("SELECT COUNT(*) FROM (SELECT DISTINCT run_id, seq FROM events)").fetchone()[0]
            counters = db.execute("SELECT COALESCE(SUM(events_stored), 0) FROM runs").fetchone()[0]
            in_range = 0
            for run_id, n in emitted.items():
                in_range += db.execute("SELECT COUNT(*) FROM events WHERE run_id = ? AND seq BETWEEN 1 AND ?",
                                       (run_id, n)).fetchone()[0]
            last_stored = db.execute("SELECT MAX(stored_at_s) FROM events").fetchone()[0]
        finally:
            db.close()
        sent = sum(emitted.values())
        stored = sum(rows.values())
        latencies = [x for a in agents for x in a["latencies"]]
        on_wire = sum(a["on_wire"] for a in agents)
        window_s = wall1 - wall0
        coord_cpu = cpu1 - cpu0
        stored_span = (last_stored - unix0) if last_stored else None
        agents_stored = sum(1 for run_id in emitted if rows.get(run_id))
        late = [x for a in agents for x in a["late"]]
        ticks_total = sum(a["ticks"] for a in agents)
        ticks_missed = ticks_total - sum(a["ticks_done"] for a in agents)
        total = sum(machine1) - sum(machine0)
        idle = sum(getattr(machine1, f, 0) - getattr(machine0, f, 0) for f in ("idle", "iowait"))
        machine_busy = 100 * (1 - idle / total) if total > 0 else 0.0
        batches = sum(a["batches"] for a in agents)
        acks = sum(a["acks"] for a in agents)
        errors: dict[str, int] = {}
        for a in agents:
            for k, v in a["errors"].items():
                errors[k] = errors.get(k, 0) + v
        report = {
            "agents": args.agents, "rate_hz": args.rate_hz, "seconds": args.seconds,
            "max_workers": args.max_workers, "events_per_tick": args.events_per_tick, "processes": processes, "cores": cores,
            "connected": connected, "agents_with_events_stored": agents_stored,
            "events_sent": sent, "events_on_wire": on_wire, "resent": max(0, on_wire - sent),
            "events_stored": stored, "offered_per_s": args.agents * args.rate_hz * args.events_per_tick,
            "stored_per_s": round(stored / stored_span, 1) if stored_span else 0.0,
            "lost": sent - in_range, "duplicated": counters - distinct,
            "ack_p50_s": percentile(latencies, 50), "ack_p99_s": percentile(latencies, 99),
            "ack_max_s": max(latencies) if latencies else None, "acked_events": len(latencies),
            "coordinator_cpu_s": round(coord_cpu, 2), "coordinator_cpu_pct_of_core": round(100 * coord_cpu / window_s, 1),
            "coordinator_peak_rss_bytes": max(sampler.peak_rss, hwm or 0), "coordinator_threads_peak": sampler.threads_peak,
            "coordinator_cpu_ms_per_ack": round(1000 * coord_cpu / acks, 2) if acks else None,
            "agents_cpu_s": round(sum(r["cpu_s"] for r in results), 2), "machine_busy_pct": round(machine_busy, 1),
            "batches_on_wire": batches, "acks_received": acks,
            "events_per_batch": round(on_wire / batches, 2) if batches else None,
            "ticks_missed": ticks_missed,
            "ticks_late_pct": round(100 * sum(1 for x in late if x > 0.1) / ticks_total, 1) if ticks_total else 0.0,
            "tick_late_p99_s": percentile(late + [0.0] * (ticks_total - len(late)), 99),
            "coordinator_exit": server_rc, "window_s": round(window_s, 2),
            "drain_s": round(max(r["drain_s"] for r in results), 2),
            "connect_s": round(max(r[2] for r in ready), 2), "setup_s": round(prep_s, 2),
            "stream_errors": errors, "emit_errors": sum(a["emit_errors"] for a in agents),
            "open_files_limit": nofile[0], "agent_logs": [line for r in results for line in r["logs"]][:10],
        }
        report["limit"] = diagnose(report)
        return report
    finally:
        if server is not None:
            server.kill()
            server.wait()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def diagnose(r: dict) -> str:
    notes = []
    if r["connected"] < r["agents"]:
        notes.append(f"only {r['connected']} of {r['agents']} channels connected (TLS handshakes) before the "
                     f"connect timeout")
    if r["agents"] > r["max_workers"]:
        notes.append(f"the coordinator's thread pool ({r['max_workers']} workers, poet serve --max-workers) "
                     f"serves at most {r['max_workers']} telemetry streams at once and a stream holds its worker for "
                     f"its whole life: the other agents' streams wait in the pool's queue (their events wait, "
                     f"unacknowledged, in their buffers; {r['agents_with_events_stored']} of {r['agents']} agents "
                     f"got any event stored)")
    pct = r["coordinator_cpu_pct_of_core"]
    behind = r["lost"] > 0 or (r["ack_p99_s"] or 0) > 5
    if r["machine_busy_pct"] >= 90:
        notes.append(f"the machine's {r['cores']} cores are saturated ({r['machine_busy_pct']}% busy: coordinator "
                     f"{r['coordinator_cpu_s']} CPU s, the simulated agents {r['agents_cpu_s']} CPU s, the rest "
                     f"other load, over {r['window_s']} s)")
    if r["ticks_late_pct"] > 5:
        notes.append(f"the simulator itself fell behind: {r['ticks_late_pct']}% of the ticks were more than 0.1 s "
                     f"late (p99 {r['tick_late_p99_s']:.3g} s), so the offered rate was not fully offered; "
                     f"{r['ticks_missed']} ticks were never emitted")
    if pct >= 85:
        notes.append(f"the coordinator is CPU-bound: {pct}% of one core (Python, one GIL)")
    else:
        notes.append(f"coordinator CPU {pct}% of one core")
    if behind and r["events_per_batch"] is not None and r["coordinator_cpu_ms_per_ack"] is not None:
        notes.append(f"the coordinator's cost is per batch (one store transaction and one ack each, "
                     f"{r['coordinator_cpu_ms_per_ack']} CPU ms per batch) and the senders keep sending small "
                     f"batches ({r['events_per_batch']} events on average) while acks lag, so a backlog does not "
                     f"coalesce into larger batches")
    if not behind and r["duplicated"] == 0:
        notes.append(f"keeps up with the offered {r['offered_per_s']:g} events/s")
    return "; ".join(notes)


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(r: dict) -> None:
    rows = [
        ("agents", r["agents"]), ("rate_hz", r["rate_hz"]), ("seconds", r["seconds"]),
        ("processes (cores)", f"{r['processes']} ({r['cores']})"), ("coordinator threads", r["max_workers"]),
        ("connected", r["connected"]), ("agents with events stored", r["agents_with_events_stored"]),
        ("events_sent", r["events_sent"]), ("events_on_wire (resent)", f"{r['events_on_wire']} ({r['resent']})"),
        ("events_stored", r["events_stored"]), ("offered / stored per s", f"{r['offered_per_s']:g} / {r['stored_per_s']:g}"),
        ("lost", r["lost"]), ("duplicated", r["duplicated"]),
        ("ack p50 / p99 / max s", f"{fmt(r['ack_p50_s'])} / {fmt(r['ack_p99_s'])} / {fmt(r['ack_max_s'])}"),
        ("coordinator CPU s (% of a core)", f"{r['coordinator_cpu_s']} ({r['coordinator_cpu_pct_of_core']}%)"),
        ("coordinator peak RSS MiB", f"{r['coordinator_peak_rss_bytes'] / 2**20:.1f}"),
        ("coordinator CPU ms per batch", fmt(r["coordinator_cpu_ms_per_ack"])),
        ("batches (events per batch)", f"{r['batches_on_wire']} ({fmt(r['events_per_batch'])})"),
        ("agents CPU s / machine busy", f"{r['agents_cpu_s']} / {r['machine_busy_pct']}%"),
        ("window / drain s", f"{r['window_s']} / {r['drain_s']}"),
        ("ticks >0.1 s late (p99 lateness s)", f"{r['ticks_late_pct']}% ({fmt(r['tick_late_p99_s'])})"),
        ("ticks not emitted (simulator too slow)", r["ticks_missed"]),
        ("stream errors", ", ".join(f"{k} {v}" for k, v in r["stream_errors"].items()) or "none"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(f"limit: {r['limit']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--rate-hz", type=float, default=10.0, help="emit ticks per second per agent")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--events-per-tick", type=int, default=1, help="RSS events per emit_many call")
    parser.add_argument("--processes", type=int, default=0, help="worker processes (default: one per core)")
    parser.add_argument("--drain-s", type=float, default=30.0, help="longest wait for acknowledgements after emitting")
    parser.add_argument("--connect-timeout-s", type=float, default=120.0)
    parser.add_argument("--work-dir", default=None, help="parent of the temporary dir (default: the system's)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary dir (certs, store, buffers)")
    parser.add_argument("--emit-threads", type=int, default=16, help="emitting threads per worker process")
    parser.add_argument("--grpc-logs", action="store_true", help="let gRPC core log in the agent processes")
    parser.add_argument("--max-workers", type=int, default=0,
                        help="the coordinator's threads (poet serve --max-workers; default: 2 per agent + 16, "
                             "since each simulated agent holds one telemetry stream)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if args.agents < 1 or args.rate_hz <= 0 or args.seconds <= 0 or args.events_per_tick < 1:
        parser.error("--agents, --rate-hz, --seconds and --events-per-tick must be positive")
    report = bench(args)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
