"""profile provenance: where each stored profile version came from (a PROFILE job, a calibration's fit)

A JSON object per version (agent, job and run ids, time, the fit's errors before and after). Versions
stored before this revision keep NULL, read as {}.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("profile_versions") as batch:
        batch.add_column(sa.Column("provenance", JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("profile_versions") as batch:
        batch.drop_column("provenance")
