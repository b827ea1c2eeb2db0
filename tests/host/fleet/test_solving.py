"""Solves off the RPC (issue 17, part 5): SubmitRun records 'solving' runs and answers; solver workers (the
coordinator's own, or `poet solver-worker` processes sharing its store) solve each distinct schedule once and queue
the runs; a long-polling board wakes when its schedule is solved. Real coordinators on loopback, real solves."""

from __future__ import annotations

import signal
import subprocess
import threading

import pytest

from host.fleet.server import start_coordinator
from host.fleet.solving import SolverPool
from host.fleet.store import RunStore, sqlite_url
from tests.host.cli.helpers import POET, test_env
from tests.host.fleet.helpers import solved_runs
from tests.host.fleet.test_service import MODEL, TIMEOUT_S, admin, fleet_pb2, node, register

SOLVING, QUEUED = fleet_pb2.RUN_STATUS_SOLVING, fleet_pb2.RUN_STATUS_QUEUED


def _request(*agents, share=0.8, model=MODEL):
    return fleet_pb2.SubmitRunRequest(model=model, dataset="digits", steps=2, agents=list(agents),
                                      optimizer=fleet_pb2.OPTIMIZER_SGD, lr=0.05,
                                      ram_budget=fleet_pb2.RamBudget(fraction_of_peak=share))


def test_submit_answers_with_solving_runs_and_a_waiting_board_gets_its_job_once_solved(cert_dir, coordinator):
    port = coordinator.port
    boards = {name: register(cert_dir, port, name) for name in ("pi-1", "pi-2")}
    register(cert_dir, port, "pi-3", platform="jetsontx2")
    polled: dict[str, object] = {}

    def long_poll():  # pi-1 waits for work before anything is submitted
        polled["job"] = boards["pi-1"].PullJob(fleet_pb2.PullJobRequest(wait_s=25), timeout=TIMEOUT_S)

    poller = threading.Thread(target=long_poll)
    poller.start()
    stub = admin(cert_dir, port)
    reply = stub.SubmitRun(_request("pi-1", "pi-2", "pi-3"), timeout=TIMEOUT_S).runs
    # The reply is built in the transaction that queued the solves: no worker can have answered yet.
    assert [r.status for r in reply] == [SOLVING] * 3
    assert all(not r.schedule_fingerprint and r.ram_budget_bytes > 0 for r in reply)
    store = coordinator.store
    assert len(store.list_solves()) == 2  # pi-1 and pi-2 share one schedule; pi-3's profile differs
    runs = {r.agent: r for r in solved_runs(stub, reply)}
    assert runs["pi-2"].status == runs["pi-3"].status == QUEUED  # pi-1's is running: its long poll took it
    assert runs["pi-1"].schedule_fingerprint == runs["pi-2"].schedule_fingerprint != runs["pi-3"].schedule_fingerprint
    assert coordinator.coordinator.solve_count == 2
    poller.join(TIMEOUT_S)
    job = polled["job"].job
    assert job.run_id == runs["pi-1"].run_id and len(job.schedule.instructions) > 0
    assert {s.state for s in store.list_solves()} == {"done"}


def test_a_case_solved_before_is_queued_in_the_reply_even_after_a_restart(cert_dir, tmp_path):
    state = tmp_path / "state"
    first = start_coordinator("127.0.0.1:0", cert_dir, state_dir=state)
    try:
        register(cert_dir, first.port, "pi-1")
        stub = admin(cert_dir, first.port)
        [solved] = solved_runs(stub, stub.SubmitRun(_request("pi-1"), timeout=TIMEOUT_S).runs)
        assert solved.status == QUEUED and first.coordinator.solve_count == 1
    finally:
        first.stop(grace_s=0)
    again = start_coordinator("127.0.0.1:0", cert_dir, state_dir=state)
    try:
        stub = admin(cert_dir, again.port)
        [run] = stub.SubmitRun(_request("pi-1"), timeout=TIMEOUT_S).runs
        assert (run.status, run.schedule_fingerprint) == (QUEUED, solved.schedule_fingerprint)
        assert again.coordinator.solve_count == 0  # the store kept the schedule: nothing solved again
    finally:
        again.stop(grace_s=0)


def test_runs_recorded_while_no_worker_runs_are_solved_by_the_coordinator_started_later(cert_dir, tmp_path):
    state = tmp_path / "state"
    idle = start_coordinator("127.0.0.1:0", cert_dir, state_dir=state, solver_workers=0)
    try:
        register(cert_dir, idle.port, "pi-1")
        [run] = admin(cert_dir, idle.port).SubmitRun(_request("pi-1"), timeout=TIMEOUT_S).runs
        assert run.status == SOLVING
    finally:
        idle.stop(grace_s=0)  # the queue is in the store, not in this process
    later = start_coordinator("127.0.0.1:0", cert_dir, state_dir=state)
    try:
        stub = admin(cert_dir, later.port)
        [done] = solved_runs(stub, [stub.GetRun(fleet_pb2.GetRunRequest(run_id=run.run_id), timeout=TIMEOUT_S)])
        assert done.status == QUEUED and done.schedule_fingerprint
        job = node(cert_dir, "pi-1", later.port).PullJob(fleet_pb2.PullJobRequest(wait_s=5), timeout=TIMEOUT_S).job
        assert job.run_id == run.run_id and len(job.schedule.instructions) > 0
    finally:
        later.stop(grace_s=0)


def test_a_solve_that_raises_fails_its_runs_saying_why(tmp_path):
    with RunStore(sqlite_url(tmp_path)) as store:
        store.register_agent("pi-1", "a72", {})
        store.create_submission("j1", "train", {}, [{"run_id": "r1", "agent": "pi-1", "status": "solving",
                                                     "metrics": {"schedule_key": "k1"}}],
                                solve_problems={"k1": {"label": "a problem no solver can read"}})
        pool = SolverPool(store, 1).start()  # the real solve: the problem has no graph
        try:
            solved_runs_in_store(store, ["r1"])
        finally:
            pool.stop()
        run = store.get_run("r1")
        assert run.status == "failed" and "solving the schedule failed: KeyError" in run.detail


def solved_runs_in_store(store: RunStore, run_ids, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while any(store.get_run(r).status == "solving" for r in run_ids):
        assert time.monotonic() < deadline, "still solving"
        time.sleep(0.05)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_solver_worker_process_solves_for_a_coordinator_that_has_none(backend, cert_dir, tmp_path, request):
    """`poet solver-worker --store URL` beside `poet serve --solver-workers 0`: the store is the queue. The board's
    long poll, held by the coordinator, wakes for a schedule another process solved."""
    state = tmp_path / "state"
    state.mkdir()
    url = sqlite_url(state) if backend == "sqlite" else request.getfixturevalue("postgres_server").new_database()
    running = start_coordinator("127.0.0.1:0", cert_dir, state_dir=state, store_url=url, solver_workers=0)
    worker = None
    try:
        board = register(cert_dir, running.port, "pi-1")
        [run] = admin(cert_dir, running.port).SubmitRun(_request("pi-1"), timeout=TIMEOUT_S).runs
        assert run.status == SOLVING
        worker = subprocess.Popen([str(POET), "solver-worker", "--store", url, "--workers", "1"],
                                  stderr=subprocess.PIPE, text=True, env=test_env())
        job = board.PullJob(fleet_pb2.PullJobRequest(wait_s=25), timeout=TIMEOUT_S).job
        assert job.run_id == run.run_id and len(job.schedule.instructions) > 0
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=TIMEOUT_S)
        assert worker.returncode == 0, stderr
        assert "solving queued schedules from" in stderr and "1 schedule(s) solved" in stderr
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        running.stop(grace_s=0)


def test_poet_run_waits_for_the_schedules_unless_detached(cert_dir, coordinator):
    from tests.host.cli.helpers import one_json_object
    from tests.host.fleet.test_profiles import RUN, poet

    register(cert_dir, coordinator.port, "pi-1")
    detached = poet(cert_dir, coordinator, *RUN, "--ram-budget", "100%", "--agents", "pi-1", "--detach", "--json")
    assert detached.returncode == 0, detached.stderr
    [run] = one_json_object(detached.stdout)["runs"]
    assert run["status"] == "solving" and not run["schedule_fingerprint"]
    waited = poet(cert_dir, coordinator, *RUN, "--ram-budget", "90%", "--agents", "pi-1", "--json")
    assert waited.returncode == 0, waited.stderr
    [run] = one_json_object(waited.stdout)["runs"]
    assert run["status"] == "queued" and run["schedule_fingerprint"] and run["recomputes"] >= 0


def test_on_a_shared_postgresql_store_a_board_polling_one_coordinator_wakes_for_a_job_another_queued(
        cert_dir, tmp_path, postgres_server):
    """LISTEN/NOTIFY: without it the board would see the job only when its long poll ends (20 s here)."""
    import time

    url = postgres_server.new_database()
    solving = start_coordinator("127.0.0.1:0", cert_dir, state_dir=tmp_path / "a", store_url=url)
    polled = start_coordinator("127.0.0.1:0", cert_dir, state_dir=tmp_path / "b", store_url=url, solver_workers=0)
    try:
        register(cert_dir, solving.port, "pi-2")
        board = register(cert_dir, polled.port, "pi-1")
        stub = admin(cert_dir, solving.port)
        solved_runs(stub, stub.SubmitRun(_request("pi-2"), timeout=TIMEOUT_S).runs)  # the case is solved now
        result: dict[str, object] = {}

        def long_poll():
            started = time.monotonic()
            result["job"] = board.PullJob(fleet_pb2.PullJobRequest(wait_s=20), timeout=TIMEOUT_S).job
            result["waited_s"] = time.monotonic() - started

        poller = threading.Thread(target=long_poll)
        poller.start()
        time.sleep(1.0)  # the poll is held by the other coordinator
        [run] = stub.SubmitRun(_request("pi-1"), timeout=TIMEOUT_S).runs
        assert run.status == QUEUED  # solved before: queued in the reply
        poller.join(TIMEOUT_S)
        assert result["job"].run_id == run.run_id and result["waited_s"] < 10, result["waited_s"]
    finally:
        polled.stop(grace_s=0)
        solving.stop(grace_s=0)


def test_a_solver_worker_outlives_a_result_the_store_refuses(tmp_path):
    """The store refuses the first result (a metric that is not one); the worker hands the solve back, stays alive
    and stores the next result."""
    results = iter([{"status": "queued", "metrics": {"not_a_metric": 1}},
                    {"status": "queued", "schedule_json": "{}", "schedule_fingerprint": "f", "metrics": {}}])
    with RunStore(sqlite_url(tmp_path)) as store:
        store.register_agent("pi-1", "a72", {})
        store.create_submission("j1", "train", {}, [{"run_id": "r1", "agent": "pi-1", "status": "solving",
                                                     "metrics": {"schedule_key": "k1"}}],
                                solve_problems={"k1": {"label": "k1"}})
        pool = SolverPool(store, 1, solve=lambda problem: next(results), idle_poll_s=0.05).start()
        try:
            solved_runs_in_store(store, ["r1"], timeout_s=30)  # times out if the refused result killed the worker
        finally:
            pool.stop()
        assert store.get_run("r1").schedule_fingerprint == "f"
