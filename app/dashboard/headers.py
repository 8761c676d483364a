"""Security headers on every response, and a content security policy on the dashboard's pages.

The dashboard renders user-given text (dataset, class and model names, errors) into HTML,
escaped by its templates; these headers are the second line: a page may not be framed
(``X-Frame-Options``, ``frame-ancestors``), a response is never sniffed into another type
(``nosniff``), and a dashboard page runs only the scripts, styles and images this server
serves (its one script is ``/static/app.js``; it has no inline script or style, and its charts
are inline SVG with presentation attributes, which the policy allows). The API's ``/docs`` and
``/redoc`` pages (``zoopick.app.apidocs``: Swagger UI and ReDoc, served by this server) start
them with inline script and styles, so they get no policy.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
EVERY_RESPONSE = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
)
NO_POLICY = ("/docs", "/redoc")


class SecurityHeaders:
    """Pure ASGI (it only adds headers to the response start: a streamed download is never
    buffered)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with_policy = not scope["path"].startswith(NO_POLICY)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                headers += [h for h in EVERY_RESPONSE if h[0] not in present]
                html = any(
                    name.lower() == b"content-type" and value.startswith(b"text/html")
                    for name, value in headers
                )
                if with_policy and html and b"content-security-policy" not in present:
                    headers.append((b"content-security-policy", POLICY.encode()))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)
