"""Training runs say where they ran (``local`` or ``ray``), the backend's own id of the run
(the Ray job id) and how often the run resumed from its checkpoint after a lost worker, node
or task.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "training_runs",
        sa.Column("backend", sa.String(length=16), server_default="local", nullable=False),
    )
    op.add_column("training_runs", sa.Column("backend_ref", sa.String(length=200), nullable=True))
    op.add_column(
        "training_runs", sa.Column("resumes", sa.Integer(), server_default="0", nullable=False)
    )


def downgrade() -> None:
    for column in ("resumes", "backend_ref", "backend"):
        if op.get_bind().dialect.name == "sqlite":
            # native since SQLite 3.35; a batch rebuild of the table would drop its CHECKs
            op.execute(f"ALTER TABLE training_runs DROP COLUMN {column}")
        else:
            op.drop_column("training_runs", column)
