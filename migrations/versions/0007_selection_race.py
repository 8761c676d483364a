"""Two-stage selection: a job's selection options and race record, the ``racing`` status, and
one row per shortlisted model and rung (``race_entries``).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BEFORE = "'queued', 'scoring', 'training', 'succeeded', 'failed', 'cancelled'"
AFTER = "'queued', 'scoring', 'racing', 'training', 'succeeded', 'failed', 'cancelled'"


def _status_check(values: str) -> None:
    """Replace the jobs' status CHECK (SQLite cannot alter a constraint: a batch rebuilds the
    table, which keeps its other constraints)."""
    with op.batch_alter_table("jobs", recreate="auto") as batch:
        batch.drop_constraint(op.f("ck_jobs_status"), type_="check")
        batch.create_check_constraint("status", f"status IN ({values})")


def upgrade() -> None:
    op.add_column("jobs", sa.Column("selection", sa.JSON(), nullable=True))
    op.add_column("jobs", sa.Column("race", sa.JSON(), nullable=True))
    _status_check(AFTER)
    op.create_table(
        "race_entries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("model_id", sa.String(length=200), nullable=False),
        sa.Column("rung", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("target_steps", sa.Integer(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=True),
        sa.Column("val_accuracy", sa.Float(), nullable=True),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("lease_owner", sa.String(length=200), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_race_entries_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_race_entries")),
        sa.UniqueConstraint(
            "job_id", "model_id", "rung", name=op.f("uq_race_entries_job_id_model_id_rung")
        ),
    )


def downgrade() -> None:
    op.drop_table("race_entries")
    op.execute("DELETE FROM jobs WHERE status = 'racing'")
    _status_check(BEFORE)
    for column in ("race", "selection"):
        if op.get_bind().dialect.name == "sqlite":
            op.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
        else:
            op.drop_column("jobs", column)
