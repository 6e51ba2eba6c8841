"""Routes: ``GET /docs``, the interactive API reference, with no network.

FastAPI's own page loads Swagger UI from a CDN: offline (a cluster node, an air-gapped machine)
it is blank. This one loads the copy vendored in ``buffer/service/static/vendor/swagger-ui`` through the
dashboard's asset route. Every URL is relative, so the page also works behind a proxy that
serves the buffer under a path prefix. ReDoc, CDN-only as well, is not served.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.responses import HTMLResponse

router = APIRouter(tags=["service"])

VENDOR = "dashboard/static/vendor/swagger-ui"


@router.get("/docs", include_in_schema=False)
async def docs() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="openapi.json",
        title="rollout-buffer API",
        swagger_js_url=f"{VENDOR}/swagger-ui-bundle.js",
        swagger_css_url=f"{VENDOR}/swagger-ui.css",
        swagger_favicon_url="data:,",  # no icon rather than one fetched from the internet
    )
