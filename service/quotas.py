"""Per-tenant limits that must hold under concurrency: active jobs, stored bytes and datasets.

A limit checked by counting and then inserting is a race: forty submissions at once all count
fifteen and all insert (the probe got 25 of 40 accepted against a limit of 16). Counting and
inserting therefore happen under :func:`tenant_lock`, a row lock on the tenant
(``SELECT ... FOR UPDATE`` on PostgreSQL, held until the transaction commits), so one tenant's
submissions are serialised while other tenants' are not. SQLite has no row locks; its
embedded deployment runs one API process, so a process-wide lock does the same there.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from zoopick.service.db.models import TERMINAL, Dataset, Job, Tenant

_LOCAL = threading.Lock()


@contextmanager
def tenant_lock(session: Session, tenant_id: uuid.UUID) -> Iterator[None]:
    """Serialise a tenant's count-then-insert. Commit (or roll back) inside the block: on
    PostgreSQL the lock is released with the transaction."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
        yield
        return
    with _LOCAL:
        yield


def active_jobs(session: Session, tenant_id: uuid.UUID) -> int:
    return session.scalar(
        select(func.count(Job.id)).where(
            Job.tenant_id == tenant_id, Job.status.not_in([s.value for s in TERMINAL])
        )
    )


def stored(session: Session, tenant_id: uuid.UUID) -> tuple[int, int]:
    """(datasets, bytes) the tenant keeps in storage (invalid uploads' files are deleted, so
    they do not count)."""
    count, total = session.execute(
        select(func.count(Dataset.id), func.coalesce(func.sum(Dataset.size_bytes), 0)).where(
            Dataset.tenant_id == tenant_id, Dataset.status != "invalid"
        )
    ).one()
    return int(count), int(total)
