"""Jobs count how often the sweeper (``zoopick.service.recovery``) re-queued them after they were
lost.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # a plain ADD COLUMN with a default works in place on PostgreSQL and SQLite alike
    op.add_column("jobs", sa.Column("recoveries", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # native since SQLite 3.35; a batch rebuild of the table would drop its CHECKs
        op.execute("ALTER TABLE jobs DROP COLUMN recoveries")
    else:
        op.drop_column("jobs", "recoveries")
