"""A job's own words: ``jobs.name``, ``jobs.tags`` (a JSON list) and ``jobs.notes``, set at
submission and editable later (``PATCH /jobs/{id}``); the list searches names and tags.

Revision ID: 0014
Revises: 0012
Create Date: 2026-11-28
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0012"  # 0013 is reserved for another change: chain it below 0014
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("name", "tags", "notes")


def upgrade() -> None:
    op.add_column("jobs", sa.Column("name", sa.String(200), nullable=True))
    op.add_column("jobs", sa.Column("tags", sa.JSON(), nullable=False, server_default="[]"))
    op.add_column("jobs", sa.Column("notes", sa.Text(), nullable=True))


def downgrade() -> None:
    for column in reversed(COLUMNS):
        if op.get_bind().dialect.name == "sqlite":
            # native since SQLite 3.35; a batch rebuild of the table would drop its CHECKs
            op.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
        else:
            op.drop_column("jobs", column)
