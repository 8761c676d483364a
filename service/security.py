"""API keys: random bearer tokens of which only the SHA-256 is stored.

A token looks like ``zp_<43 url-safe chars>``; its first 11 characters (the *prefix*) are kept
in clear so a listing can say which key is which without being able to reconstruct it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import TypeVar

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from zoopick.service.db.models import ApiKey, Tenant
from zoopick.service.db.types import utcnow

T = TypeVar("T")

TOKEN_PREFIX = "zp_"
SHOWN = 11


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def get_or_create_tenant(session: Session, name: str) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        tenant = Tenant(name=name)
        session.add(tenant)
        session.flush()
    return tenant


def create_api_key(
    session: Session, *, tenant: str, name: str, admin: bool = False
) -> tuple[ApiKey, str]:
    """Create a key for tenant ``tenant`` (created if new); returns the row and the token,
    which is shown once and never stored."""
    owner = get_or_create_tenant(session, tenant)
    token = new_token()
    key = ApiKey(
        tenant_id=owner.id,
        name=name,
        prefix=token[:SHOWN],
        token_hash=hash_token(token),
        is_admin=admin,
    )
    session.add(key)
    session.flush()
    return key, token


def authenticate(session: Session, token: str) -> ApiKey | None:
    """The live key for ``token``, or None. The lookup is by hash; the final comparison is
    constant-time anyway."""
    digest = hash_token(token)
    return _live(session.scalar(select(ApiKey).where(ApiKey.token_hash == digest)), digest)


def authenticate_owned(
    session: Session, token: str, model: type[T], row_id: object
) -> tuple[ApiKey | None, T | None]:
    """The live key for ``token`` and the row ``row_id`` of ``model`` if the key's tenant owns
    it (else None), in one statement: the API's most frequent request, a job poll, needs both,
    and a statement costs more than the join."""
    digest = hash_token(token)
    owned = and_(model.id == row_id, model.tenant_id == ApiKey.tenant_id)  # type: ignore[attr-defined]
    found = session.execute(
        select(ApiKey, model).outerjoin(model, owned).where(ApiKey.token_hash == digest)
    ).first()
    if found is None or _live(found[0], digest) is None:
        return None, None
    return found[0], found[1]


def _live(key: ApiKey | None, digest: str) -> ApiKey | None:
    if key is None or key.revoked_at is not None:
        return None
    if not hmac.compare_digest(key.token_hash, digest):
        return None
    return key


def touch(session: Session, key: ApiKey) -> None:
    """Record use, at most once a minute (a write per request would be wasteful)."""
    now = utcnow()
    if key.last_used_at is None or (now - key.last_used_at).total_seconds() > 60:
        key.last_used_at = now
