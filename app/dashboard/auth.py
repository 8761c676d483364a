"""Dashboard sign-in: the API key in an HttpOnly session cookie, and CSRF tokens for forms.

The cookie holds the API key the user signed in with, so every page authenticates through
the API's own key check (``service.security.authenticate``): revoking the key signs the
browser out at once, and several API processes need no shared session store. It is HttpOnly
(no script reads it), SameSite=Lax (not sent on cross-site POSTs) and Secure over https.

Forms carry a CSRF token (double submit): a random value in a second cookie that the form
must echo, in a hidden field or an ``X-CSRF-Token`` header. A cross-site page can neither
read that cookie nor set it, so it cannot forge a matching form.
"""

from __future__ import annotations

import hmac
import secrets
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import Response
from sqlalchemy.orm import Session

from zoopick.app.api.deps import Caller
from zoopick.service.security import authenticate, touch

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


def caller_or_none(request: Request, session: Session) -> Caller | None:
    token = request.cookies.get(SESSION_COOKIE)
    if not token:
        return None
    key = authenticate(session, token)
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


def sign_in(response: Response, request: Request, token: str) -> None:
    response.set_cookie(
        SESSION_COOKIE,
        token,
        max_age=MAX_AGE,
        httponly=True,
        samesite="lax",
        secure=secure(request),
        path="/",
    )


def sign_out(response: Response) -> None:
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
    if not expected or not sent or not hmac.compare_digest(expected, sent):
        raise CsrfFailed()
