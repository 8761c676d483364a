"""Request dependencies: settings, a database session, and the authenticated caller."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, TypeVar

import anyio
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from zoopick.app.problems import Problem, busy
from zoopick.service.db.models import Dataset, Job, ZooModel
from zoopick.service.dispatch import Dispatcher
from zoopick.service.security import authenticate, authenticate_owned, touch
from zoopick.service.settings import Settings
from zoopick.service.zoo_catalog import REMOVED_ORIGIN

T = TypeVar("T")

bearer = HTTPBearer(
    auto_error=False,
    scheme_name="ApiKey",
    description="An API key (`zoopick keys create --name NAME`) as a Bearer token.",
)


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_dispatcher(request: Request) -> Dispatcher:
    return request.app.state.dispatcher


class SessionSlot:
    """A request's claim on one of the process's database connections (see
    :func:`get_session`); :meth:`released` lends it out while the request waits on its
    client."""

    def __init__(self, request: Request) -> None:
        self._slots: asyncio.Semaphore = request.app.state.session_slots
        self._timeout = request.app.state.settings.db_pool_timeout_seconds
        self.held = False

    async def acquire(self) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                await self._slots.acquire()
        except TimeoutError:  # every connection busy that long: shed the load
            raise busy() from None
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._slots.release()

    @asynccontextmanager
    async def released(self, session: Session) -> AsyncIterator[None]:
        """Give the slot back for the block (e.g. while an upload's body streams in, which
        takes as long as the client wants); the session must hold no connection then, so an
        open transaction is rolled back first. The slot is taken again after the block
        (503 "busy" if that takes longer than the pool timeout)."""
        if session.in_transaction():
            await anyio.to_thread.run_sync(session.rollback)
        self.release()
        try:
            yield
        finally:
            await self.acquire()


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request's database session, opened only once a connection is sure to be free.

    FastAPI runs each sync dependency and the endpoint in a separate thread-pool call, so a
    session that got its connection in one call holds it while it waits for a thread for the
    next. Under overload every thread could be waiting for a connection that such sessions
    hold, and nothing would move until the pool's timeout (a 30 s freeze, then 500s). A slot
    per pooled connection, taken here on the event loop before any thread is, rules that out:
    the requests beyond the pool wait without a thread, and a thread never waits on the pool.
    A request that waits longer than ``ZOOPICK_DB_POOL_TIMEOUT_SECONDS`` is answered 503.
    The slot is ``request.state.session_slot`` (see :meth:`SessionSlot.released`).
    """
    slot = request.state.session_slot = SessionSlot(request)
    await slot.acquire()
    try:
        session = request.app.state.sessionmaker()
        try:
            yield session
        finally:
            if session.in_transaction():  # holds a connection: giving it back is a ROLLBACK
                await anyio.to_thread.run_sync(session.close, limiter=anyio.CapacityLimiter(1))
            else:
                session.close()
    finally:
        slot.release()


@dataclass(frozen=True)
class Caller:
    tenant_id: uuid.UUID
    key_id: uuid.UUID
    admin: bool


def _unauthorized(detail: str) -> Problem:
    return Problem(401, detail, kind="unauthorized", headers={"WWW-Authenticate": "Bearer"})


def authenticated(
    request: Request,
    session: Session,
    creds: HTTPAuthorizationCredentials | None,
    owned: tuple[type[T], uuid.UUID] | None = None,
) -> tuple[Caller, T | None]:
    """The caller of a request (401 when the key is missing, wrong or revoked; 429 after too
    many failures from this client) and, with ``owned=(model, id)``, that row if the caller's
    tenant owns it, looked up in the same statement as the key."""
    client = request.client.host if request.client else "unknown"
    rate = request.app.state.rate
    # a client that keeps failing is refused before its next guess is even looked at
    rate.blocked("auth_failures", client, "failed authentications")
    if creds is None:
        rate.count("auth_failures", client)
        raise _unauthorized("missing API key: send the header 'Authorization: Bearer <key>'")
    if owned is None:
        key, row = authenticate(session, creds.credentials), None
    else:
        key, row = authenticate_owned(session, creds.credentials, *owned)
    if key is None:
        rate.count("auth_failures", client)
        raise _unauthorized("invalid or revoked API key")
    caller = Caller(tenant_id=key.tenant_id, key_id=key.id, admin=key.is_admin)
    touch(session, key)
    if session.dirty:  # last use is recorded at most once a minute: no write, no commit else
        session.commit()
    return caller, row


Creds = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def get_caller(
    request: Request, session: Annotated[Session, Depends(get_session)], creds: Creds
) -> Caller:
    return authenticated(request, session, creds)[0]


def get_admin(caller: Annotated[Caller, Depends(get_caller)]) -> Caller:
    if not caller.admin:
        raise Problem(403, "this needs an admin API key", kind="forbidden")
    return caller


SessionDep = Annotated[Session, Depends(get_session)]
CallerDep = Annotated[Caller, Depends(get_caller)]
AdminDep = Annotated[Caller, Depends(get_admin)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
DispatcherDep = Annotated[Dispatcher, Depends(get_dispatcher)]


def parse_id(value: str, what: str) -> uuid.UUID:
    """A path id; anything that is not a UUID is simply not found (no 422 for a typo)."""
    try:
        return uuid.UUID(value)
    except ValueError:
        raise Problem(404, f"no {what} {value!r}", kind=_not_found(what)) from None


def get_owned(session: Session, caller: Caller, model: type[T], raw_id: str, what: str) -> T:
    """The row ``raw_id`` of ``model`` if the caller may see it, else 404 naming it: rows with
    a tenant are visible to that tenant only (another tenant's row is "not found", not
    "forbidden", so ids do not leak); rows without one (the zoo) to every caller."""
    tenant_scoped = hasattr(model, "tenant_id")
    key = parse_id(raw_id, what) if tenant_scoped else raw_id
    row = session.get(model, key)
    if row is None or (tenant_scoped and row.tenant_id != caller.tenant_id):
        raise Problem(404, f"no {what} {raw_id!r}", kind=_not_found(what))
    return row


def _not_found(what: str) -> str:
    return f"{what.replace(' ', '-')}-not-found"


def _owned(
    request: Request, session: Session, creds: Creds, model: type[T], raw_id: str, what: str
) -> T:
    """A tenant's row for a path id, with the caller authenticated in the same statement (one
    thread-pool call and one statement fewer than ``CallerDep`` then ``get_owned``). The key
    is checked first: a bad key is 401 whatever the id."""
    try:
        owned = (model, uuid.UUID(raw_id))
    except ValueError:
        owned = None  # not an id: simply not found, once the caller is known
    _, row = authenticated(request, session, creds, owned)
    if row is None:
        raise Problem(404, f"no {what} {raw_id!r}", kind=_not_found(what))
    return row


def owned_dataset(dataset_id: str, request: Request, session: SessionDep, creds: Creds) -> Dataset:
    return _owned(request, session, creds, Dataset, dataset_id, "dataset")


def owned_job(job_id: str, request: Request, session: SessionDep, creds: Creds) -> Job:
    return _owned(request, session, creds, Job, job_id, "job")


def zoo_model(model_id: str, session: SessionDep, caller: CallerDep) -> ZooModel:
    """A model in the zoo; a removed one is not found (``zoo_catalog.REMOVED_ORIGIN``)."""
    row = get_owned(session, caller, ZooModel, model_id, "zoo model")
    if row.origin == REMOVED_ORIGIN:
        raise Problem(404, f"no zoo model {model_id!r}", kind=_not_found("zoo model"))
    return row


DatasetDep = Annotated[Dataset, Depends(owned_dataset)]
JobDep = Annotated[Job, Depends(owned_job)]
ZooModelDep = Annotated[ZooModel, Depends(zoo_model)]
