"""Dashboard sign-in: a signed session cookie naming the API key, and CSRF tokens for forms.

Signing in checks the API key once; the cookie then holds ``v1.<key id>.<expiry>.<mac>``, an
HMAC-SHA256 under the server's session secret (``ZOOPICK_SESSION_SECRET``, or a random key
kept in ``<data_dir>/session.key``) of the key id, the expiry and the key's stored hash. It
never holds the API key itself: a leaked cookie gives 12 hours of dashboard, not a key for
the API. Every page re-reads the key row, so revoking the key signs the browser out at once,
and several API processes sharing the secret need no session store. The expiry is checked
on the server, not only by the browser. The cookie is HttpOnly (no script reads it),
SameSite=Lax (not sent on cross-site POSTs) and Secure over https.

Forms carry a CSRF token (double submit): a random value in a second cookie that the form
must echo, in a hidden field or an ``X-CSRF-Token`` header. A cross-site page can neither
read that cookie nor set it, so it cannot forge a matching form.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
import uuid
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import Response
from sqlalchemy.orm import Session

from zoopick.app.api.deps import Caller
from zoopick.service.db.models import ApiKey
from zoopick.service.db.types import utcnow
from zoopick.service.security import touch
from zoopick.service.settings import Settings

SESSION_COOKIE = "zoopick_session"
CSRF_COOKIE = "zoopick_csrf"
CSRF_FIELD = "csrf"
CSRF_HEADER = "x-csrf-token"
MAX_AGE = 12 * 3600


class LoginRequired(Exception):
    """Raised by a page when no valid session: the handler redirects to the sign-in page."""

    def __init__(self, next_url: str) -> None:
        super().__init__(next_url)
        self.next_url = next_url


class CsrfFailed(Exception):
    """A form came without the CSRF token of this browser."""


def secure(request: Request) -> bool:
    proto = request.headers.get("x-forwarded-proto", request.url.scheme)
    return proto.split(",")[0].strip() == "https"


def load_secret(settings: Settings) -> bytes:
    """The session-signing key: ``settings.session_secret``, else the random key in
    ``<data_dir>/session.key``, made on first use (written whole under another name, then
    linked into place, so processes starting together agree on one key)."""
    if settings.session_secret is not None:
        return settings.session_secret.get_secret_value().encode()
    path = settings.data_dir / "session.key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".session.key.{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
        except OSError:  # a filesystem without hard links: first rename wins, near enough
            if not path.exists():
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    secret = path.read_text().strip()
    if len(secret) < 32:
        raise RuntimeError(f"{path} holds no usable session secret: delete it to make a new one")
    return secret.encode()


def _mac(secret: bytes, key_id: str, expires: int, key: ApiKey) -> str:
    """The session MAC: over the key's id, the expiry, the key's token hash (a replaced key's
    sessions end) and when the key last signed out (so do those made before)."""
    msg = f"v1.{key_id}.{expires}.{key.token_hash}"
    if key.sessions_ended_at is not None:
        msg += f".{key.sessions_ended_at.timestamp():.6f}"
    msg = msg.encode()
    digest = hmac.new(secret, msg, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _note_mac(secret: bytes, name: str, text: str) -> str:
    digest = hmac.new(secret, f"note.{name}.{text}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def note_query(request: Request, name: str, text: str) -> dict[str, str]:
    """Query parameters carrying ``text`` to the page a form redirects to (a status line, an
    upload's error), signed: a page shows only notes this server wrote, not text a link
    chose ("Session expired: re-enter your API key at ...") in its official alert box."""
    return {name: text, f"{name}_sig": _note_mac(request.app.state.session_secret, name, text)}


def read_note(request: Request, name: str) -> str | None:
    """The note ``name`` of this request's query, if this server signed it (else none)."""
    text = request.query_params.get(name)
    sig = request.query_params.get(f"{name}_sig", "")
    if not text:
        return None
    expected = _note_mac(request.app.state.session_secret, name, text)
    return text if hmac.compare_digest(sig.encode(), expected.encode()) else None


def session_value(secret: bytes, key: ApiKey, expires: int) -> str:
    """The cookie value for ``key`` until ``expires`` (Unix seconds)."""
    return f"v1.{key.id}.{expires}.{_mac(secret, str(key.id), expires, key)}"


def session_key(session: Session, secret: bytes, value: str, now: float | None = None):
    """The live API key a cookie value names, or None: a wrong format, a bad MAC, an expiry
    in the past, or a key revoked (or replaced) since."""
    parts = value.split(".")
    if len(parts) != 4 or parts[0] != "v1":
        return None
    _, raw_id, raw_expires, mac = parts
    try:
        key_id, expires = uuid.UUID(raw_id), int(raw_expires)
    except ValueError:
        return None
    if expires <= (time.time() if now is None else now):
        return None
    key = session.get(ApiKey, key_id)
    if key is None or key.revoked_at is not None:
        return None
    expected = _mac(secret, raw_id, expires, key)
    if not hmac.compare_digest(mac.encode(), expected.encode()):  # bytes: see check_csrf
        return None
    return key


def caller_or_none(request: Request, session: Session) -> Caller | None:
    value = request.cookies.get(SESSION_COOKIE)
    if not value:
        return None
    key = session_key(session, request.app.state.session_secret, value)
    if key is None:
        return None
    touch(session, key)
    session.commit()
    return Caller(tenant_id=key.tenant_id, key_id=key.id, admin=key.is_admin)


def require_caller(request: Request, session: Session) -> Caller:
    caller = caller_or_none(request, session)
    if caller is None:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(quote(target, safe="/?=&"))
    return caller


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def sign_in_allowed(request: Request) -> None:
    """429 (a :class:`Problem`) once this address has failed authentication as often as the
    API allows (``ZOOPICK_RATE_AUTH_FAILURES``): the sign-in form is a door to the same keys,
    and shares the API's counter, so guessing keys there costs as much as on the API."""
    request.app.state.rate.blocked("auth_failures", _client(request), "failed authentications")


def sign_in_failed(request: Request) -> None:
    request.app.state.rate.count("auth_failures", _client(request))


def sign_in(response: Response, request: Request, key: ApiKey) -> None:
    expires = int(time.time()) + MAX_AGE
    response.set_cookie(
        SESSION_COOKIE,
        session_value(request.app.state.session_secret, key, expires),
        max_age=MAX_AGE,
        httponly=True,
        samesite="lax",
        secure=secure(request),
        path="/",
    )


def sign_out(request: Request, response: Response, session: Session) -> None:
    """Drop this browser's cookie and end the key's sessions on the server: a copy of the
    cookie (taken from this browser) no longer signs anyone in."""
    value = request.cookies.get(SESSION_COOKIE)
    key = session_key(session, request.app.state.session_secret, value) if value else None
    if key is not None:
        key.sessions_ended_at = utcnow()
        session.commit()
    response.delete_cookie(SESSION_COOKIE, path="/")


def csrf_token(request: Request) -> str:
    """This browser's CSRF token (a new one if it has none; :func:`keep_csrf` stores it)."""
    token = request.cookies.get(CSRF_COOKIE) or getattr(request.state, "csrf", None)
    if not token:
        token = secrets.token_urlsafe(24)
        request.state.csrf = token
    return token


def keep_csrf(request: Request, response: Response) -> Response:
    """Set the CSRF cookie on ``response`` if this request made a new token."""
    new = getattr(request.state, "csrf", None)
    if new and request.cookies.get(CSRF_COOKIE) != new:
        response.set_cookie(
            CSRF_COOKIE, new, max_age=MAX_AGE, samesite="strict", secure=secure(request), path="/"
        )
    return response


def check_csrf(request: Request, sent: str | None) -> None:
    expected = request.cookies.get(CSRF_COOKIE)
    sent = sent or request.headers.get(CSRF_HEADER)
    # compared as bytes: compare_digest refuses str with non-ASCII characters (a TypeError,
    # a 500 that anyone could have logged with a traceback)
    if not expected or not sent or not hmac.compare_digest(expected.encode(), sent.encode()):
        raise CsrfFailed()
