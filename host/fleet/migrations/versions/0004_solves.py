"""solves: the queue of schedules to solve, and the runs waiting for them (status 'solving')

SubmitRun records its runs and returns; a run whose schedule is not solved yet is 'solving' and names its
schedule by ``schedule_key`` (in its metrics). Each distinct schedule is one row here: 'pending' until a solver
worker claims it ('claimed', with a lease the worker renews while it solves), 'done' with its result, which
every run waiting for it then takes (and later submissions of the same case reuse).

Revision ID: 0004
Revises: 0003
A row is self-contained (the graph, the profile, the budget and the solver settings are in ``problem``), so a
solver worker on another host needs nothing but the store.

Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
STATUSES_BEFORE = "status IN ('queued', 'running', 'done', 'failed', 'does_not_fit')"
STATUSES_AFTER = "status IN ('solving', 'queued', 'running', 'done', 'failed', 'does_not_fit')"


def _runs_status_check(old: str, new: str) -> None:
    """Replace the runs table's status check. SQLite cannot alter a CHECK, and copying the table (Alembic's batch
    mode) would drop ``runs``, whose implicit delete cascades to every stored telemetry event; so the check's text
    is rewritten in the schema, the procedure SQLite documents for loosening a constraint (the new check admits
    every stored row: it only adds a status)."""
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint("ck_runs_status", "runs", type_="check")
        op.create_check_constraint("ck_runs_status", "runs", new)
        return
    bind = op.get_bind()
    version = bind.exec_driver_sql("PRAGMA schema_version").scalar()
    bind.exec_driver_sql("PRAGMA writable_schema=ON")
    try:
        changed = bind.exec_driver_sql("UPDATE sqlite_master SET sql = replace(sql, ?, ?) "
                                       "WHERE type = 'table' AND name = 'runs' AND instr(sql, ?) > 0",
                                       (old, new, old)).rowcount
        bind.exec_driver_sql(f"PRAGMA schema_version={int(version) + 1}")
    finally:
        bind.exec_driver_sql("PRAGMA writable_schema=OFF")
    if changed != 1:
        raise RuntimeError(f"the runs table's status check is not {old!r}: this store was not made by poet-edge's "
                           "migrations; use another --store")


def upgrade() -> None:
    op.create_table(
        "solves",
        sa.Column("schedule_key", sa.String(64), primary_key=True),
        sa.Column("problem", JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("claimed_by", sa.String(255), nullable=True),
        sa.Column("lease_until_s", sa.Float(), nullable=True),
        sa.Column("result", JSON, nullable=True),
        sa.Column("created_at_s", sa.Float(), nullable=False),
        sa.Column("finished_at_s", sa.Float(), nullable=True),
        sa.CheckConstraint("state IN ('pending', 'claimed', 'done')", name="ck_solves_state"),
    )
    op.create_index("ix_solves_state", "solves", ["state", "created_at_s"])
    _runs_status_check(STATUSES_BEFORE, STATUSES_AFTER)


def downgrade() -> None:
    op.execute("UPDATE runs SET status = 'failed', detail = 'its schedule was never solved' WHERE status = 'solving'")
    _runs_status_check(STATUSES_AFTER, STATUSES_BEFORE)
    op.drop_index("ix_solves_state", "solves")
    op.drop_table("solves")
