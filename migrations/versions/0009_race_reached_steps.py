"""A racing candidate shows how far its rung has got while it trains
(``race_entries.reached_steps``, from the trainer's progress lines).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("race_entries", sa.Column("reached_steps", sa.Integer(), nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # native since SQLite 3.35; a batch rebuild of the table would drop its CHECKs
        op.execute("ALTER TABLE race_entries DROP COLUMN reached_steps")
    else:
        op.drop_column("race_entries", "reached_steps")
