"""The dashboard's HTTP app: read-only, GET and HEAD only, on 127.0.0.1 by default.

- ``/`` the page (static/index.html): self-contained, its one inline script and one inline
  style allowed by their hashes in a strict Content-Security-Policy, nothing fetched from
  elsewhere; it refreshes itself from ``/api/v1/state``.
- ``/api/v1/state`` the view (dashboard/view.py) as JSON.
- ``/metrics`` the view in Prometheus text format (dashboard/metrics.py).

Any other method is answered 405. When bound to a loopback address, requests must name a
loopback host, so a web page elsewhere cannot read the dashboard through DNS rebinding.

The server (:func:`serve`) does not let clients hold connections without using them
(:class:`HttpConfig`): a connection whose first request's headers are not complete a few
seconds after it opened is closed, as is one idle after a response for longer than the
keep-alive, and connections are capped per source network and in all, so a host that
opens hundreds of half-open connections does not keep the page from anyone else.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import hashlib
import ipaddress
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any, cast

from aiohttp import web

from swarmloco.core.config import require_int, require_positive
from swarmloco.dashboard import metrics
from swarmloco.net.endpoints import format_endpoint, source_network
from swarmloco.net.rejections import Rejection, RejectionLog

logger = logging.getLogger(__name__)

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class HttpConfig:
    """How long and how many connections the dashboard's HTTP server keeps."""

    header_timeout_s: float = 5.0
    """A connection whose first request's headers have not all arrived this long after it
    opened is closed (a half-open connection, or one that never says anything)."""
    keepalive_s: float = 15.0
    """A connection with no new request's headers this long after its last response is
    closed (the page asks every 2 s, so its connection stays open)."""
    max_connections_per_source: int = 32
    """Connections kept at once from one source network (a /24, a /64, or one loopback or
    private address); more are answered 503 and closed as they open. A browser opens at
    most a few."""
    max_connections: int = 512
    """Connections kept at once from everyone together."""

    def __post_init__(self) -> None:
        require_positive("header_timeout_s", self.header_timeout_s)
        require_positive("keepalive_s", self.keepalive_s)
        require_int("max_connections_per_source", self.max_connections_per_source, minimum=1)
        require_int("max_connections", self.max_connections, minimum=1)


_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 50\r\n\r\ntoo many connections from your address; try later\n"
)


class _Connections:
    """The connections kept, by source network, and the refusals and closes counted."""

    def __init__(self, config: HttpConfig, rejections: RejectionLog) -> None:
        self.config = config
        self.rejections = rejections
        self.per_source: collections.Counter[str] = collections.Counter()

    def admit(self, source: str) -> Rejection | None:
        cfg = self.config
        if self.per_source[source] >= cfg.max_connections_per_source:
            return Rejection(
                "too-many-connections",
                f"{cfg.max_connections_per_source} connections from {source} are open already",
            )
        if self.per_source.total() >= cfg.max_connections:
            return Rejection(
                "too-many-connections", f"{cfg.max_connections} connections are open already"
            )
        self.per_source[source] += 1
        return None

    def release(self, source: str) -> None:
        self.per_source[source] -= 1
        if self.per_source[source] <= 0:
            del self.per_source[source]


class _Guarded(asyncio.Protocol):
    """One connection, in front of aiohttp's protocol for it: refused when its source has
    too many open, closed when its first request's headers do not arrive in time (aiohttp
    itself closes idle keep-alive connections, and half-open later requests, after
    ``keepalive_s``; earlier versions did not time out a connection's first request)."""

    def __init__(self, inner: asyncio.Protocol, connections: _Connections) -> None:
        self._inner = inner
        self._connections = connections
        self._transport: asyncio.Transport | None = None
        self._source: str | None = None  # set once admitted
        self._peer = ""
        self._header_timer: asyncio.TimerHandle | None = None
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass: no isinstance).
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if peer else ""
        source = source_network(self._peer)
        refusal = self._connections.admit(source)
        if refusal is not None:
            self._connections.rejections.record(refusal, self._peer)
            self._transport.write(_BUSY)
            self._transport.close()
            return
        self._source = source
        self._header_timer = asyncio.get_running_loop().call_later(
            self._connections.config.header_timeout_s, self._headers_late
        )
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._source is None:
            return  # refused: nothing it sends is read
        if self._header_timer is not None:
            seen = self._tail + data
            if b"\r\n\r\n" in seen or b"\n\n" in seen:
                self._header_timer.cancel()
                self._header_timer = None
                self._tail = b""
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._source is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._source is None:
            return
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._connections.release(self._source)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._source is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._source is not None:
            self._inner.resume_writing()

    def _headers_late(self) -> None:
        self._header_timer = None
        timeout = self._connections.config.header_timeout_s
        late = Rejection(
            "header-timeout", f"no complete request headers {timeout:g}s after connecting"
        )
        self._connections.rejections.record(late, self._peer)
        assert self._transport is not None
        self._transport.abort()


@asynccontextmanager
async def serve(
    app: web.Application,
    *,
    host: str,
    port: int,
    config: HttpConfig | None = None,
    rejections: RejectionLog | None = None,
) -> AsyncIterator[str]:
    """Serve ``app`` on host:port (0: a free port) until the block ends; yields its URL.

    ``config``: the limits on connections (:class:`HttpConfig`); ``rejections``: where the
    connections refused or timed out are counted and logged (a new log by default)."""
    config = config or HttpConfig()
    connections = _Connections(config, rejections or RejectionLog(logger))
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, keepalive_timeout=config.keepalive_s
    )
    await runner.setup()
    server: asyncio.Server | None = None
    try:
        handlers = runner.server  # aiohttp's low-level server: a protocol factory
        assert handlers is not None
        server = await asyncio.get_running_loop().create_server(
            lambda: _Guarded(handlers(), connections), host, port, reuse_address=True
        )
        bound = server.sockets[0].getsockname()
        yield f"http://{format_endpoint(host, int(bound[1]))}/"
    finally:
        if server is not None:
            server.close()  # no new connections; the runner closes the open ones
        await runner.cleanup()
        if server is not None:
            await server.wait_closed()
