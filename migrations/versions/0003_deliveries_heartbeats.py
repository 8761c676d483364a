"""Per-model scoring errors of a job (a broken zoo entry is skipped, not fatal), task delivery
counts (a task that kills its worker is failed after a bounded number of
deliveries) and worker heartbeats (``/readyz`` sees a worker that stopped running tasks).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("model_errors", sa.JSON(), server_default="{}", nullable=False))
    op.create_table(
        "task_deliveries",
        sa.Column("key", sa.String(length=300), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_task_deliveries")),
    )
    op.create_table(
        "worker_heartbeats",
        sa.Column("name", sa.String(length=300), nullable=False),
        sa.Column("hostname", sa.String(length=200), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("queues", sa.String(length=200), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_worker_heartbeats")),
    )
    op.create_index(
        op.f("ix_worker_heartbeats_hostname"), "worker_heartbeats", ["hostname"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_worker_heartbeats_hostname"), table_name="worker_heartbeats")
    op.drop_table("worker_heartbeats")
    op.drop_table("task_deliveries")
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE jobs DROP COLUMN model_errors")
    else:
        op.drop_column("jobs", "model_errors")
