"""Run the Alembic migrations from code (``zoopick migrate``, ``zoopick serve``, tests).

The scripts live in ``migrations/`` at the repository root; the URL is passed explicitly so a
caller's settings (not the environment) decide which database is migrated.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

ROOT = Path(__file__).resolve().parents[2]


def alembic_config(url: str) -> Config:
    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def current_heads(url: str) -> set[str]:
    """The revisions the database is at (empty before the first migration)."""
    from alembic.runtime.migration import MigrationContext

    from app.db.session import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return set(MigrationContext.configure(conn).get_current_heads())
    finally:
        engine.dispose()
