"""The dashboard's HTTP app: read-only, GET and HEAD only, on 127.0.0.1 by default.

- ``/`` the page (static/index.html): self-contained, its one inline script and one inline
  style allowed by their hashes in a strict Content-Security-Policy, nothing fetched from
  elsewhere; it refreshes itself from ``/api/v1/state``.
- ``/api/v1/state`` the view (dashboard/view.py) as JSON.
- ``/metrics`` the view in Prometheus text format (dashboard/metrics.py).

Any other method is answered 405. When bound to a loopback address, requests must name a
loopback host, so a web page elsewhere cannot read the dashboard through DNS rebinding.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import ipaddress
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from aiohttp import web

from swarmloco.dashboard import metrics
from swarmloco.net.endpoints import format_endpoint

ViewSource = Callable[[], Mapping[str, Any]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ALLOWED_METHODS = ("GET", "HEAD")
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})
_BASE_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
}
_DATA_CSP = "default-src 'none'; frame-ancestors 'none'"


@dataclasses.dataclass(frozen=True)
class Page:
    html: bytes
    csp: str
    """The Content-Security-Policy that allows exactly the page's inline script and style."""


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def load_page() -> Page:
    """static/index.html and a CSP naming the hashes of its one script and one style."""
    html = resources.files("swarmloco.dashboard").joinpath("static/index.html").read_text("utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.DOTALL)
    styles = re.findall(r"<style>(.*?)</style>", html, flags=re.DOTALL)
    assert len(scripts) == 1 and len(styles) == 1, "the page has one inline script and style"
    csp = "; ".join(
        [
            "default-src 'none'",
            f"script-src {_sha256(scripts[0])}",
            f"style-src {_sha256(styles[0])}",
            "connect-src 'self'",
            "img-src 'self'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    return Page(html.encode("utf-8"), csp)


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(header: str) -> str:
    """The host of a Host header (``name``, ``name:port``, ``[v6]:port``)."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def make_app(source: ViewSource, *, loopback_only: bool = True) -> web.Application:
    """The app serving ``source()`` (a callable returning the current view).

    ``loopback_only``: refuse requests whose Host header is not a loopback name or address
    (set it when the app is bound to loopback; a remote page cannot then rebind a name of
    its own to 127.0.0.1 and read the dashboard).
    """
    page = load_page()
    registry = metrics.make_registry(source)

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if request.method not in _ALLOWED_METHODS:
                raise web.HTTPMethodNotAllowed(request.method, list(_ALLOWED_METHODS))
            if loopback_only and not is_loopback(_host_of(request.headers.get("Host", ""))):
                raise web.HTTPMisdirectedRequest(
                    text="this dashboard only answers requests to a loopback address\n"
                )
            response = await handler(request)
        except web.HTTPException as exc:
            exc.headers.update(_BASE_HEADERS)
            exc.headers.setdefault("Content-Security-Policy", _DATA_CSP)
            exc.headers.setdefault("Cache-Control", "no-store")
            raise
        response.headers.update(_BASE_HEADERS)
        response.headers.setdefault("Content-Security-Policy", _DATA_CSP)
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    async def index(_request: web.Request) -> web.Response:
        return web.Response(
            body=page.html,
            content_type="text/html",
            charset="utf-8",
            headers={"Content-Security-Policy": page.csp, "Cache-Control": "no-cache"},
        )

    async def state(_request: web.Request) -> web.Response:
        body = json.dumps(source(), allow_nan=False, separators=(",", ":"))
        return web.Response(text=body, content_type="application/json")

    async def prometheus(_request: web.Request) -> web.Response:
        response = web.Response(body=metrics.render(registry))
        response.headers["Content-Type"] = metrics.CONTENT_TYPE
        return response

    app = web.Application(middlewares=[guard], client_max_size=1024)
    app.router.add_get("/", index)
    app.router.add_get("/api/v1/state", state)
    app.router.add_get("/metrics", prometheus)
    return app


@asynccontextmanager
async def serve(app: web.Application, *, host: str, port: int) -> AsyncIterator[str]:
    """Serve ``app`` on host:port (0: a free port) until the block ends; yields its URL."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        bound = runner.addresses[0]
        yield f"http://{format_endpoint(host, int(bound[1]))}/"
    finally:
        await runner.cleanup()
