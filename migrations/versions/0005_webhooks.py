"""Webhooks: a job's and a tenant's webhook URL, the tenant's signing secret, and the delivery
log (``zoopick.service.webhooks``).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = {
    "tenants": ("webhook_secret", "webhook_phases", "webhook_url"),
    "jobs": ("webhook",),
}


def upgrade() -> None:
    op.add_column("tenants", sa.Column("webhook_url", sa.Text(), nullable=True))
    op.add_column(
        "tenants",
        sa.Column("webhook_phases", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    op.add_column("tenants", sa.Column("webhook_secret", sa.String(length=64), nullable=True))
    op.add_column("jobs", sa.Column("webhook", sa.JSON(), nullable=True))
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("event", sa.String(length=32), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("response_status", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'delivered', 'failed')",
            name=op.f("ck_webhook_deliveries_status"),
        ),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_webhook_deliveries_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
    )
    op.create_index(
        "ix_webhook_deliveries_job_created",
        "webhook_deliveries",
        ["job_id", "created_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_job_created", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    for table, columns in COLUMNS.items():
        for column in columns:
            if op.get_bind().dialect.name == "sqlite":
                # native since SQLite 3.35; a batch rebuild of the table would drop its CHECKs
                op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
            else:
                op.drop_column(table, column)
