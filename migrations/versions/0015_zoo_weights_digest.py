"""A zoo checkpoint's size and SHA-256 as registered (``zoo_models.weights_size``,
``weights_sha256``): a checkpoint kept in an S3 store (``"weights": "s3://bucket/key"``) is
fetched by each worker and checked against them, so jobs load the bytes whose shapes were
checked. Empty for hub, none and local-path weights.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("weights_sha256", "weights_size")


def upgrade() -> None:
    op.add_column("zoo_models", sa.Column("weights_sha256", sa.String(64), nullable=True))
    op.add_column("zoo_models", sa.Column("weights_size", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    for column in reversed(COLUMNS):
        if op.get_bind().dialect.name == "sqlite":
            # native since SQLite 3.35; a batch rebuild of the table would drop its CHECKs
            op.execute(f"ALTER TABLE zoo_models DROP COLUMN {column}")
        else:
            op.drop_column("zoo_models", column)
