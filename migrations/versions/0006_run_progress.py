"""Training runs' live progress: the phase the run is in (starting workers, loading data,
epoch i of n, step j of m), the hosts it runs on and its sub-epoch curve points, as the
trainer reports them (``training.config.RunEvent`` "progress"); and scores say whether the
model's forward pass came from the feature cache.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("training_runs", sa.Column("progress", sa.JSON(), nullable=True))
    op.add_column(
        "scores", sa.Column("cached", sa.Boolean(), server_default=sa.false(), nullable=False)
    )


def _drop(table: str, column: str) -> None:
    if op.get_bind().dialect.name == "sqlite":
        # native since SQLite 3.35; a batch rebuild of the table would drop its CHECKs
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    else:
        op.drop_column(table, column)


def downgrade() -> None:
    _drop("scores", "cached")
    _drop("training_runs", "progress")
