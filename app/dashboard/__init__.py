"""The web dashboard, served by the API at ``/``: server-rendered pages (Jinja2) over the
API's own functions, signed in with an API key (see :mod:`.auth`)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from zoopick.app.dashboard.auth import CsrfFailed, LoginRequired
from zoopick.app.dashboard.headers import SecurityHeaders

STATIC = Path(__file__).parent / "static"


def install(app: FastAPI) -> None:
    """Add the pages, their static files and the sign-in redirect to ``app``."""
    from zoopick.app.dashboard.pages import router

    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_middleware(SecurityHeaders)  # every response; the policy on the pages

    @app.get("/favicon.ico", include_in_schema=False)
    def _favicon() -> FileResponse:
        # pages name /static/favicon.svg; a browser that asks the default path (a JSON page
        # opened directly) gets the same icon instead of a 404
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    @app.exception_handler(LoginRequired)
    async def _login(request: Request, exc: LoginRequired) -> RedirectResponse:
        return RedirectResponse(f"/login?next={exc.next_url}", status_code=303)

    @app.exception_handler(CsrfFailed)
    async def _csrf(request: Request, exc: CsrfFailed) -> HTMLResponse:
        return HTMLResponse(
            "<!doctype html><title>Form expired</title><h1>Form expired</h1>"
            '<p>This form was not sent from this browser\'s page. <a href="/">Reload</a> and '
            "try again.</p>",
            status_code=403,
        )
