"""The fleet end to end: real `poet serve` and `poet-agent run` processes on loopback (issue 8, Evidence).

Each test starts its own coordinator and boards (tests/e2e/conftest.py), submits runs with the real
`poet run` and reads the outcome with `poet runs show --json`, the coordinator's store and the
boards' state dirs. The model is the zoo's `mlp` on the boards' `digits` shards, batch 16, at 80%
of the no-remat peak (a paging schedule).
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import dump

pytestmark = pytest.mark.timeout(300)
# Long enough that a kill or a cut lands mid-run (a step of the small test model takes a few ms).
LONG_STEPS = 1200


def stored_seqs(state_dir, run_id: str) -> list[int]:
    """The seqs of the events the coordinator stored for a run, read from its SQLite store (stopped)."""
    from host.fleet.store import RunStore

    with RunStore(f"sqlite:///{state_dir / 'poet.db'}") as store:
        return [seq for seq, _ in store.get_events(run_id)]


def assert_events_complete(fleet, run: dict) -> None:
    """Stored == emitted, and the stored seqs are exactly 1..emitted (none lost, none twice)."""
    assert run["events_emitted"] > 0, dump(run)
    assert run["events_stored"] == run["events_emitted"], dump(run)
    seqs = stored_seqs(fleet.state_dir, run["run_id"])
    assert seqs == list(range(1, run["events_emitted"] + 1)), (
        f"run {run['run_id']}: {len(seqs)} stored seqs, emitted {run['events_emitted']}; "
        f"missing {sorted(set(range(1, run['events_emitted'] + 1)) - set(seqs))[:10]}, "
        f"duplicates {len(seqs) - len(set(seqs))}")


# ------------------------------------------------------------------------------------------ 1. happy path
@pytest.mark.slow  # about 7-18 s: the fast suite stays under 5 minutes
def test_happy_path_two_boards_verify_run(fleet):
    fleet.serve()
    fleet.agent("b1", "1/2")
    fleet.agent("b2", "2/2")
    runs = fleet.submit(kind="verify", steps=20, wait=True)
    runs = [fleet.wait_settled(r["run_id"]) if r["status"] == "done" else r for r in runs]
    assert sorted(r["agent"] for r in runs) == ["b1", "b2"], dump(runs)
    for run in runs:
        assert run["status"] == "done", dump(run)
        assert run["kind"] == "verify"
        assert run["steps_done"] == 20
        assert run["max_rel_param_diff"] == 0.0, dump(run)
        assert run["events_emitted"] > 0 and run["events_stored"] == run["events_emitted"], dump(run)
        assert run["ram_budget_bytes"] > 0 and run["schedule_fingerprint"]
        assert run["param_digest"] and run["final_loss"] is not None
        assert 0.0 <= run["accuracy_before"] <= 1.0 and 0.0 <= run["accuracy_after"] <= 1.0, dump(run)
        assert run["predicted"]["step_s"] is not None and run["measured"]["step_s"] is not None, dump(run)
    agents = {a["name"]: a for a in fleet.fleet_list()}
    assert sorted(agents) == ["b1", "b2"]
    assert all(a["online"] for a in agents.values()), dump(agents)
    # The boards' own logs tell the same story.
    for board in fleet.processes[1:]:
        board.wait_for(r"job \S+ finished: DONE")
        board.wait_for(r"reported the result of run \S+ \(DONE\)")
    assert fleet.coordinator.stop() == 0
    for run in runs:
        assert_events_complete(fleet, run)


# ------------------------------------------------------------------------------------------ 2. coordinator kill -9
@pytest.mark.slow
def test_coordinator_killed_mid_job_and_restarted_on_the_same_store_loses_and_duplicates_nothing(fleet):
    coordinator = fleet.serve()
    fleet.agent("b1", "1/2")
    fleet.agent("b2", "2/2")
    runs = fleet.submit(steps=LONG_STEPS)
    fleet.wait_steps(runs[0]["run_id"], 60)
    coordinator.kill9()
    time.sleep(1.0)  # the boards notice: their streams and polls break
    restarted = fleet.serve(listen=f"127.0.0.1:{coordinator.port}")
    assert restarted.address == coordinator.address
    finished = [fleet.wait_settled(r["run_id"], timeout_s=150) for r in runs]
    for run in finished:
        assert run["status"] == "done", dump(run)
        assert run["steps_done"] == LONG_STEPS, dump(run)
    for board in fleet.processes:
        if board.label.startswith("agent"):
            assert len([line for line in board.lines if "registered with" in line]) >= 2, board.log()
    assert restarted.stop() == 0
    for run in finished:
        assert_events_complete(fleet, run)


# ------------------------------------------------------------------------------------------ 3. agent kill -9
@pytest.mark.slow
def test_agent_killed_mid_job_resumes_and_ends_with_the_parameters_of_an_uninterrupted_run(fleet):
    fleet.serve()
    killed = fleet.agent("b1", "1/2")
    fleet.agent("b2", "1/2")  # the same shard: an uninterrupted run of the same job
    runs = {r["agent"]: r for r in fleet.submit("b1", "b2", steps=LONG_STEPS)}
    before = fleet.wait_steps(runs["b1"]["run_id"], 75)
    killed.kill9()
    assert list((killed.state_dir / "runs" / runs["b1"]["run_id"]).glob("checkpoint*")), "no checkpoint to resume"
    again = fleet.agent("b1", "1/2")
    again.wait_for(rf"resuming run {runs['b1']['run_id']} at step [1-9][0-9]* of {LONG_STEPS}")
    resumed_at = int(again.wait_for(r"resuming run \S+ at step (\d+)").group(1))
    # From its last checkpoint (every 10 steps), at or past what the coordinator had seen before the kill.
    assert resumed_at % 10 == 0 and before["steps_done"] - 10 < resumed_at < LONG_STEPS, (resumed_at, before["steps_done"])
    done = {agent: fleet.wait_settled(r["run_id"], timeout_s=150) for agent, r in runs.items()}
    for run in done.values():
        assert run["status"] == "done" and run["steps_done"] == LONG_STEPS, dump(run)
    assert done["b1"]["param_digest"] == done["b2"]["param_digest"], dump(done)
    assert done["b1"]["final_loss"] == done["b2"]["final_loss"], dump(done)
    # The replayed steps' events were sent again under new seqs: still none lost, none twice.
    assert done["b1"]["events_emitted"] >= done["b2"]["events_emitted"], dump(done)
    # And stored: every step has its step event (the restarted board used to number from 1 again, and the
    # coordinator dropped those seqs as already stored, so the re-run steps had no telemetry; issue 17).
    for run in done.values():
        assert run["telemetry_steps_missing"] == [], dump(run)
    assert fleet.coordinator.stop() == 0
    for run in done.values():
        assert_events_complete(fleet, run)


# ------------------------------------------------------------------------------------------ 4. connections cut
@pytest.mark.slow
def test_connections_cut_by_a_proxy_reconnect_and_lose_nothing(fleet):
    from tests.e2e.conftest import Proxy

    fleet.serve()
    proxy = Proxy(fleet.coordinator.address)
    try:
        board = fleet.agent("b1", "1/2", coordinator=proxy.address)
        # batch 128 and cuts early in the run: with the lowered executor a batch-16 step of this model takes
        # half a millisecond, and a run outlived three reconnects only barely
        run = fleet.submit("b1", steps=LONG_STEPS, batch_size=128)[0]
        for at_step in (40, 160, 320):
            fleet.wait_steps(run["run_id"], at_step)
            assert proxy.sever() > 0, "the proxy carried no connection to cut"
        run = fleet.wait_settled(run["run_id"], timeout_s=150)
        assert run["status"] == "done" and run["steps_done"] == LONG_STEPS, dump(run)
        assert proxy.accepted >= 4, f"the agent did not reconnect through the proxy ({proxy.accepted} connections)"
        assert board.has(r"reported the result of run \S+ \(DONE\)"), board.log()
    finally:
        proxy.close()
    assert fleet.coordinator.stop() == 0
    assert_events_complete(fleet, run)


# ------------------------------------------------------------------------------------------ 5. refusals
@pytest.mark.slow
def test_refusals_operator_cert_as_agent_foreign_ca_removed_node_and_plaintext(fleet, cert_dir, foreign_cert_dir):
    import grpc

    from tests.e2e.conftest import OPERATOR

    fleet.serve()
    # An operator's certificate cannot act as a board.
    impostor = fleet.agent("op-as-agent", bundle=cert_dir / OPERATOR, registered=False)
    assert impostor.wait_exit(60) == 3, impostor.log()
    assert not impostor.has("registered with"), impostor.log()
    # A node certificate from another CA (same name as a real node) never gets past the TLS handshake.
    foreign = fleet.agent("b1", bundle=foreign_cert_dir / "b1", registered=False)
    foreign.wait_for(r"TLS handshake failed", timeout_s=30)
    assert not foreign.has("registered with") and foreign.process.poll() is None, foreign.log()
    foreign.kill9()
    assert [a["name"] for a in fleet.fleet_list()] == []
    # A plaintext client is refused.
    channel = grpc.insecure_channel(fleet.coordinator.address)
    try:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        with pytest.raises(grpc.RpcError) as refused:
            check(b"", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    finally:
        channel.close()
    # A removed node: its run fails and the agent exits 3.
    board = fleet.agent("b2", "2/2")
    run = fleet.submit("b2", steps=LONG_STEPS)[0]  # still running when the remove lands (the CLI starts in ~3 s)
    fleet.wait_steps(run["run_id"], 5)
    removed = fleet.poet("fleet", "remove", "b2")
    assert removed.returncode == 0, removed.stderr
    assert board.wait_exit(60) == 3, board.log()
    assert board.has("refused by the coordinator"), board.log()
    run = fleet.show(run["run_id"])
    assert run["status"] == "failed" and run["error"], dump(run)
    assert "b2" not in [a["name"] for a in fleet.fleet_list()]
    again = fleet.agent("b2-again", "2/2", bundle=cert_dir / "b2", registered=False)
    assert again.wait_exit(60) == 3, again.log()


# ------------------------------------------------------------------------------------------ 6. corrupted model
def _flip_byte(path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    index = len(data) // 2 if offset is None else offset
    data[index] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_corrupted_model_is_refetched_from_a_damaged_cache_and_never_trained_on_when_corrupt_at_the_source(fleet):
    fleet.serve()
    # Both boards register, then go offline so that the runs wait for them.
    for name, shard in (("b1", "1/2"), ("b2", "2/2")):
        assert fleet.agent(name, shard).stop() == 0
    runs = {r["agent"]: r for r in fleet.submit("b1", "b2", steps=5)}
    assert all(r["status"] == "queued" for r in runs.values()), dump(runs)
    archives = list((fleet.state_dir / "models").glob("*.pt2"))
    assert len(archives) == 1, archives
    archive = archives[0]
    digest = archive.stem
    # b2's cache holds a damaged copy: it is detected, re-fetched, and the run completes.
    cache = fleet.tmp / "boards" / "b2" / "state" / "models"
    cache.mkdir(parents=True, exist_ok=True)
    damaged = cache / archive.name
    damaged.write_bytes(archive.read_bytes())
    _flip_byte(damaged)
    b2 = fleet.agent("b2", "2/2")
    run = fleet.wait_run(runs["b2"]["run_id"], timeout_s=90)
    assert run["status"] == "done", dump(run)
    assert b2.has(rf"cached model {digest[:12]} does not match its digest"), b2.log()
    assert damaged.read_bytes() == archive.read_bytes()
    # The coordinator's own copy is corrupt: every fetch fails its digest check, b1 never trains.
    _flip_byte(archive)
    b1 = fleet.agent("b1", "1/2")
    run = fleet.wait_run(runs["b1"]["run_id"], timeout_s=120)
    assert run["status"] == "failed", dump(run)
    assert "arrived corrupted" in run["error"], dump(run)
    run_dir = b1.state_dir / "runs" / run["run_id"]
    assert not list(run_dir.glob("checkpoint*")) and not (run_dir / "weights.safetensors").exists(), \
        sorted(p.name for p in run_dir.iterdir())
    assert not (b1.state_dir / "models" / archive.name).exists()
    assert not b1.has(r"running job .*\n?.*resuming"), b1.log()


# ------------------------------------------------------------------------------------------ 7. full flash
def _mount_tmpfs(directory, size: str) -> str | None:
    """Mount a tmpfs of ``size`` on ``directory``; None when it worked, else why not."""
    import subprocess

    directory.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


@pytest.mark.slow
def test_a_full_flash_dir_fails_the_run_clearly_and_leaves_no_page_files(fleet):
    import subprocess

    from host.cli.operator import EXIT_RUN_FAILED

    flash = fleet.tmp / "small-flash"
    why = _mount_tmpfs(flash, "64k")
    if why is not None:
        pytest.skip(f"cannot mount a 64 KiB tmpfs as the board's flash dir (needs root): {why}")
    try:
        fleet.serve()
        # The board runs as a Raspberry Pi 4 (the shipped a72 profile), where flash is cheap enough that the
        # solver pages rather than recomputes. Batch 512 makes a page (128 KiB) larger than the 64 KiB flash.
        board = fleet.agent("b1", "1/2", flash_dir=flash, extra=("--platform", "a72"))
        for budget in ("80%", "76%", "85%", "90%", "95%"):
            # the board may fail the run (its flash cannot hold a page) before `poet run` reports it
            run = fleet.submit("b1", steps=2, budget=budget, batch_size=512, ok_codes=(0, EXIT_RUN_FAILED))[0]
            if run["page_outs"] > 0:
                break
        else:
            pytest.skip(f"no schedule of mlp pages on this machine's profile (last: {dump(run)})")
        run = fleet.wait_run(run["run_id"], timeout_s=90)
        assert run["status"] == "failed", dump(run)
        assert "flash" in run["error"].lower(), dump(run)
        assert any(word in run["error"].lower() for word in ("space", "free", "full", "needs")), dump(run)
        assert board.has(r"job \S+ finished: FAILED"), board.log()
        leftovers = [p for p in flash.rglob("*") if p.is_file()]
        assert leftovers == [], leftovers
        assert not [p for p in flash.iterdir() if p.name.startswith(".poet-pages")], list(flash.iterdir())
    finally:
        fleet.close()
        subprocess.run(["umount", str(flash)], capture_output=True, timeout=30)


# ------------------------------------------------------------------------------------------ 8. canary
CANARY = 1234.5678


@pytest.mark.slow
def test_a_canary_sample_planted_on_a_board_never_reaches_the_coordinator(fleet):
    import numpy as np

    fleet.serve()
    root = fleet.board_dir("b1", "1/2")
    dataset = root / "data" / "digits"
    rows = np.full((4, 64), CANARY, dtype=np.float32)
    labels = np.zeros(4, dtype=np.int64)
    np.savez(dataset / "canary.npz", x=rows, y=labels)
    np.savez(dataset / "heldout_canary.npz", x=rows, y=labels)
    canary_bytes = np.float32(CANARY).tobytes() * 4  # four consecutive features of a canary row
    needles = {"float32 bytes": canary_bytes, "float64 bytes": np.float64(CANARY).tobytes(),
               "text": str(CANARY).encode(), "float32 text": repr(float(np.float32(CANARY))).encode()}
    board = fleet.agent("b1", "1/2")
    steps = 60  # more than one pass over the shard (about 45 batches of 16): every canary row is trained on
    run = fleet.submit("b1", steps=steps)[0]
    run = fleet.wait_run(run["run_id"], timeout_s=120)
    assert run["status"] in ("done", "failed"), dump(run)
    assert run["steps_done"] == steps or "diverged" in (run["error"] or ""), dump(run)
    board.stop()
    assert fleet.coordinator.stop() == 0
    # The search can fail: the board's data dir holds the canary's bytes.
    on_board = b"".join(p.read_bytes() for p in dataset.glob("*canary.npz"))
    assert canary_bytes in on_board
    stored = [p for p in fleet.state_dir.rglob("*") if p.is_file()]
    assert any(p.name.startswith("poet.db") for p in stored), stored
    for path in stored:
        data = path.read_bytes()
        for what, needle in needles.items():
            assert needle not in data, f"the canary ({what}) is in the coordinator's {path.relative_to(fleet.tmp)}"
    coordinator_log = "".join(line for p in fleet.processes if not p.label.startswith("agent") for line in p.lines)
    assert str(CANARY) not in coordinator_log


# ------------------------------------------------------------------------------------------ 9. the operator's model
@pytest.mark.slow
def test_an_operators_module_callable_trains_on_a_board_and_never_runs_in_the_coordinator(fleet, tmp_path,
                                                                                          monkeypatch):
    """`poet run --model module:callable` traces on the operator's side and uploads the archive; a real agent trains
    it. The module is importable by the coordinator too (the previous code imported it there: its pid was marked)."""
    import subprocess
    import textwrap

    from tests.e2e.conftest import OPERATOR, POET
    from tests.host.cli.helpers import one_json_object, test_env

    models, marker = tmp_path / "opmodels", tmp_path / "ran.txt"
    models.mkdir()
    (models / "digits_mlp_op.py").write_text(textwrap.dedent(f"""
        import os

        import torch
        from torch import nn

        with open({str(marker)!r}, "a") as handle:
            handle.write(f"{{os.getpid()}}\\n")


        def make():
            return {{"module": nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)),
                     "inputs": torch.rand(16, 64)}}
    """))
    monkeypatch.setenv("PYTHONPATH", str(models))  # every process of this fleet could import it
    coordinator = fleet.serve()
    fleet.agent("b1", "1/2")
    env = test_env() | {"POET_COORDINATOR": coordinator.address, "POET_CERTS": str(fleet.cert_dir / OPERATOR)}
    done = subprocess.run([str(POET), "run", "--model", "digits_mlp_op:make", "--dataset", "digits", "--steps", "10",
                           "--ram-budget", "100%", "--agents", "b1", "--wait", "--json"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr
    run = one_json_object(done.stdout)["runs"][0]
    assert (run["status"], run["steps_done"], run["model"]) == ("done", 10, "digits_mlp_op:make"), dump(run)
    ran = {int(line) for line in marker.read_text().split()}
    assert ran and coordinator.pid not in ran and all(a.pid not in ran for a in fleet.processes[1:]), ran
    assert len(list((fleet.state_dir / "models").glob("*.pt2"))) == 1  # the uploaded archive the board fetched
