"""What the fine-tune recipe chose for a run (``training_runs.recipe``): its plan, the
learning rate and how it was found, the search's curve and the best validation step.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("training_runs", sa.Column("recipe", sa.JSON(), nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # native since SQLite 3.35; a batch rebuild of the table would drop its CHECKs
        op.execute("ALTER TABLE training_runs DROP COLUMN recipe")
    else:
        op.drop_column("training_runs", "recipe")
