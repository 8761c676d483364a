"""A benchmark's own PostgreSQL database: created on a server, migrated to head, dropped after.

The fault, hostile and load benchmarks (and the suite's fault tests) each run a deployment
on a database no other run shares, so what they count is their own rows and a run leaves
nothing behind on the machine's server. They created and migrated it with the same lines;
this is the one copy.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager


def create_database(pg_admin: str, prefix: str) -> str:
    """A new database ``<prefix>_<8 hex digits>`` on the server of ``pg_admin`` (a libpq URL
    of a user allowed to create databases), migrated to head; its SQLAlchemy URL (psycopg
    driver), as ``ZOOPICK_DATABASE_URL`` takes it. The caller drops it (``drop_database``)
    or the whole server when done."""
    import psycopg
    from sqlalchemy.engine import make_url

    from zoopick.service.db import migrate

    name = f"{prefix}_{secrets.token_hex(4)}"
    with psycopg.connect(pg_admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    admin = make_url(pg_admin.replace("postgresql://", "postgresql+psycopg://", 1))
    url = admin.set(database=name).render_as_string(hide_password=False)
    migrate.upgrade(url)
    return url


def drop_database(pg_admin: str, url: str) -> None:
    """Drop the database of ``url`` (as ``create_database`` returned it), closing its
    connections (a worker killed mid-run may have left some). A server that no longer
    answers is let be: it went with its data (a private cluster removed first), and an
    error here would hide the run's own."""
    import psycopg
    from sqlalchemy.engine import make_url

    name = make_url(url).database
    try:
        with psycopg.connect(pg_admin, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except psycopg.OperationalError as exc:
        print(f"database {name} not dropped: {exc}")


@contextmanager
def private_database(pg_admin: str, prefix: str) -> Iterator[str]:
    """``create_database``'s URL for the block, dropped when it ends (also on an error)."""
    url = create_database(pg_admin, prefix)
    try:
        yield url
    finally:
        drop_database(pg_admin, url)
