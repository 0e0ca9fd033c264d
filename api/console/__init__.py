"""The web console: operators' pages served by the API process under ``/console/``.

Server-rendered (Jinja2) pages built on the API's own handlers, refreshed by htmx, with a
uPlot chart; the JavaScript and CSS are vendored in ``static/vendor`` (no CDN: clusters are
often air-gapped; ``scripts/vendor-console.sh`` refreshes them). See docs/console.md.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from . import forms, pages
from .security_headers import ConsoleHeadersMiddleware

STATIC = Path(__file__).parent / "static"


def install_console(app: FastAPI) -> None:
    """Serve the console from ``app`` (pages, forms, static files, security headers)."""
    app.include_router(forms.router)
    app.include_router(pages.router)
    app.mount("/console/static", StaticFiles(directory=STATIC), name="console-static")

    @app.get("/console", include_in_schema=False)
    async def console_root() -> RedirectResponse:
        return RedirectResponse("/console/", status_code=308)

    app.add_middleware(ConsoleHeadersMiddleware)
