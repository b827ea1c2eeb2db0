"""The run store on real databases: SQLite files and a real PostgreSQL server (conftest.py)."""

from __future__ import annotations

import logging
import random
import threading

import pytest
import sqlalchemy as sa

from host.fleet import store as store_module
from host.fleet.store import (
    AgentRemovedError,
    RunStore,
    StoreError,
    UnknownAgentError,
    UnknownRunError,
    alembic_config,
    sqlite_url,
)

FACTS = {"ram_total_bytes": 4 << 30, "memory_limit_bytes": 1 << 30, "flash_free_bytes": 8 << 30, "meters": ["rss"]}


@pytest.fixture(params=["sqlite", "postgresql"])
def new_store_url(request, tmp_path):
    """Makes the URL of a new, empty store on the backend under test."""
    if request.param == "sqlite":
        counter = iter(range(1_000_000))

        def sqlite_store() -> str:
            directory = tmp_path / f"store{next(counter)}"
            directory.mkdir()
            return sqlite_url(directory)

        return sqlite_store
    return request.getfixturevalue("postgres_server").new_database


@pytest.fixture
def store_url(new_store_url):
    return new_store_url()


@pytest.fixture
def store(store_url):
    with RunStore(store_url) as opened:
        yield opened


def _job_with_run(store: RunStore, run_id: str = "r1", agent: str = "pi-1") -> None:
    store.register_agent(agent, "a72", FACTS)
    store.create_job("j1", "train", {"model": "mlp", "dataset": "digits", "steps": 3})
    store.create_run(run_id, "j1", agent, "train", ram_budget_bytes=1000)


# -- agents ----------------------------------------------------------------------------------


def test_register_list_touch_remove(store):
    store.register_agent("pi-2", "a72", FACTS, now_s=100.0)
    store.register_agent("jetson-1", "orin", {**FACTS, "meters": ["rss", "ina3221"]}, now_s=101.0)
    assert [agent.name for agent in store.list_agents()] == ["jetson-1", "pi-2"]
    jetson = store.get_agent("jetson-1")
    assert jetson.platform == "orin" and jetson.facts["meters"] == ["rss", "ina3221"]
    assert jetson.facts["ram_total_bytes"] == 4 << 30  # big integers survive JSON on both backends

    # registering again (a restarted agent) updates facts and last seen, keeps the first registration time
    store.register_agent("pi-2", "a72", {**FACTS, "flash_free_bytes": 5}, now_s=200.0)
    pi = store.get_agent("pi-2")
    assert (pi.registered_at_s, pi.last_seen_at_s, pi.facts["flash_free_bytes"]) == (100.0, 200.0, 5)
    store.touch_agent("pi-2", now_s=250.0)
    assert store.get_agent("pi-2").last_seen_at_s == 250.0

    entry = store.get_agent("pi-2").as_json(now_s=260.0, heartbeat_timeout_s=30.0)
    assert {"name", "platform", "online", "ram_total_bytes", "memory_limit_bytes", "flash_free_bytes", "meters"} <= set(entry)
    assert entry["online"] is True and entry["memory_limit_bytes"] == 1 << 30
    assert store.get_agent("pi-2").as_json(now_s=300.0, heartbeat_timeout_s=30.0)["online"] is False

    assert store.is_removed("pi-2") is False
    store.remove_agent("pi-2")
    assert store.is_removed("pi-2") is True
    assert [agent.name for agent in store.list_agents()] == ["jetson-1"]
    assert [agent.name for agent in store.list_agents(include_removed=True)] == ["jetson-1", "pi-2"]
    with pytest.raises(AgentRemovedError, match="pi-2"):
        store.register_agent("pi-2", "a72", FACTS)
    with pytest.raises(AgentRemovedError):
        store.touch_agent("pi-2")
    store.create_job("j1", "train", {})
    with pytest.raises(AgentRemovedError):
        store.create_run("r1", "j1", "pi-2", "train")
    with pytest.raises(UnknownAgentError, match="nobody"):
        store.touch_agent("nobody")
    assert store.is_removed("nobody") is False


# -- runs ------------------------------------------------------------------------------------


def test_run_lifecycle(store, store_url):
    store.register_agent("pi-1", "a72", FACTS)
    store.register_agent("pi-2", "a72", FACTS)
    store.create_job("j1", "verify", {"model": "mlp", "steps": 3})
    assert store.get_job("j1").spec == {"model": "mlp", "steps": 3}
    predicted = {"step_s": 0.5, "peak_ram_bytes": 900, "energy_j": 1.5, "energy_source": "modelled"}
    store.create_run("r1", "j1", "pi-1", "verify", ram_budget_bytes=1000, schedule_fingerprint="abc",
                     predicted=predicted, now_s=10.0)
    store.create_run("r2", "j1", "pi-2", "verify", status="does_not_fit",
                     detail="budget 10 B is below the floor of 500 B", now_s=11.0)
    assert store.get_run("r1").status == "queued"

    store.update_run("r1", status="running", metrics={"accuracy_before": 0.5}, now_s=12.0)
    measured = {"step_s": 0.6, "peak_ram_bytes": 950, "energy_j": 1.7, "energy_source": "rapl"}
    done = store.update_run("r1", status="done", measured=measured,
                            metrics={"final_loss": 0.1, "accuracy_after": 0.9, "param_digest": "d", "events_emitted": 0,
                                     "max_rel_param_diff": 0.0}, now_s=13.0)
    assert done.metrics["accuracy_before"] == 0.5 and done.metrics["accuracy_after"] == 0.9  # merged
    assert (done.status, done.measured, done.predicted, done.updated_at_s) == ("done", measured, predicted, 13.0)

    with pytest.raises(StoreError, match="done; it cannot become running"):
        store.update_run("r1", status="running")
    store.update_run("r1", status="done")  # a result reported again is fine
    with pytest.raises(StoreError, match="not one of"):
        store.update_run("r1", status="finished")
    with pytest.raises(UnknownRunError):
        store.update_run("nope", status="running")
    with pytest.raises(StoreError, match="no job"):
        store.create_run("r3", "no-such-job", "pi-1", "train")
    with pytest.raises(StoreError, match="exists already"):
        store.create_run("r1", "j1", "pi-2", "train")
    with pytest.raises(StoreError, match="exists already"):
        store.create_job("j1", "train", {})

    assert [run.run_id for run in store.list_runs()] == ["r1", "r2"]
    assert [run.run_id for run in store.list_runs(status="does_not_fit")] == ["r2"]
    assert [run.run_id for run in store.list_runs(agent="pi-1", job_id="j1")] == ["r1"]
    assert store.list_runs(status=["queued", "running"]) == []

    entry = store.get_run("r1").as_json()
    required = {"run_id", "agent", "status", "ram_budget_bytes", "schedule_fingerprint", "predicted", "measured",
                "events_emitted", "events_stored", "final_loss", "accuracy_before", "accuracy_after", "param_digest",
                "max_rel_param_diff"}
    assert required <= set(entry)
    assert store.get_run("r2").as_json()["detail"].startswith("budget 10 B")

    before = store.get_run("r1")
    store.close()
    with RunStore(store_url) as reopened:  # everything is on disk / in the server
        assert reopened.get_run("r1") == before


# -- telemetry events ------------------------------------------------------------------------


def _shuffled_batches(seqs: list[int], rng: random.Random, duplicates: int) -> list[list[int]]:
    """``seqs`` plus ``duplicates`` repeats of random ones, shuffled, cut into batches of 1..17."""
    pool = seqs + [rng.choice(seqs) for _ in range(duplicates)]
    rng.shuffle(pool)
    batches = []
    while pool:
        size = rng.randint(1, 17)
        batches.append(pool[:size])
        pool = pool[size:]
    return batches


def test_events_are_idempotent_in_shuffled_batches_with_duplicates(store):
    _job_with_run(store)
    rng = random.Random(8)
    acks = []
    for batch in _shuffled_batches(list(range(1, 101)), rng, duplicates=60):
        acks.append(store.store_events("r1", [(seq, {"seq": seq, "step": seq // 10}) for seq in batch]))
        # a whole batch sent again (the agent never saw the ack) changes nothing
        assert store.store_events("r1", [(seq, {"seq": -1}) for seq in batch]) == acks[-1]
    assert acks == sorted(acks) and acks[-1] == 100
    assert store.events_stored("r1") == 100 and store.acked_seq("r1") == 100
    stored = store.get_events("r1")
    assert [seq for seq, _ in stored] == list(range(1, 101))
    assert all(payload == {"seq": seq, "step": seq // 10} for seq, payload in stored)  # the first payload wins
    assert store.store_events("r1", []) == 100
    with pytest.raises(StoreError, match="from 1"):
        store.store_events("r1", [(0, {})])
    with pytest.raises(UnknownRunError):
        store.store_events("no-such-run", [(1, {})])


def test_a_gap_holds_the_ack_until_it_is_filled(store):
    _job_with_run(store)
    rng = random.Random(50)
    without_50 = [seq for seq in range(1, 101) if seq != 50]
    for batch in _shuffled_batches(without_50, rng, duplicates=20):
        ack = store.store_events("r1", [(seq, {}) for seq in batch])
        assert ack <= 49
    assert ack == 49 and store.events_stored("r1") == 99
    assert store.store_events("r1", [(99, {}), (100, {})]) == 49  # resent after the gap: still 49
    assert store.store_events("r1", [(50, {})]) == 100
    assert store.events_stored("r1") == 100 and len(store.get_events("r1")) == 100
    assert [seq for seq, _ in store.get_events("r1", after_seq=97)] == [98, 99, 100]


def test_telemetry_steps_missing_are_the_step_ranges_without_a_stored_step_event(store):
    _job_with_run(store)
    assert store.telemetry_steps_missing("r1", 0) == [] and store.telemetry_steps_missing("r1", 3) == [(1, 3)]
    payloads = [{"instruction": {"node": "a"}}, {"step": {"step": 1, "loss": 2.0}}, {"rss": {"rss_bytes": "9"}},
                {"step": {"step": 2}}, {"step": {"step": 5}}, {"step": {"step": 6}}, {"step": {"step": 9}},
                {"step": {"step": 5}}]  # step 5 re-run after a resume: stored twice, under two seqs
    store.store_events("r1", list(enumerate(payloads, start=1)))
    assert store.telemetry_steps_missing("r1", 10) == [(3, 4), (7, 8), (10, 10)]
    store.store_events("r1", [(9, {"step": {"step": 3}}), (10, {"step": {"step": 4}}), (11, {"step": {"step": 7}}),
                              (12, {"step": {"step": 8}}), (13, {"step": {"step": 10}})])
    assert store.telemetry_steps_missing("r1", 10) == []


def test_concurrent_writers_store_each_event_once(store_url):
    """Two writers (each its own store, as two coordinator processes would be) send overlapping batches
    for the same run at the same time: every event is stored once, none is lost, the ack reaches the end."""
    with RunStore(store_url) as setup:
        _job_with_run(setup)
    total = 400
    errors: list[BaseException] = []
    acks: dict[int, list[int]] = {0: [], 1: []}
    barrier = threading.Barrier(2)

    def writer(index: int) -> None:
        try:
            with RunStore(store_url) as own:
                batches = _shuffled_batches(list(range(1, total + 1)), random.Random(index), duplicates=50)
                barrier.wait()
                for batch in batches:
                    acks[index].append(own.store_events("r1", [(seq, {"by": index}) for seq in batch]))
        except BaseException as error:  # noqa: B036 - reported below
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(index,), daemon=True) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck (a deadlock between the two)"
    assert not errors, errors
    with RunStore(store_url) as check:
        stored = check.get_events("r1")
        assert [seq for seq, _ in stored] == list(range(1, total + 1))
        assert check.events_stored("r1") == total and check.acked_seq("r1") == total
    for index in (0, 1):
        assert acks[index] == sorted(acks[index]) and acks[index][-1] == total


WRITER_PROCESS = """
import random, sys
from host.fleet.store import RunStore
url, seed, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
seqs = list(range(1, total + 1)) + [rng.randint(1, total) for _ in range(50)]
rng.shuffle(seqs)
sys.stdin.readline()  # start together
with RunStore(url) as store:
    last = 0
    while seqs:
        size = rng.randint(1, 17)
        ack, seqs = store.store_events("r1", [(seq, {"by": seed}) for seq in seqs[:size]]), seqs[size:]
        assert ack >= last, (ack, last)
        last = ack
print(last)
"""


def test_two_writer_processes_store_each_event_once(store_url):
    """The same as two coordinator processes: separate processes, so SQLite's file locks are really taken."""
    import subprocess
    import sys
    from pathlib import Path

    with RunStore(store_url) as setup:
        _job_with_run(setup)
    total = 300
    root = Path(store_module.__file__).resolve().parents[2]
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER_PROCESS, store_url, str(seed), str(total)], cwd=root,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for seed in (1, 2)
    ]
    for writer in writers:  # both have imported and opened their pipes: release them together
        writer.stdin.write("go\n")
        writer.stdin.flush()
    outputs = [writer.communicate(timeout=120) for writer in writers]
    for writer, (out, err) in zip(writers, outputs, strict=True):
        assert writer.returncode == 0, err
        assert out.strip() == str(total)
    with RunStore(store_url) as check:
        assert [seq for seq, _ in check.get_events("r1")] == list(range(1, total + 1))
        assert check.events_stored("r1") == total and check.acked_seq("r1") == total


def test_coordinators_opening_a_new_store_at_once_all_succeed(new_store_url, request):
    """Three open the same new store at the same moment: one creates the schema (and, on SQLite, switches
    the file to WAL), the others wait and find it done. Repeated, since the race is narrow."""
    rounds = 40 if "sqlite" in request.node.name else 3
    for _round in range(rounds):
        url = new_store_url()
        errors: list[BaseException] = []
        barrier = threading.Barrier(3)

        def opener(url: str = url, errors: list = errors, barrier: threading.Barrier = barrier) -> None:
            try:
                barrier.wait()
                RunStore(url).close()
            except BaseException as error:  # noqa: B036 - reported below
                errors.append(error)

        threads = [threading.Thread(target=opener, daemon=True) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads), "a thread is stuck (a deadlock between openers)"
        assert not errors, errors
        with RunStore(url) as opened:
            assert opened.schema_revision() == RunStore.head_revision()


# -- profile versions ------------------------------------------------------------------------


def test_profile_versions(store):
    store.register_agent("pi-1", "a72", FACTS)
    assert store.latest_profile("pi-1") is None
    first = store.add_profile_version("pi-1", {"name": "pi-1", "flops_per_s": 1e9})
    second = store.add_profile_version("pi-1", {"name": "pi-1", "flops_per_s": 2e9})
    assert (first.version, second.version) == (1, 2)
    latest = store.latest_profile("pi-1")
    assert latest.version == 2 and latest.profile["flops_per_s"] == 2e9
    with pytest.raises(UnknownAgentError):
        store.add_profile_version("nobody", {})
    assert first.provenance == {} and store.get_profile_version("pi-1", 1).profile["flops_per_s"] == 1e9
    third = store.add_profile_version("pi-1", {"name": "pi-1"}, provenance={"source": "calibration", "runs": ["r1"]})
    assert store.get_profile_version("pi-1", 3).provenance == third.provenance == {"source": "calibration", "runs": ["r1"]}
    assert store.get_profile_version("pi-1", 4) is None
    store.register_agent("pi-2", "a72", FACTS)
    store.add_profile_version("pi-2", {"name": "pi-2"})
    assert [(v.agent, v.version) for v in store.list_profile_versions()] == [("pi-1", 1), ("pi-1", 2), ("pi-1", 3),
                                                                             ("pi-2", 1)]
    assert [v.version for v in store.list_profile_versions("pi-2")] == [1]


# -- migrations ------------------------------------------------------------------------------


def _columns(url: str) -> dict[str, set[str]]:
    engine = sa.create_engine(store_module.parse_url(url))
    try:
        inspector = sa.inspect(engine)
        return {
            table: {column["name"] for column in inspector.get_columns(table)}
            for table in inspector.get_table_names() if table != "alembic_version"
        }
    finally:
        engine.dispose()


def test_a_store_at_the_first_revision_is_upgraded_on_open_and_reopening_is_a_no_op(store_url, caplog):
    from alembic import command

    engine = sa.create_engine(store_module.parse_url(store_url))
    try:
        with engine.begin() as conn:
            command.upgrade(alembic_config(conn), "0001")
            conn.execute(sa.text(
                "INSERT INTO agents (name, platform, facts, registered_at_s, last_seen_at_s, removed) "
                "VALUES ('old-pi', 'a72', '{\"ram_total_bytes\": 1024}', 1.0, 2.0, false)"
            ))
            conn.execute(sa.text("INSERT INTO jobs (job_id, kind, spec, created_at_s) VALUES ('j0', 'train', '{}', 1.0)"))
            conn.execute(sa.text(
                "INSERT INTO runs (run_id, job_id, agent, kind, status, metrics, created_at_s, updated_at_s) "
                "VALUES ('r0', 'j0', 'old-pi', 'train', 'running', '{}', 1.0, 1.0)"
            ))
    finally:
        engine.dispose()
    assert "profile_versions" not in _columns(store_url)

    caplog.set_level(logging.INFO, logger="alembic")
    with RunStore(store_url) as opened:
        assert opened.schema_revision() == RunStore.head_revision() == "0004"
        assert opened.get_agent("old-pi").facts == {"ram_total_bytes": 1024}
        assert opened.store_events("r0", [(1, {}), (2, {})]) == 2
        assert opened.add_profile_version("old-pi", {"flops_per_s": 1.0}).version == 1
    assert "Running upgrade 0001 -> 0002" in caplog.text and "Running upgrade 0002 -> 0003" in caplog.text
    assert "Running upgrade 0003 -> 0004" in caplog.text

    schema = _columns(store_url)
    caplog.clear()
    with RunStore(store_url) as again:
        assert again.schema_revision() == "0004"
        assert again.events_stored("r0") == 2 and again.latest_profile("old-pi").version == 1
    assert "Running upgrade" not in caplog.text
    assert _columns(store_url) == schema
    # the Table objects the queries use describe exactly the schema the migrations build
    assert schema == {table.name: {column.name for column in table.columns} for table in store_module.metadata.sorted_tables}


def test_a_store_at_revision_0002_keeps_its_profile_versions_and_reads_no_provenance_as_empty(store_url):
    from alembic import command

    engine = sa.create_engine(store_module.parse_url(store_url))
    try:
        with engine.begin() as conn:
            command.upgrade(alembic_config(conn), "0002")
            conn.execute(sa.text(
                "INSERT INTO agents (name, platform, facts, registered_at_s, last_seen_at_s, removed) "
                "VALUES ('old-pi', 'a72', '{}', 1.0, 2.0, false)"
            ))
            conn.execute(sa.text(
                "INSERT INTO profile_versions (agent, version, profile, created_at_s) "
                "VALUES ('old-pi', 1, '{\"name\": \"old\"}', 3.0)"
            ))
    finally:
        engine.dispose()
    assert "provenance" not in _columns(store_url)["profile_versions"]
    with RunStore(store_url) as opened:
        assert opened.schema_revision() == "0004"
        old = opened.latest_profile("old-pi")
        assert (old.version, old.profile, old.created_at_s, old.provenance) == (1, {"name": "old"}, 3.0, {})
        new = opened.add_profile_version("old-pi", {"name": "new"}, provenance={"source": "profile-job"})
        assert new.version == 2 and opened.get_profile_version("old-pi", 2).provenance == {"source": "profile-job"}
    assert "provenance" in _columns(store_url)["profile_versions"]


def test_a_store_from_a_newer_release_is_refused(store_url):
    RunStore(store_url).close()
    engine = sa.create_engine(store_module.parse_url(store_url))
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0099'"))
    engine.dispose()
    with pytest.raises(StoreError, match="'0099'.*newer release"):
        RunStore(store_url)


# -- URLs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "says"), [
    ("not a url at all", "not a database URL"),
    ("mysql://u@h/db", "backend 'mysql' is not supported"),
    ("postgresql+psycopg2://u:hunter2@h/db", "psycopg 3"),
    ("postgresql+psycopg://u@h:5432", "names no database"),
    ("sqlite://", "not a SQLite file"),
    ("sqlite:///:memory:", "not a SQLite file"),
    ("sqlite://state/poet.db", "has a host"),
])
def test_a_malformed_url_names_the_url_and_the_fix(url, says):
    with pytest.raises(StoreError) as caught:
        RunStore(url)
    message = str(caught.value)
    assert says in message
    assert "hunter2" not in message  # passwords are never shown
    assert url.replace("hunter2", "***") in message
    if says != "psycopg 3":
        assert "postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE" in message


def test_a_sqlite_store_in_a_missing_directory_says_so(tmp_path):
    with pytest.raises(StoreError, match="does not exist; create it"):
        RunStore(sqlite_url(tmp_path / "missing"))


def test_sqlite_store_is_a_wal_file_with_foreign_keys(tmp_path):
    with RunStore(sqlite_url(tmp_path)) as store:
        with store._read() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        store.create_job("j1", "train", {})
        with pytest.raises(StoreError):  # no agent 'ghost': refused before the foreign key would be
            store.create_run("r1", "j1", "ghost", "train")
        with pytest.raises(sa.exc.IntegrityError), store._write() as conn:
            conn.execute(sa.insert(store_module.events).values(run_id="ghost-run", seq=1, payload={}, stored_at_s=0.0))
    assert (tmp_path / "poet.db").is_file()


def test_a_submission_is_stored_whole_or_not_at_all(store):
    store.register_agent("pi-1", "a72", FACTS)
    store.register_agent("pi-3", "a72", FACTS)
    store.remove_agent("pi-3")
    runs = [{"run_id": "run-a", "agent": "pi-1", "metrics": {"steps_done": 0}, "ram_budget_bytes": 1000},
            {"run_id": "run-c", "agent": "pi-3"}]
    with pytest.raises(AgentRemovedError, match="'pi-3' was removed"):
        store.create_submission("job-1", "train", {"steps": 3}, runs)
    assert store.list_runs() == []  # pi-1's run was not left behind
    with pytest.raises(StoreError, match="no job 'job-1'"):
        store.get_job("job-1")
    [stored] = store.create_submission("job-1", "train", {"steps": 3}, runs[:1])
    assert (stored.run_id, stored.agent, stored.status, stored.ram_budget_bytes, stored.metrics) == (
        "run-a", "pi-1", "queued", 1000, {"steps_done": 0})
    assert store.get_job("job-1").spec == {"steps": 3}


def test_a_store_at_revision_0003_keeps_its_runs_and_events_and_takes_solving_runs(store_url):
    """0004 widens the runs' status check. SQLite cannot alter a check, and copying the runs table (Alembic's batch
    mode) would cascade-delete every telemetry event: the events must survive, and the check must still refuse
    a status that is not one."""
    from alembic import command

    engine = sa.create_engine(store_module.parse_url(store_url))
    try:
        with engine.begin() as conn:
            if engine.dialect.name == "sqlite":
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")
            command.upgrade(alembic_config(conn), "0003")
            conn.execute(sa.text(
                "INSERT INTO agents (name, platform, facts, registered_at_s, last_seen_at_s, removed) "
                "VALUES ('old-pi', 'a72', '{}', 1.0, 2.0, false)"
            ))
            conn.execute(sa.text("INSERT INTO jobs (job_id, kind, spec, created_at_s) VALUES ('j0', 'train', '{}', 1.0)"))
            conn.execute(sa.text(
                "INSERT INTO runs (run_id, job_id, agent, kind, status, metrics, created_at_s, updated_at_s) "
                "VALUES ('r0', 'j0', 'old-pi', 'train', 'running', '{}', 1.0, 1.0)"
            ))
            conn.execute(sa.text("INSERT INTO events (run_id, seq, payload, stored_at_s) VALUES ('r0', 1, '{}', 1.0)"))
    finally:
        engine.dispose()
    with RunStore(store_url) as opened:
        assert opened.schema_revision() == "0004"
        assert len(opened.get_events("r0")) == 1 and opened.get_run("r0").status == "running"
        [run] = opened.create_submission("j1", "train", {}, [{"run_id": "r1", "agent": "old-pi", "status": "solving",
                                                              "metrics": {"schedule_key": "k"}}],
                                         solve_problems={"k": {"label": "x"}})
        assert run.status == "solving" and [s.state for s in opened.list_solves()] == ["pending"]
    engine = sa.create_engine(store_module.parse_url(store_url))
    try:
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(sa.text("UPDATE runs SET status = 'bogus' WHERE run_id = 'r0'"))
    finally:
        engine.dispose()


# -- solves ----------------------------------------------------------------------------------


def _solving_submission(store: RunStore, job_id: str, keys: dict[str, str]) -> list:
    """A job with one 'solving' run per agent of ``keys`` (agent -> schedule key), its solves queued."""
    for agent in keys:
        store.register_agent(agent, "a72", FACTS)
    runs = [{"run_id": f"{job_id}-{agent}", "agent": agent, "status": "solving", "metrics": {"schedule_key": key}}
            for agent, key in keys.items()]
    return store.create_submission(job_id, "train", {}, runs,
                                   solve_problems={key: {"label": key} for key in keys.values()})


QUEUED_RESULT = {"status": "queued", "schedule_json": "{}", "schedule_fingerprint": "f1",
                 "predicted": {"step_s": 1.0}, "metrics": {"recomputes": 3, "page_ins": 1, "page_outs": 1}}


def test_a_solve_is_queued_once_per_key_and_its_result_reaches_every_run_waiting_for_it(store):
    runs = _solving_submission(store, "j1", {"pi-1": "k1", "pi-2": "k1", "pi-3": "k2"})
    assert [r.status for r in runs] == ["solving"] * 3
    assert [(s.schedule_key, s.state) for s in store.list_solves()] == [("k1", "pending"), ("k2", "pending")]
    claimed = store.claim_solve("w1", lease_s=30, now_s=100.0)
    assert (claimed.schedule_key, claimed.state, claimed.claimed_by, claimed.lease_until_s) == ("k1", "claimed", "w1", 130.0)
    changed = store.finish_solve("k1", QUEUED_RESULT)
    assert sorted(r.run_id for r in changed) == ["j1-pi-1", "j1-pi-2"]
    one = store.get_run("j1-pi-1")
    assert (one.status, one.schedule_fingerprint, one.predicted, one.run_metrics.recomputes) == ("queued", "f1",
                                                                                               {"step_s": 1.0}, 3)
    assert store.get_run("j1-pi-3").status == "solving"
    assert store.finish_solve("k1", {**QUEUED_RESULT, "schedule_fingerprint": "other"}) == []  # the first stands
    # a later submission of a solved case takes the result in the same transaction: no solving run, no solve
    [again] = _solving_submission(store, "j2", {"pi-1": "k1"})
    assert (again.status, again.schedule_fingerprint) == ("queued", "f1")
    assert len(store.list_solves()) == 2


def test_a_claim_whose_lease_ran_out_is_taken_over_and_a_released_one_is_claimable_at_once(store):
    _solving_submission(store, "j1", {"pi-1": "k1"})
    assert store.claim_solve("w1", lease_s=30, now_s=100.0).schedule_key == "k1"
    assert store.claim_solve("w2", lease_s=30, now_s=120.0) is None  # w1's lease holds until 130
    assert store.renew_solve("k1", "w1", lease_s=30, now_s=125.0)  # ... and now until 155
    assert store.claim_solve("w2", lease_s=30, now_s=150.0) is None
    taken = store.claim_solve("w2", lease_s=30, now_s=156.0)  # w1 died: its lease ran out
    assert (taken.schedule_key, taken.claimed_by) == ("k1", "w2")
    assert not store.renew_solve("k1", "w1", lease_s=30)  # w1 learns it lost the claim
    assert not store.release_solve("k1", "w1") and store.release_solve("k1", "w2")
    assert store.claim_solve("w3", lease_s=30, now_s=157.0).claimed_by == "w3"


def test_workers_claiming_at_once_each_get_a_different_solve(store):
    import concurrent.futures

    _solving_submission(store, "j1", {f"pi-{i}": f"k{i}" for i in range(12)})
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        claims = list(pool.map(lambda i: store.claim_solve(f"w{i}", lease_s=30), range(12)))
    keys = [c.schedule_key for c in claims if c is not None]
    assert sorted(keys) == sorted(f"k{i}" for i in range(12))  # every solve claimed exactly once
    assert store.claim_solve("late", lease_s=30) is None


def test_a_failed_solve_fails_the_runs_waiting_and_is_solved_again_next_time(store):
    _solving_submission(store, "j1", {"pi-1": "k1"})
    store.claim_solve("w1", lease_s=30)
    [failed] = store.finish_solve("k1", {"status": "failed", "detail": "the solver found no schedule (timeout)"})
    assert failed.status == "failed" and "timeout" in failed.detail
    assert store.list_solves() == []  # forgotten: a failure is not an answer
    [again] = _solving_submission(store, "j2", {"pi-1": "k1"})
    assert again.status == "solving" and [s.state for s in store.list_solves()] == ["pending"]


def test_a_solve_recorded_outside_the_queue_reaches_the_runs_already_waiting_for_it(store):
    _solving_submission(store, "j1", {"pi-1": "k1"})
    store.record_solve("k1", {"label": "k1"}, QUEUED_RESULT)  # e.g. calibration solved the same case meanwhile
    run = store.get_run("j1-pi-1")
    assert (run.status, run.schedule_fingerprint) == ("queued", "f1")
    assert store.get_solve("k1").state == "done"
