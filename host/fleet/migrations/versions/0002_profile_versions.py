"""profile versions: each board's measured PlatformProfile, one row per PROFILE job

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "profile_versions",
        sa.Column("agent", sa.String(255), sa.ForeignKey("agents.name"), primary_key=True),
        sa.Column("version", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("profile", JSON, nullable=False),
        sa.Column("created_at_s", sa.Float(), nullable=False),
        sa.CheckConstraint("version >= 1", name="ck_profile_versions_version_positive"),
    )


def downgrade() -> None:
    op.drop_table("profile_versions")
