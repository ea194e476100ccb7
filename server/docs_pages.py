"""`/docs` (Swagger UI) and `/redoc` with every asset served by the server itself: FastAPI's own pages load theirs
from a CDN, and are blank on a machine with no network, where this server often runs. The assets come from the
`fastapi-offline` package (Swagger UI 5, which reads FastAPI's OpenAPI 3.1, and ReDoc), a dependency."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS_URL = "/docs-assets"


def assets_dir() -> Path:
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


def add_docs_pages(app: FastAPI, openapi_url: str = "/openapi.json") -> None:
    """Serve `/docs` and `/redoc` for `app`'s schema at `openapi_url`, their scripts, styles and icon from
    ASSETS_URL."""
    app.mount(ASSETS_URL, StaticFiles(directory=assets_dir()), name="docs-assets")
    title = app.title

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        # validatorUrl: Swagger UI would otherwise send the schema to its public validator for a badge.
        return get_swagger_ui_html(openapi_url=openapi_url, title=f"{title} - Swagger UI",
                                   swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS_URL}/favicon.png",
                                   swagger_ui_parameters={"validatorUrl": None})

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=openapi_url, title=f"{title} - ReDoc",
                              redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{ASSETS_URL}/favicon.png", with_google_fonts=False)
