"""Signing out of the dashboard ends the key's sessions on the server
(``api_keys.sessions_ended_at``, part of every session cookie's MAC).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "api_keys", sa.Column("sessions_ended_at", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # native since SQLite 3.35; a batch rebuild of the table would drop its CHECKs
        op.execute("ALTER TABLE api_keys DROP COLUMN sessions_ended_at")
    else:
        op.drop_column("api_keys", "sessions_ended_at")
