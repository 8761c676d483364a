"""A task's database work waits out a database outage (issue 43, ``service.dbretry``): run
through a link to the real PostgreSQL that the test cuts, the work is tried again with
backoff and succeeds once the link is back; a statement the database refuses is raised at
once, and an outage longer than the budget is raised when the budget is spent."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from tests.service.tcpcut import CuttableLink


@pytest.fixture
def linked_engine(pg_url):
    from zoopick.service.db.session import make_engine

    parsed = make_url(pg_url)
    link = CuttableLink(parsed.host or "127.0.0.1", parsed.port or 5432)
    engine = make_engine(parsed.set(host="127.0.0.1", port=link.port).render_as_string(False))
    yield link, engine
    link.cut()
    engine.dispose()


def test_work_waits_out_an_outage(linked_engine):
    from zoopick.service.dbretry import retrying

    link, engine = linked_engine
    tries: list[float] = []

    def work() -> int:
        tries.append(time.monotonic())
        with engine.begin() as conn:
            return conn.execute(text("SELECT 42")).scalar_one()

    assert work() == 42  # a pooled connection, then the outage
    link.cut()
    threading.Timer(1.2, link.restore).start()
    start = time.monotonic()
    assert retrying(work, what="test", budget_seconds=30) == 42
    assert 1.0 < time.monotonic() - start < 10
    assert len(tries) >= 3  # 0.5 s, then 1 s between tries


def test_a_refused_statement_is_not_retried_and_the_budget_holds(linked_engine):
    from sqlalchemy.exc import OperationalError, ProgrammingError

    from zoopick.service.dbretry import retrying

    link, engine = linked_engine
    tries: list[int] = []

    def wrong() -> None:
        tries.append(1)
        with engine.begin() as conn:
            conn.execute(text("SELECT * FROM no_such_table"))

    with pytest.raises(ProgrammingError):
        retrying(wrong, what="test", budget_seconds=30)
    assert len(tries) == 1
    link.cut()
    start = time.monotonic()
    with pytest.raises(OperationalError):
        retrying(wrong, what="test", budget_seconds=1.0)
    assert time.monotonic() - start < 3
