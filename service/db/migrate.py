"""Run the Alembic migrations from code (``zoopick migrate``, ``zoopick serve``, tests).

The scripts live in ``migrations/`` at the repository root; a wheel ships that folder inside
the package as ``zoopick/service/migrations`` (see pyproject), so an installed service can
migrate with no checkout. :func:`script_location` finds whichever is there. No ``alembic.ini`` is
needed: the
URL is passed explicitly so a caller's settings (not the environment) decide which database is
migrated, and logging is left to the caller.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

SERVICE = Path(__file__).resolve().parents[1]


class MigrationsNotFound(RuntimeError):
    """Neither the packaged nor the source-tree migration scripts exist."""


def script_location() -> Path:
    """The Alembic scripts: packaged (``zoopick/service/migrations``, installed from a wheel)
    or the source tree's ``migrations/`` beside ``service/`` (a checkout or an editable
    install)."""
    candidates = (SERVICE / "migrations", SERVICE.parent / "migrations")
    for folder in candidates:
        if (folder / "env.py").is_file() and (folder / "versions").is_dir():
            return folder
    raise MigrationsNotFound(
        "no Alembic scripts in " + " or ".join(str(c) for c in candidates) + " (broken install?)"
    )


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def head() -> str:
    """The newest revision the scripts define."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_heads(url: str) -> set[str]:
    """The revisions the database is at (empty before the first migration)."""
    from alembic.runtime.migration import MigrationContext

    from zoopick.service.db.session import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return set(MigrationContext.configure(conn).get_current_heads())
    finally:
        engine.dispose()
