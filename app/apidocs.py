"""The API's documentation pages, ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), with their
scripts and styles served by this server, so they work offline.

FastAPI's own pages load Swagger UI and ReDoc from a CDN: a server without the internet, or
a browser behind a proxy that blocks the CDN, showed a blank page. The assets come from an
installed PyPI package, ``fastapi-offline`` (pyproject.toml, pinned in constraints.txt), whose
folder this app mounts at ``/docs/assets``; nothing of them is kept in this repository.
``/docs`` asks nothing of elsewhere (no validator badge); ``/redoc`` no Google fonts, only its
footer's "API docs by Redocly" logo, which ReDoc's bundle fetches from its vendor (offline,
that picture is missing and the page works).
(``swagger-ui-bundle``, the obvious package, ships Swagger UI 4, which refuses FastAPI's
OpenAPI 3.1 documents: "Unable to render this definition".)
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
ASSETS_URL = "/docs/assets"
ASSETS_PACKAGE = "fastapi_offline"


def assets_dir() -> Path:
    """The installed package's folder of Swagger UI's and ReDoc's files (found without
    importing the package)."""
    spec = find_spec(ASSETS_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            f"{ASSETS_PACKAGE} is not installed: the API docs pages need it (pip install -e .)"
        )
    return Path(spec.origin).parent / "static"


def install(app: FastAPI) -> None:
    """Serve ``/docs``, its OAuth2 redirect page and ``/redoc`` on ``app`` (made with
    ``docs_url=None, redoc_url=None``) from local assets, as FastAPI would from its CDN."""
    assert app.docs_url is None and app.redoc_url is None and app.openapi_url
    openapi_url = app.openapi_url
    app.mount(ASSETS_URL, StaticFiles(directory=assets_dir()), name="docs-assets")

    def prefix(request: Request) -> str:
        return request.scope.get("root_path", "").rstrip("/")

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = prefix(request)
        redirect = app.swagger_ui_oauth2_redirect_url
        return get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}/static/favicon.svg",
            oauth2_redirect_url=root + redirect if redirect else None,
            init_oauth=app.swagger_ui_init_oauth,
            # no "valid" badge fetched from validator.swagger.io: nothing leaves this server
            swagger_ui_parameters={"validatorUrl": None, **(app.swagger_ui_parameters or {})},
        )

    if app.swagger_ui_oauth2_redirect_url:

        @app.get(app.swagger_ui_oauth2_redirect_url, include_in_schema=False)
        async def swagger_ui_redirect() -> HTMLResponse:
            return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = prefix(request)
        return get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}/static/favicon.svg",
            with_google_fonts=False,
        )
