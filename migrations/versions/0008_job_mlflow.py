"""Jobs say how logging them to MLflow went (``zoopick.service.tracking``): pending, logged
with the run's id and page, or failed with the tracking server's error.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("mlflow", sa.JSON(), nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # native since SQLite 3.35; a batch rebuild of the table would drop its CHECKs
        op.execute("ALTER TABLE jobs DROP COLUMN mlflow")
    else:
        op.drop_column("jobs", "mlflow")
