"""Engines and sessions.

SQLite gets the settings a multi-process service needs (the API and a worker share the file):
foreign keys on, WAL journal, and a busy timeout instead of immediate "database is locked".
Engines are created lazily per process; a forked Celery child must build its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def make_engine(
    url: str, *, pool_size: int = 5, max_overflow: int = 10, pool_timeout: float = 30.0
) -> Engine:
    """An engine for ``url``. The pool arguments bound this process' connections (the API
    sizes them from its settings and never lets more requests than that hold a session: see
    ``zoopick.app.api.deps.get_session``)."""
    parsed = make_url(url)
    pool = {"pool_size": pool_size, "max_overflow": max_overflow, "pool_timeout": pool_timeout}
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"timeout": 30, "check_same_thread": False}, **pool
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:  # pragma: no cover - trivial
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, **pool)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session that commits on success and rolls back on any error."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
