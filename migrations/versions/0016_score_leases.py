"""A lease per scored model (``score_leases``): the task scoring a model of a job holds that
model's lease while it runs, so the sweeper finds a model whose task died with its worker
within about two lease periods, instead of only once the job's other models have finished and
stopped renewing the job's one shared scoring lease (issue 43: an embedded serve killed
mid-scoring recovered in up to 184 s for that reason).

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "score_leases",
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("model_id", sa.String(length=200), nullable=False),
        sa.Column("lease_owner", sa.String(length=200), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_score_leases_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "model_id", name=op.f("pk_score_leases")),
    )


def downgrade() -> None:
    op.drop_table("score_leases")
