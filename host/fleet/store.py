"""The coordinator's run store: agents, jobs, runs, telemetry events and profile versions.

Written through SQLAlchemy Core, so one code path serves both backends:

- SQLite by default, a file in the coordinator's state dir (:func:`sqlite_url`), in WAL mode with
  foreign keys on. Every writing transaction starts with ``BEGIN IMMEDIATE``, so two writers (two
  threads, or two coordinator processes on the same file) queue on the file lock instead of
  failing halfway with "database is locked".
- PostgreSQL by URL (``postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB``; a plain
  ``postgresql://`` URL is read as psycopg 3), for several coordinator processes or many boards.
  Writers that must not interleave lock the run's row (``SELECT ... FOR UPDATE``).

The schema is versioned with Alembic (``host/fleet/migrations``, shipped in the wheel). Opening a
store upgrades it to this release's head inside one transaction, so a store made by an older
release opens in this one; opening an up-to-date store changes nothing; a store made by a newer
release is refused with a message saying so.

Times are UTC seconds since the epoch as floats, in fields ending ``_s`` (``time.time()``).

Telemetry is durable end to end: a board numbers its events 1, 2, 3, ... and resends from the last
acknowledgement after a reconnect. :meth:`RunStore.store_events` drops what it already has and
returns the highest *contiguous* sequence number stored from 1, which is what the coordinator
acknowledges: an event after a gap is kept, but is not acknowledged until the gap is filled.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from host.fleet.metrics import NAMES as METRIC_NAMES
from host.fleet.metrics import RunMetrics
from host.fleet.status import FINISHED, TRANSITIONS, RunStatus

log = logging.getLogger("poet.fleet")
RUN_STATUSES = tuple(s.value for s in RunStatus)  # as stored (the runs table's check constraint names them too)
TERMINAL_STATUSES = FINISHED
RUN_KINDS = ("train", "verify", "profile")
DB_FILE_NAME = "poet.db"
MIGRATIONS_DIR = Path(__file__).with_name("migrations")
_URL_HELP = (
    "expected sqlite:///PATH/TO/poet.db (the default: a file in --state-dir) or "
    "postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE"
)
_SQLITE_BUSY_TIMEOUT_S = 30.0
_EVENT_LOOKUP_CHUNK = 500  # bound parameters per IN (...) query, far below SQLite's limit
_PG_MIGRATION_LOCK_KEY = 0x706F6574  # pg_advisory_xact_lock key: b"poet"
WORK_CHANNEL = "poet_work"  # PostgreSQL: NOTIFY'd when runs or solves were queued, for every process sharing the store
_LISTEN_RETRY_S = 1.0


class StoreError(RuntimeError):
    """A run store operation that cannot be done; the message says why and, where there is one, the fix."""


class AgentRemovedError(StoreError):
    """The agent was removed with ``poet fleet remove``: it may not register, heartbeat or be given work."""


class UnknownAgentError(StoreError):
    """No agent of this name has registered."""


class UnknownRunError(StoreError):
    """No run with this id."""


# The head schema, for queries. The migrations in host/fleet/migrations create it; a test checks
# that the two agree.
_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
metadata = sa.MetaData()
agents = sa.Table(
    "agents", metadata,
    sa.Column("name", sa.String(255), primary_key=True),
    sa.Column("platform", sa.String(255), nullable=False),
    sa.Column("facts", _JSON, nullable=False),
    sa.Column("registered_at_s", sa.Float(), nullable=False),
    sa.Column("last_seen_at_s", sa.Float(), nullable=False),
    sa.Column("removed", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.Column("removed_at_s", sa.Float(), nullable=True),
)
jobs = sa.Table(
    "jobs", metadata,
    sa.Column("job_id", sa.String(64), primary_key=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("spec", _JSON, nullable=False),
    sa.Column("created_at_s", sa.Float(), nullable=False),
)
runs = sa.Table(
    "runs", metadata,
    sa.Column("run_id", sa.String(64), primary_key=True),
    sa.Column("job_id", sa.String(64), sa.ForeignKey("jobs.job_id"), nullable=False, index=True),
    sa.Column("agent", sa.String(255), sa.ForeignKey("agents.name"), nullable=False, index=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("ram_budget_bytes", sa.BigInteger(), nullable=True),
    sa.Column("schedule_fingerprint", sa.String(128), nullable=True),
    sa.Column("predicted", _JSON, nullable=True),
    sa.Column("measured", _JSON, nullable=True),
    sa.Column("metrics", _JSON, nullable=False),
    sa.Column("detail", sa.Text(), nullable=True),
    sa.Column("events_stored", sa.BigInteger(), nullable=False, server_default="0"),
    sa.Column("events_acked_seq", sa.BigInteger(), nullable=False, server_default="0"),
    sa.Column("created_at_s", sa.Float(), nullable=False),
    sa.Column("updated_at_s", sa.Float(), nullable=False),
)
events = sa.Table(
    "events", metadata,
    sa.Column("run_id", sa.String(64), sa.ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True),
    sa.Column("seq", sa.BigInteger(), primary_key=True, autoincrement=False),
    sa.Column("payload", _JSON, nullable=False),
    sa.Column("stored_at_s", sa.Float(), nullable=False),
)
profile_versions = sa.Table(
    "profile_versions", metadata,
    sa.Column("agent", sa.String(255), sa.ForeignKey("agents.name"), primary_key=True),
    sa.Column("version", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("profile", _JSON, nullable=False),
    sa.Column("created_at_s", sa.Float(), nullable=False),
    sa.Column("provenance", _JSON, nullable=True),  # revision 0003; NULL (read as {}) for older versions
)
solves = sa.Table(  # revision 0004
    "solves", metadata,
    sa.Column("schedule_key", sa.String(64), primary_key=True),
    sa.Column("problem", _JSON, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("claimed_by", sa.String(255), nullable=True),
    sa.Column("lease_until_s", sa.Float(), nullable=True),
    sa.Column("result", _JSON, nullable=True),
    sa.Column("created_at_s", sa.Float(), nullable=False),
    sa.Column("finished_at_s", sa.Float(), nullable=True),
)


@dataclass(frozen=True)
class AgentRecord:
    name: str
    platform: str
    facts: dict[str, Any]  # ram_total_bytes, memory_limit_bytes, flash_free_bytes, meters, ... as reported
    registered_at_s: float
    last_seen_at_s: float
    removed: bool
    removed_at_s: float | None

    def online(self, now_s: float, heartbeat_timeout_s: float) -> bool:
        """Seen within ``heartbeat_timeout_s`` of ``now_s`` and not removed."""
        return not self.removed and now_s - self.last_seen_at_s <= heartbeat_timeout_s

    def as_json(self, now_s: float, heartbeat_timeout_s: float) -> dict[str, Any]:
        """The entry of ``poet fleet list --json``: the facts flattened beside the fixed fields."""
        return {
            **self.facts,
            "name": self.name,
            "platform": self.platform,
            "online": self.online(now_s, heartbeat_timeout_s),
            "ram_total_bytes": self.facts.get("ram_total_bytes"),
            "memory_limit_bytes": self.facts.get("memory_limit_bytes"),
            "flash_free_bytes": self.facts.get("flash_free_bytes"),
            "meters": self.facts.get("meters", []),
            "registered_at_s": self.registered_at_s,
            "last_seen_at_s": self.last_seen_at_s,
        }


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    kind: str
    spec: dict[str, Any]  # model, dataset, steps, optimizer, hyperparameters, collect, ... as submitted
    created_at_s: float


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    job_id: str
    agent: str
    kind: str
    status: RunStatus
    ram_budget_bytes: int | None
    schedule_fingerprint: str | None
    predicted: dict[str, Any] | None  # step_s, peak_ram_bytes, energy_j (+ its source label)
    measured: dict[str, Any] | None
    metrics: dict[str, Any]  # the stored JSON of host.fleet.metrics.RunMetrics: read it typed as run_metrics
    detail: str | None  # why a run failed or does not fit (with the minimum budget)
    events_stored: int
    events_acked_seq: int
    created_at_s: float
    updated_at_s: float

    @property
    def run_metrics(self) -> RunMetrics:
        """The metrics as typed fields."""
        return RunMetrics.of(self.metrics)

    def as_json(self) -> dict[str, Any]:
        """The entry of ``poet runs list --json``: the metrics flattened beside the fixed fields."""
        return {
            **self.metrics,
            "run_id": self.run_id,
            "job_id": self.job_id,
            "agent": self.agent,
            "kind": self.kind,
            "status": self.status,
            "ram_budget_bytes": self.ram_budget_bytes,
            "schedule_fingerprint": self.schedule_fingerprint,
            "predicted": self.predicted,
            "measured": self.measured,
            "events_emitted": self.metrics.get("events_emitted"),
            "events_stored": self.events_stored,
            "final_loss": self.metrics.get("final_loss"),
            "accuracy_before": self.metrics.get("accuracy_before"),
            "accuracy_after": self.metrics.get("accuracy_after"),
            "param_digest": self.metrics.get("param_digest"),
            "detail": self.detail,
            "created_at_s": self.created_at_s,
            "updated_at_s": self.updated_at_s,
        }


@dataclass(frozen=True)
class ProfileVersion:
    agent: str
    version: int  # 1, 2, ... per agent
    profile: dict[str, Any]  # a PlatformProfile as JSON
    created_at_s: float
    provenance: dict[str, Any] = field(default_factory=dict)  # source, agent, job/run ids, time, fit errors


@dataclass(frozen=True)
class SolveRecord:
    """One distinct schedule to solve (host/fleet/solving.py): the runs that wait for it name it by schedule_key."""

    schedule_key: str
    problem: dict[str, Any]  # everything a solver worker needs: graph, profile, budget, settings (JSON)
    state: str  # pending | claimed | done
    claimed_by: str | None  # the worker solving it
    lease_until_s: float | None  # a claim not renewed by then is taken over by another worker
    result: dict[str, Any] | None  # when done: the runs' status, detail, schedule and prediction
    created_at_s: float
    finished_at_s: float | None


_UNSET: Any = object()  # "not given" for fields whose new value may be None


def sqlite_url(state_dir: str | Path) -> str:
    """The default store: ``STATE_DIR/poet.db``."""
    return f"sqlite:///{Path(state_dir).resolve() / DB_FILE_NAME}"


def _redact(url: str) -> str:
    """The URL with any password replaced by ***, for messages."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def parse_url(url: str) -> sa.URL:
    """A store URL checked and normalised; :class:`StoreError` naming the URL and the accepted forms otherwise."""
    shown = _redact(str(url))
    try:
        parsed = sa.make_url(url)
    except Exception as error:  # ArgumentError for text that is no URL at all
        raise StoreError(f"run store URL {shown!r} is not a database URL ({error}); {_URL_HELP}") from None
    backend, _, driver = parsed.drivername.partition("+")
    if backend in ("postgresql", "postgres"):
        if driver not in ("", "psycopg"):
            raise StoreError(
                f"run store URL {shown!r} names the driver {driver!r}; poet-edge talks to PostgreSQL through "
                f"psycopg 3: write postgresql+psycopg://..."
            )
        parsed = parsed.set(drivername="postgresql+psycopg")
        if not parsed.database:
            raise StoreError(f"run store URL {shown!r} names no database; {_URL_HELP}")
    elif backend == "sqlite":
        if driver not in ("", "pysqlite"):
            raise StoreError(f"run store URL {shown!r} names the SQLite driver {driver!r}; {_URL_HELP}")
        if not parsed.database or parsed.database == ":memory:" or parsed.database.startswith("file:"):
            raise StoreError(
                f"run store URL {shown!r} is not a SQLite file; the run store must outlive the coordinator: {_URL_HELP}"
            )
        if parsed.host:
            raise StoreError(
                f"run store URL {shown!r} has a host ({parsed.host!r}): a SQLite URL has three slashes and then "
                f"the path, e.g. sqlite:////var/lib/poet/poet.db for an absolute path; {_URL_HELP}"
            )
    else:
        raise StoreError(f"run store URL {shown!r}: backend {backend!r} is not supported; {_URL_HELP}")
    return parsed


def alembic_config(connection: sa.Connection | None = None):
    """An Alembic Config for the run store's migrations, built in code (no alembic.ini)."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def _now_s() -> float:
    return time.time()


class RunStore:
    """The run store at ``url``, upgraded to this release's schema when it opens.

    Thread-safe: each call takes a connection from the engine's pool and runs in its own
    transaction. Close it with :meth:`close` (or use it as a context manager).
    """

    def __init__(self, url: str):
        parsed = parse_url(url)
        self.url = parsed.render_as_string(hide_password=True)
        self.backend = parsed.get_backend_name()
        if self.backend == "sqlite":
            path = Path(parsed.database)
            if not path.parent.is_dir():
                raise StoreError(
                    f"run store {self.url!r}: the directory {str(path.parent)!r} does not exist; create it "
                    f"(the coordinator's --state-dir) or give another --store"
                )
            self._engine = sa.create_engine(parsed, connect_args={"timeout": _SQLITE_BUSY_TIMEOUT_S})
            _install_sqlite_hooks(self._engine)
            # Writers of this process queue here instead of in SQLite's busy handler, which sleeps up to
            # 100 ms per retry: with 64 telemetry streams that sleeping, not the work, bounded the rate.
            self._write_lock = threading.Lock()
        else:
            self._engine = sa.create_engine(parsed, pool_pre_ping=True)
            self._write_lock = contextlib.nullcontext()  # row locks let PostgreSQL writers run side by side
        try:
            self._upgrade()
        except StoreError:
            self._engine.dispose()
            raise
        except sa.exc.OperationalError as error:
            self._engine.dispose()
            raise StoreError(f"run store {self.url!r} cannot be opened: {error.orig}") from error
        except BaseException:
            self._engine.dispose()
            raise

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def schema_revision(self) -> str | None:
        """The Alembic revision the database is at."""
        from alembic.migration import MigrationContext

        with self._read() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    @staticmethod
    def head_revision() -> str:
        from alembic.script import ScriptDirectory

        return ScriptDirectory.from_config(alembic_config()).get_current_head()

    def _upgrade(self) -> None:
        from alembic import command
        from alembic.migration import MigrationContext
        from alembic.script import ScriptDirectory

        script = ScriptDirectory.from_config(alembic_config())
        head = script.get_current_head()
        with self._write() as conn:
            if self.backend == "postgresql":  # two coordinators opening at once upgrade one after the other
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK_KEY})
            current = MigrationContext.configure(conn).get_current_revision()
            if current == head:
                return
            if current is not None and current not in {rev.revision for rev in script.walk_revisions()}:
                raise StoreError(
                    f"run store {self.url!r} has schema revision {current!r}, which this poet-edge does not know "
                    f"(it was written by a newer release; its head is {head!r}): upgrade poet-edge, or use another --store"
                )
            if current is None and sa.inspect(conn).has_table("runs"):
                raise StoreError(
                    f"run store {self.url!r} has a 'runs' table but no schema revision: it was not made by "
                    f"poet-edge; use another --store"
                )
            command.upgrade(alembic_config(conn), "head")

    @contextmanager
    def _write(self) -> Iterator[sa.Connection]:
        """A writing transaction (SQLite: BEGIN IMMEDIATE, so writers queue on the lock up front)."""
        with self._write_lock, self._engine.begin() as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[sa.Connection]:
        """A reading transaction (SQLite: a deferred BEGIN, which takes no write lock)."""
        with self._engine.connect().execution_options(poet_read_only=True) as conn, conn.begin():
            yield conn

    # -- agents ----------------------------------------------------------------------------------

    def register_agent(self, name: str, platform: str, facts: Mapping[str, Any], now_s: float | None = None) -> AgentRecord:
        """Register ``name``, or update its platform and facts when it registers again (after a restart)."""
        now_s = _now_s() if now_s is None else now_s
        with self._write() as conn:
            row = conn.execute(sa.select(agents).where(agents.c.name == name).with_for_update()).first()
            if row is None:
                conn.execute(sa.insert(agents).values(
                    name=name, platform=platform, facts=dict(facts), registered_at_s=now_s, last_seen_at_s=now_s,
                    removed=False, removed_at_s=None,
                ))
            else:
                _refuse_removed(row)
                conn.execute(sa.update(agents).where(agents.c.name == name).values(
                    platform=platform, facts=dict(facts), last_seen_at_s=now_s,
                ))
            return _agent(conn.execute(sa.select(agents).where(agents.c.name == name)).one())

    def touch_agent(self, name: str, now_s: float | None = None) -> None:
        """A heartbeat: the agent was seen at ``now_s``."""
        now_s = _now_s() if now_s is None else now_s
        with self._write() as conn:
            _refuse_removed(self._agent_row(conn, name))
            conn.execute(sa.update(agents).where(agents.c.name == name).values(last_seen_at_s=now_s))

    def remove_agent(self, name: str, now_s: float | None = None) -> None:
        """``poet fleet remove``: the agent is refused from now on; its runs and profiles stay in the store."""
        now_s = _now_s() if now_s is None else now_s
        with self._write() as conn:
            row = self._agent_row(conn, name)
            if not row.removed:
                conn.execute(sa.update(agents).where(agents.c.name == name).values(removed=True, removed_at_s=now_s))

    def is_removed(self, name: str) -> bool:
        with self._read() as conn:
            removed = conn.execute(sa.select(agents.c.removed).where(agents.c.name == name)).scalar_one_or_none()
        return bool(removed)

    def get_agent(self, name: str) -> AgentRecord:
        with self._read() as conn:
            return _agent(self._agent_row(conn, name))

    def list_agents(self, include_removed: bool = False) -> list[AgentRecord]:
        query = sa.select(agents).order_by(agents.c.name)
        if not include_removed:
            query = query.where(agents.c.removed == sa.false())
        with self._read() as conn:
            return [_agent(row) for row in conn.execute(query)]

    def _agent_row(self, conn: sa.Connection, name: str) -> sa.Row:
        row = conn.execute(sa.select(agents).where(agents.c.name == name)).first()
        if row is None:
            raise UnknownAgentError(f"no agent named {name!r} has registered (see `poet fleet list`)")
        return row

    # -- jobs and runs ---------------------------------------------------------------------------

    def create_job(self, job_id: str, kind: str, spec: Mapping[str, Any], now_s: float | None = None) -> JobRecord:
        _check_kind(kind)
        now_s = _now_s() if now_s is None else now_s
        with self._write() as conn:
            _insert_job(conn, job_id, kind, spec, now_s)
        return JobRecord(job_id, kind, dict(spec), now_s)

    def get_job(self, job_id: str) -> JobRecord:
        with self._read() as conn:
            row = conn.execute(sa.select(jobs).where(jobs.c.job_id == job_id)).first()
        if row is None:
            raise StoreError(f"no job {job_id!r}")
        return JobRecord(row.job_id, row.kind, row.spec, row.created_at_s)

    def create_run(
        self, run_id: str, job_id: str, agent: str, kind: str, *, status: str = RunStatus.QUEUED,
        ram_budget_bytes: int | None = None, schedule_fingerprint: str | None = None,
        predicted: Mapping[str, Any] | None = None, detail: str | None = None, now_s: float | None = None,
    ) -> RunRecord:
        """A run of job ``job_id`` on ``agent`` (one per board). A removed agent gets no runs."""
        _check_kind(kind)
        status = _check_status(status)
        now_s = _now_s() if now_s is None else now_s
        with self._write() as conn:
            _refuse_removed(self._agent_row(conn, agent))
            if conn.execute(sa.select(jobs.c.job_id).where(jobs.c.job_id == job_id)).first() is None:
                raise StoreError(f"run {run_id!r}: no job {job_id!r} (create_job first)")
            _insert_run(conn, {"run_id": run_id, "agent": agent, "status": status, "ram_budget_bytes": ram_budget_bytes,
                               "schedule_fingerprint": schedule_fingerprint, "predicted": predicted,
                               "detail": detail}, job_id, kind, now_s)
            return _run(self._run_row(conn, run_id))

    def create_submission(self, job_id: str, kind: str, spec: Mapping[str, Any], run_specs: list[Mapping[str, Any]],
                          now_s: float | None = None, solve_problems: Mapping[str, Mapping[str, Any]] | None = None,
                          ) -> list[RunRecord]:
        """A job and its runs (one per board) in one transaction: all are stored, or none.

        Each of ``run_specs`` has ``run_id`` and ``agent``, and may have ``status`` (queued), ``ram_budget_bytes``,
        ``schedule_fingerprint``, ``predicted``, ``detail`` and ``metrics``. A removed or unknown agent, a run id in
        use or a bad value refuses the whole submission (nothing of it is stored).

        ``solve_problems`` (schedule key -> problem) are the schedules the submission's 'solving' runs wait for:
        each is queued unless the store has it already (another submission's, pending or solved); one solved
        already is applied to the runs before this returns."""
        _check_kind(kind)
        now_s = _now_s() if now_s is None else now_s
        with self._write() as conn:
            _insert_job(conn, job_id, kind, spec, now_s)
            for run in run_specs:
                _refuse_removed(self._agent_row(conn, run["agent"]))
                _insert_run(conn, run, job_id, kind, now_s)
            problems = solve_problems or {}
            for key in sorted(problems):  # one order for every writer: no two transactions wait on each other's rows
                self._insert_solve(conn, key, problems[key], now_s)  # unless another writer stored it first
                row = conn.execute(sa.select(solves).where(solves.c.schedule_key == key).with_for_update()).one()
                if row.state == "done":
                    _apply_solve(conn, key, row.result, now_s)
            self._notify_work(conn)
            return [_run(self._run_row(conn, run["run_id"])) for run in run_specs]

    def update_run(
        self, run_id: str, *, status: str | None = None, ram_budget_bytes: int | None = _UNSET,
        schedule_fingerprint: str | None = _UNSET, predicted: Mapping[str, Any] | None = _UNSET,
        measured: Mapping[str, Any] | None = _UNSET, metrics: Mapping[str, Any] | None = None,
        detail: str | None = _UNSET, now_s: float | None = None,
    ) -> RunRecord:
        """Change the given fields. ``metrics`` is merged into the stored metrics (a key set to None stays,
        as null); the other fields are replaced. A finished run (done, failed, does_not_fit) keeps its status."""
        now_s = _now_s() if now_s is None else now_s
        with self._write() as conn:
            row = self._run_row(conn, run_id, for_update=True)
            values: dict[str, Any] = {"updated_at_s": now_s}
            if status is not None:
                status = _check_status(status)
                if status not in TRANSITIONS[RunStatus(row.status)]:
                    raise StoreError(f"run {run_id!r} is {row.status}; it cannot become {status}")
                values["status"] = status
            for key, value in (
                ("ram_budget_bytes", ram_budget_bytes), ("schedule_fingerprint", schedule_fingerprint),
                ("predicted", predicted), ("measured", measured), ("detail", detail),
            ):
                if value is not _UNSET:
                    values[key] = dict(value) if isinstance(value, Mapping) else value
            if metrics is not None:
                values["metrics"] = {**row.metrics, **_check_metrics(metrics)}
            conn.execute(sa.update(runs).where(runs.c.run_id == run_id).values(**values))
            return _run(self._run_row(conn, run_id))

    def get_run(self, run_id: str) -> RunRecord:
        with self._read() as conn:
            return _run(self._run_row(conn, run_id))

    def list_runs(
        self, *, job_id: str | None = None, agent: str | None = None, status: str | Iterable[str] | None = None
    ) -> list[RunRecord]:
        """Runs, oldest first, optionally only those of a job, an agent or with the given status(es)."""
        query = sa.select(runs).order_by(runs.c.created_at_s, runs.c.run_id)
        if job_id is not None:
            query = query.where(runs.c.job_id == job_id)
        if agent is not None:
            query = query.where(runs.c.agent == agent)
        if status is not None:
            statuses = [status] if isinstance(status, str) else list(status)
            statuses = [_check_status(each) for each in statuses]
            query = query.where(runs.c.status.in_(statuses))
        with self._read() as conn:
            return [_run(row) for row in conn.execute(query)]

    def _run_row(self, conn: sa.Connection, run_id: str, for_update: bool = False) -> sa.Row:
        query = sa.select(runs).where(runs.c.run_id == run_id)
        row = conn.execute(query.with_for_update() if for_update else query).first()
        if row is None:
            raise UnknownRunError(f"no run {run_id!r} (see `poet runs list`)")
        return row

    # -- solves ----------------------------------------------------------------------------------

    def _insert_solve(self, conn: sa.Connection, key: str, problem: Mapping[str, Any], now_s: float,
                      result: Mapping[str, Any] | None = None) -> None:
        """Queue a solve (or record one done), unless another writer stored the key first."""
        dialect = postgresql if self.backend == "postgresql" else sqlite
        values = {"schedule_key": key, "problem": dict(problem), "state": "pending" if result is None else "done",
                  "result": None if result is None else dict(result), "created_at_s": now_s,
                  "finished_at_s": None if result is None else now_s}
        conn.execute(dialect.insert(solves).values(**values).on_conflict_do_nothing(index_elements=["schedule_key"]))

    def get_solve(self, key: str) -> SolveRecord | None:
        with self._read() as conn:
            row = conn.execute(sa.select(solves).where(solves.c.schedule_key == key)).first()
        return None if row is None else _solve(row)

    def list_solves(self, state: str | None = None) -> list[SolveRecord]:
        """Solves, oldest first, optionally only those in ``state``."""
        query = sa.select(solves).order_by(solves.c.created_at_s, solves.c.schedule_key)
        if state is not None:
            query = query.where(solves.c.state == state)
        with self._read() as conn:
            return [_solve(row) for row in conn.execute(query)]

    def record_solve(self, key: str, problem: Mapping[str, Any], result: Mapping[str, Any],
                     now_s: float | None = None) -> None:
        """A solve done outside the queue (solved on the caller's thread): kept for the submissions that need it, and
        applied to runs already waiting for it (a queued row it finishes). A failed solve is not kept."""
        if result.get("status") == RunStatus.FAILED:
            return
        now_s = _now_s() if now_s is None else now_s
        with self._write() as conn:
            self._insert_solve(conn, key, problem, now_s, result)
            row = conn.execute(sa.select(solves).where(solves.c.schedule_key == key).with_for_update()).one()
            if row.state != "done":
                self._finish(conn, key, result, now_s)

    def claim_solve(self, worker: str, lease_s: float, now_s: float | None = None) -> SolveRecord | None:
        """The oldest pending solve, or one whose worker's lease ran out, claimed for ``worker`` until now +
        ``lease_s``; None when there is none. Workers sharing a PostgreSQL store skip each other's rows
        (FOR UPDATE SKIP LOCKED); on SQLite, writers take turns."""
        now_s = _now_s() if now_s is None else now_s
        claimable = sa.or_(solves.c.state == "pending",
                           sa.and_(solves.c.state == "claimed", solves.c.lease_until_s < now_s))
        query = (sa.select(solves).where(claimable).order_by(solves.c.created_at_s, solves.c.schedule_key).limit(1)
                 .with_for_update(skip_locked=True))
        with self._write() as conn:
            row = conn.execute(query).first()
            if row is None:
                return None
            conn.execute(sa.update(solves).where(solves.c.schedule_key == row.schedule_key).values(
                state="claimed", claimed_by=worker, lease_until_s=now_s + lease_s))
            return _solve(conn.execute(sa.select(solves).where(solves.c.schedule_key == row.schedule_key)).one())

    def renew_solve(self, key: str, worker: str, lease_s: float, now_s: float | None = None) -> bool:
        """Extend ``worker``'s claim; False when the claim is no longer its own (taken over, or done)."""
        now_s = _now_s() if now_s is None else now_s
        with self._write() as conn:
            changed = conn.execute(sa.update(solves).where(
                solves.c.schedule_key == key, solves.c.state == "claimed", solves.c.claimed_by == worker,
            ).values(lease_until_s=now_s + lease_s)).rowcount
        return changed == 1

    def release_solve(self, key: str, worker: str) -> bool:
        """Hand ``worker``'s claim back to the queue (it stops without finishing); False when it held none."""
        with self._write() as conn:
            changed = conn.execute(sa.update(solves).where(
                solves.c.schedule_key == key, solves.c.state == "claimed", solves.c.claimed_by == worker,
            ).values(state="pending", claimed_by=None, lease_until_s=None)).rowcount
        return changed == 1

    def finish_solve(self, key: str, result: Mapping[str, Any], now_s: float | None = None) -> list[RunRecord]:
        """Store a solve's result and apply it to every run waiting for it, in one transaction; the runs changed.
        The first result stored stands (a worker whose lease ran out may finish after the one that took over).

        A schedule or a proof that none fits is kept for later submissions of the same case. A failed solve (the
        solver stopped with nothing, or raised) fails the runs waiting now and is forgotten, so the next
        submission of the case is solved again."""
        now_s = _now_s() if now_s is None else now_s
        with self._write() as conn:
            row = conn.execute(sa.select(solves).where(solves.c.schedule_key == key).with_for_update()).first()
            if row is None or row.state == "done":
                return []  # done already, or a failure forgotten already
            return self._finish(conn, key, result, now_s)

    def _finish(self, conn: sa.Connection, key: str, result: Mapping[str, Any], now_s: float) -> list[RunRecord]:
        changed = _apply_solve(conn, key, dict(result), now_s)
        if result.get("status") == RunStatus.FAILED:
            conn.execute(sa.delete(solves).where(solves.c.schedule_key == key))
        else:
            conn.execute(sa.update(solves).where(solves.c.schedule_key == key).values(
                state="done", result=dict(result), finished_at_s=now_s, lease_until_s=None))
        self._notify_work(conn)
        return changed

    def _notify_work(self, conn: sa.Connection) -> None:
        """PostgreSQL: tell every process listening on the store (:meth:`listen_for_work`) that work was queued; sent
        when the transaction commits. SQLite stores are one host's: its processes poll."""
        if self.backend == "postgresql":
            conn.execute(sa.text(f"NOTIFY {WORK_CHANNEL}"))

    def listen_for_work(self, on_work: Callable[[], None], stop: threading.Event) -> threading.Thread | None:
        """PostgreSQL: a daemon thread calling ``on_work()`` whenever a process sharing the store queued runs or
        solves (LISTEN on its own connection; once more after each (re)connect, for what was queued meanwhile), until
        ``stop`` is set. SQLite: None (nothing to listen to)."""
        if self.backend != "postgresql":
            return None
        import psycopg

        conninfo = self._engine.url.set(drivername="postgresql").render_as_string(hide_password=False)

        def listen() -> None:
            while not stop.is_set():
                try:
                    with psycopg.connect(conninfo, autocommit=True) as conn:
                        conn.execute(f"LISTEN {WORK_CHANNEL}")
                        on_work()
                        while not stop.is_set():
                            for _ in conn.notifies(timeout=_LISTEN_RETRY_S, stop_after=1):
                                on_work()
                except psycopg.Error as error:
                    log.warning("listening for work on %s failed (%s); again in %g s", self.url, error,
                                _LISTEN_RETRY_S)
                    stop.wait(_LISTEN_RETRY_S)

        thread = threading.Thread(target=listen, daemon=True, name="poet-store-listen")
        thread.start()
        return thread

    # -- telemetry events ------------------------------------------------------------------------

    def store_events(self, run_id: str, batch: Sequence[tuple[int, Mapping[str, Any]]], now_s: float | None = None) -> int:
        """Store a batch of ``(seq, payload)`` telemetry events for ``run_id``, in one transaction.

        Idempotent: an event whose seq is already stored (or repeated in the batch) is dropped; the
        first payload for a seq wins. Gaps are allowed. Returns the highest contiguous seq stored
        from 1 — what the coordinator acknowledges and the agent resends after.
        """
        now_s = _now_s() if now_s is None else now_s
        fresh: dict[int, dict[str, Any]] = {}
        for seq, payload in batch:
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
                raise StoreError(f"run {run_id!r}: event sequence numbers are integers from 1, got {seq!r}")
            fresh.setdefault(seq, dict(payload))
        with self._write() as conn:
            # The run's row lock (PostgreSQL; SQLite's BEGIN IMMEDIATE locks the file) serialises
            # writers of one run: the lookup below cannot miss a row another writer is inserting.
            row = self._run_row(conn, run_id, for_update=True)
            acked = row.events_acked_seq
            candidates = sorted(seq for seq in fresh if seq > acked)
            for start in range(0, len(candidates), _EVENT_LOOKUP_CHUNK):
                chunk = candidates[start:start + _EVENT_LOOKUP_CHUNK]
                stored = conn.execute(
                    sa.select(events.c.seq).where(events.c.run_id == run_id, events.c.seq.in_(chunk))
                ).scalars()
                for seq in stored:
                    del fresh[seq]
            new = [seq for seq in candidates if seq in fresh]
            if new:
                conn.execute(
                    sa.insert(events),
                    [{"run_id": run_id, "seq": seq, "payload": fresh[seq], "stored_at_s": now_s} for seq in new],
                )
            # Advance the acknowledgement over whatever is now contiguous (this batch may fill a gap
            # before events stored earlier). The stored ack is always as high as it can be, so it
            # moves only when this batch brought the seq right after it: a board resending behind a
            # gap costs no scan.
            if acked + 1 in fresh:
                following = conn.execute(
                    sa.select(events.c.seq).where(events.c.run_id == run_id, events.c.seq > acked).order_by(events.c.seq)
                ).scalars()
                for seq in following:
                    if seq != acked + 1:
                        break
                    acked = seq
            if new or acked != row.events_acked_seq:
                conn.execute(sa.update(runs).where(runs.c.run_id == run_id).values(
                    events_stored=runs.c.events_stored + len(new), events_acked_seq=acked,
                ))
            return acked

    def events_stored(self, run_id: str) -> int:
        """How many distinct events the coordinator holds for the run."""
        return self.get_run(run_id).events_stored

    def acked_seq(self, run_id: str) -> int:
        """The highest contiguous seq stored from 1 (0 before any): where an agent resumes sending."""
        return self.get_run(run_id).events_acked_seq

    def get_events(self, run_id: str, after_seq: int = 0, limit: int | None = None) -> list[tuple[int, dict[str, Any]]]:
        """Stored events of the run with seq > ``after_seq``, in seq order."""
        query = (
            sa.select(events.c.seq, events.c.payload)
            .where(events.c.run_id == run_id, events.c.seq > after_seq)
            .order_by(events.c.seq)
            .limit(limit)
        )
        with self._read() as conn:
            return [(row.seq, row.payload) for row in conn.execute(query)]

    def telemetry_steps_missing(self, run_id: str, through_step: int) -> list[tuple[int, int]]:
        """The ranges ``(first, last)`` of steps 1..``through_step`` without a stored step event, in order.

        Empty when the run's step telemetry is complete. A step re-run after a resume counts once it is
        stored under any seq; a board whose re-run events were dropped shows its gap here.
        """
        step = events.c.payload[("step", "step")].as_integer()  # the job's step number, from 1
        query = sa.select(step).distinct().where(events.c.run_id == run_id, step.is_not(None))
        with self._read() as conn:
            seen = {int(row[0]) for row in conn.execute(query)}
        missing: list[tuple[int, int]] = []
        for number in range(1, int(through_step) + 1):
            if number in seen:
                continue
            if missing and missing[-1][1] == number - 1:
                missing[-1] = (missing[-1][0], number)
            else:
                missing.append((number, number))
        return missing

    # -- profile versions ------------------------------------------------------------------------

    def add_profile_version(self, agent: str, profile: Mapping[str, Any], now_s: float | None = None, *,
                            provenance: Mapping[str, Any] | None = None) -> ProfileVersion:
        """Store a board's profile (measured by a PROFILE job, or fitted by a calibration) as its next version
        (1, 2, ...), with where it came from."""
        now_s = _now_s() if now_s is None else now_s
        provenance = dict(provenance or {})
        with self._write() as conn:
            # The agent's row lock serialises two PROFILE results for one board.
            row = conn.execute(sa.select(agents).where(agents.c.name == agent).with_for_update()).first()
            if row is None:
                raise UnknownAgentError(f"no agent named {agent!r} has registered (see `poet fleet list`)")
            latest = conn.execute(
                sa.select(sa.func.max(profile_versions.c.version)).where(profile_versions.c.agent == agent)
            ).scalar_one()
            version = (latest or 0) + 1
            conn.execute(sa.insert(profile_versions).values(
                agent=agent, version=version, profile=dict(profile), created_at_s=now_s, provenance=provenance,
            ))
        return ProfileVersion(agent, version, dict(profile), now_s, provenance)

    def latest_profile(self, agent: str) -> ProfileVersion | None:
        query = (
            sa.select(profile_versions).where(profile_versions.c.agent == agent)
            .order_by(profile_versions.c.version.desc()).limit(1)
        )
        with self._read() as conn:
            row = conn.execute(query).first()
        return None if row is None else _profile_version(row)

    def get_profile_version(self, agent: str, version: int) -> ProfileVersion | None:
        """Version ``version`` of the board's profile, or None when it has no such version."""
        query = sa.select(profile_versions).where(profile_versions.c.agent == agent,
                                                  profile_versions.c.version == int(version))
        with self._read() as conn:
            row = conn.execute(query).first()
        return None if row is None else _profile_version(row)

    def list_profile_versions(self, agent: str | None = None) -> list[ProfileVersion]:
        """Every stored profile version (of one board when ``agent`` is given), by board then version."""
        query = sa.select(profile_versions).order_by(profile_versions.c.agent, profile_versions.c.version)
        if agent is not None:
            query = query.where(profile_versions.c.agent == agent)
        with self._read() as conn:
            return [_profile_version(row) for row in conn.execute(query)]


# -- helpers -------------------------------------------------------------------------------------

def _install_sqlite_hooks(engine: sa.Engine) -> None:
    """WAL, foreign keys and a busy timeout on every connection; BEGIN IMMEDIATE for writers.

    pysqlite's own transaction handling is switched off (isolation_level=None) so that the BEGIN
    emitted here is the one that counts (the recipe in SQLAlchemy's SQLite dialect docs).
    """

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(_SQLITE_BUSY_TIMEOUT_S * 1000)}")
            _set_wal(cursor)
            cursor.execute("PRAGMA foreign_keys = ON")
            cursor.execute("PRAGMA synchronous = NORMAL")  # durable across a process crash in WAL mode
        finally:
            cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn):
        read_only = conn.get_execution_options().get("poet_read_only", False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


def _set_wal(cursor) -> None:
    """Switch the file to WAL (persistent, so a no-op once done). The switch needs the file to itself
    and SQLite does not wait for that through the busy timeout, so a coordinator creating the store
    while another one does retries here, within the same timeout."""
    import sqlite3

    deadline_s = time.monotonic() + _SQLITE_BUSY_TIMEOUT_S
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
                return
            if cursor.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() == "wal":
                return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline_s:
                raise
        if time.monotonic() > deadline_s:
            raise StoreError("the SQLite run store could not be switched to WAL mode (another process holds it)")
        time.sleep(0.01)


def _insert_job(conn: sa.Connection, job_id: str, kind: str, spec: Mapping[str, Any], now_s: float) -> None:
    if conn.execute(sa.select(jobs.c.job_id).where(jobs.c.job_id == job_id)).first() is not None:
        raise StoreError(f"job {job_id!r} exists already")
    conn.execute(sa.insert(jobs).values(job_id=job_id, kind=kind, spec=dict(spec), created_at_s=now_s))


def _insert_run(conn: sa.Connection, run: Mapping[str, Any], job_id: str, kind: str, now_s: float) -> None:
    """One new run (keys as RunStore.create_submission's run specs); its job exists, its agent was checked."""
    status = _check_status(run.get("status", RunStatus.QUEUED))
    if conn.execute(sa.select(runs.c.run_id).where(runs.c.run_id == run["run_id"])).first() is not None:
        raise StoreError(f"run {run['run_id']!r} exists already")
    predicted = run.get("predicted")
    conn.execute(sa.insert(runs).values(
        run_id=run["run_id"], job_id=job_id, agent=run["agent"], kind=kind, status=status,
        ram_budget_bytes=run.get("ram_budget_bytes"), schedule_fingerprint=run.get("schedule_fingerprint"),
        predicted=None if predicted is None else dict(predicted), measured=None,
        metrics=_check_metrics(run.get("metrics") or {}), detail=run.get("detail"), events_stored=0, events_acked_seq=0,
        created_at_s=now_s, updated_at_s=now_s,
    ))


def _apply_solve(conn: sa.Connection, key: str, result: Mapping[str, Any], now_s: float) -> list[RunRecord]:
    """A solve's result onto the runs waiting for it (status solving, metrics.schedule_key ``key``)."""
    # Read without locks and filter here (the key is inside the metrics JSON); each UPDATE locks only a run of this
    # key and re-checks that it is still solving, so solves of other keys never wait on each other's runs.
    changed = []
    waiting = conn.execute(sa.select(runs).where(runs.c.status == RunStatus.SOLVING.value)).all()
    changes = _check_metrics(result.get("metrics") or {})
    for row in sorted(waiting, key=lambda r: r.run_id):
        if row.metrics.get("schedule_key") != key:
            continue
        updated = conn.execute(sa.update(runs).where(
            runs.c.run_id == row.run_id, runs.c.status == RunStatus.SOLVING.value,
        ).values(
            status=_check_status(result["status"]), schedule_fingerprint=result.get("schedule_fingerprint"),
            predicted=result.get("predicted"), detail=result.get("detail"), updated_at_s=now_s,
            metrics={**row.metrics, **changes})).rowcount
        if updated:
            changed.append(row.run_id)
    return [_run(conn.execute(sa.select(runs).where(runs.c.run_id == run_id)).one()) for run_id in changed]


def _solve(row: sa.Row) -> SolveRecord:
    return SolveRecord(
        schedule_key=row.schedule_key, problem=row.problem, state=row.state, claimed_by=row.claimed_by,
        lease_until_s=row.lease_until_s, result=row.result, created_at_s=row.created_at_s,
        finished_at_s=row.finished_at_s,
    )


def _refuse_removed(row: sa.Row) -> None:
    if row.removed:
        raise AgentRemovedError(
            f"agent {row.name!r} was removed (`poet fleet remove`) and is refused; issue a certificate under a "
            f"new name to bring the board back"
        )


def _check_status(status: str) -> str:
    """The status as stored (a plain string), if it is one of RunStatus."""
    try:
        return RunStatus(status).value
    except ValueError:
        raise StoreError(f"run status {status!r} is not one of {', '.join(RUN_STATUSES)}") from None


def _check_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics to store, if each is a field of RunMetrics (host/fleet/metrics.py)."""
    unknown = sorted(set(metrics) - METRIC_NAMES)
    if unknown:
        raise StoreError(f"run metric(s) {', '.join(map(repr, unknown))} are not fields of RunMetrics; add them to "
                         "host/fleet/metrics.py")
    return dict(metrics)


def _check_kind(kind: str) -> None:
    if kind not in RUN_KINDS:
        raise StoreError(f"job kind {kind!r} is not one of {', '.join(RUN_KINDS)}")


def _agent(row: sa.Row) -> AgentRecord:
    return AgentRecord(
        name=row.name, platform=row.platform, facts=dict(row.facts), registered_at_s=row.registered_at_s,
        last_seen_at_s=row.last_seen_at_s, removed=bool(row.removed), removed_at_s=row.removed_at_s,
    )


def _profile_version(row: sa.Row) -> ProfileVersion:
    return ProfileVersion(row.agent, row.version, row.profile, row.created_at_s, dict(row.provenance or {}))


def _run(row: sa.Row) -> RunRecord:
    return RunRecord(
        run_id=row.run_id, job_id=row.job_id, agent=row.agent, kind=row.kind, status=RunStatus(row.status),
        ram_budget_bytes=row.ram_budget_bytes, schedule_fingerprint=row.schedule_fingerprint,
        predicted=row.predicted, measured=row.measured, metrics=dict(row.metrics), detail=row.detail,
        events_stored=row.events_stored, events_acked_seq=row.events_acked_seq,
        created_at_s=row.created_at_s, updated_at_s=row.updated_at_s,
    )


__all__ = [
    "AgentRecord", "AgentRemovedError", "JobRecord", "ProfileVersion", "RunRecord", "RunStore", "SolveRecord",
    "StoreError",
    "UnknownAgentError", "UnknownRunError", "alembic_config", "parse_url", "sqlite_url",
]
