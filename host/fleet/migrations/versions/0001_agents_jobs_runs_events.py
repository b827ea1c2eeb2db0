"""agents, jobs, runs and telemetry events

Revision ID: 0001
Revises:
Create Date: 2026-11-23

Times are UTC seconds since the epoch as floats (columns ending ``_s``). JSON columns are JSON on
SQLite and JSONB on PostgreSQL.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "agents",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("platform", sa.String(255), nullable=False),
        sa.Column("facts", JSON, nullable=False),
        sa.Column("registered_at_s", sa.Float(), nullable=False),
        sa.Column("last_seen_at_s", sa.Float(), nullable=False),
        sa.Column("removed", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("removed_at_s", sa.Float(), nullable=True),
    )
    op.create_table(
        "jobs",
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("spec", JSON, nullable=False),
        sa.Column("created_at_s", sa.Float(), nullable=False),
    )
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("job_id", sa.String(64), sa.ForeignKey("jobs.job_id"), nullable=False, index=True),
        sa.Column("agent", sa.String(255), sa.ForeignKey("agents.name"), nullable=False, index=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("ram_budget_bytes", sa.BigInteger(), nullable=True),
        sa.Column("schedule_fingerprint", sa.String(128), nullable=True),
        sa.Column("predicted", JSON, nullable=True),
        sa.Column("measured", JSON, nullable=True),
        sa.Column("metrics", JSON, nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("events_stored", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("events_acked_seq", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("created_at_s", sa.Float(), nullable=False),
        sa.Column("updated_at_s", sa.Float(), nullable=False),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'done', 'failed', 'does_not_fit')", name="ck_runs_status"
        ),
    )
    # The primary key (run_id, seq) is what makes a resent event a duplicate, not a second row.
    op.create_table(
        "events",
        sa.Column("run_id", sa.String(64), sa.ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True),
        sa.Column("seq", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("payload", JSON, nullable=False),
        sa.Column("stored_at_s", sa.Float(), nullable=False),
        sa.CheckConstraint("seq >= 1", name="ck_events_seq_positive"),
    )


def downgrade() -> None:
    op.drop_table("events")
    op.drop_table("runs")
    op.drop_table("jobs")
    op.drop_table("agents")
