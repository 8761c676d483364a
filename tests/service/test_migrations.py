"""The Alembic migrations on PostgreSQL and SQLite: upgrade from empty, downgrade to base, and
the ORM models agree with what the migrations create (autogenerate finds no difference)."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from zoopick.service.db import migrate
from zoopick.service.db.models import Base
from zoopick.service.db.session import make_engine

TABLES = {
    "tenants",
    "api_keys",
    "datasets",
    "zoo_models",
    "jobs",
    "scores",
    "training_runs",
    "epoch_metrics",
    "artefacts",
    "task_deliveries",
    "worker_heartbeats",
    "score_leases",
}


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'mig.db'}"
    return request.getfixturevalue("new_pg_database")()


def test_upgrade_matches_models_and_downgrades_to_empty(empty_url):
    assert migrate.current_heads(empty_url) == set()
    migrate.upgrade(empty_url)
    assert migrate.current_heads(empty_url) == {migrate.head()} == {"0016"}
    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) >= TABLES
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(ctx, Base.metadata) == []
            uniques = {
                tuple(u["column_names"]) for u in inspect(conn).get_unique_constraints("scores")
            }
            assert ("job_id", "model_id", "metric") in uniques

        migrate.downgrade(empty_url, "base")
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
        assert migrate.current_heads(empty_url) == set()

        migrate.upgrade(empty_url)  # and back up again: the downgrade left nothing behind
        assert migrate.current_heads(empty_url) == {migrate.head()} == {"0016"}
    finally:
        engine.dispose()
