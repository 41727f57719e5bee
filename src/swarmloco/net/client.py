"""The gRPC client every peer uses to call other peers: cached channels, a deadline on every
call, bounded retries with exponential backoff and full jitter, and one clear error type.

A call names its :class:`Method` (path and message types) and a deadline (seconds or a
:class:`~swarmloco.net.deadline.Deadline`); there is no call without one. Only failures
that mean "the request never reached a handler" (``UNAVAILABLE``) are retried, and only
while both attempts and time are left. Everything else raises :class:`RpcError` at once.

With TLS (the default), a channel to an address is opened only once the certificate its
server presents is checked and pinned (net/tls.py): :meth:`RpcClient.open` does that, and
:meth:`RpcClient.call` through it. A server whose certificate is not the one its address
confirmed is refused with UNAUTHENTICATED, never retried. A certificate taken on first use
is confirmed before a call uses it: by the call's own answer for the DHT's calls (they
carry the server's signed card), by the client's ``confirm`` (a Ping) for every other.

Channels are cached, the least recently used closed beyond ``max_channels``, but never one
that a call or stream is using: closing a channel cancels every call on it, and anyone who
can make us dial addresses of their choosing (a DHT card names one) could otherwise end our
long streams to honest peers. A call through :meth:`RpcClient.call` holds its channel; a
stream is opened inside :meth:`RpcClient.holding`.

Fault injection (drop, delay, cut, corrupt, stall) plugs in as grpc.aio client
interceptors passed to the constructor: they see every unary and streaming call of every
channel this client opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message

from swarmloco.core.config import require, require_int, require_positive
from swarmloco.errors import NetworkError
from swarmloco.net.deadline import Deadline
from swarmloco.net.tls import CertBook, TlsError, TlsMismatch

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)
Confirm = Callable[[str, Deadline], Coroutine[Any, Any, None]]
"""Has the server at an address answer with its signed card (see RpcClient)."""


@dataclasses.dataclass(frozen=True)
class Method(Generic[Req, Resp]):
    """One unary RPC: ``/package.Service/Name`` and its message types."""

    path: str
    request_type: type[Req]
    response_type: type[Resp]

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


class RpcError(NetworkError):
    """A call failed; ``code`` is the gRPC status (UNAVAILABLE when unreachable)."""

    def __init__(self, message: str, *, endpoint: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.code = code


class TlsRefused(RpcError, TlsMismatch):
    """The server's TLS certificate is not the one its address confirmed, or its own card
    does not name it (code UNAUTHENTICATED); asking again would get the same answer."""

    def __init__(self, message: str, *, endpoint: str) -> None:
        super().__init__(message, endpoint=endpoint, code=grpc.StatusCode.UNAUTHENTICATED)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientConfig:
    max_message_bytes: int = 8 * 1024 * 1024
    """Largest message sent or received."""
    max_channels: int = 512
    """Channels kept open: beyond this the least recently used idle ones are closed (one
    with a call or stream open stays open until that ends)."""
    attempts: int = 3
    """Attempts per call when the peer is unavailable (1 = no retry)."""
    backoff_s: float = 0.05
    """First retry waits up to this long (full jitter); each further one doubles it."""
    max_backoff_s: float = 1.0
    """Longest wait between attempts."""
    keepalive_time_s: float = 30.0
    """HTTP/2 keepalive ping interval on idle connections."""
    keepalive_timeout_s: float = 10.0
    """A connection whose keepalive ping is not acknowledged in this time is dead."""
    tls: bool = True
    """Dial peers over TLS, checking each server's certificate against the signed card it
    answers with (every peer of a swarm must agree; see ServerConfig.tls)."""
    tls_handshake_timeout_s: float = 5.0
    """Longest wait for a server's certificate when first dialling it (and, as long
    again, for the Ping that confirms it)."""
    tls_claim_ttl_s: float = 600.0
    """How long the key a server proved for its address (its own signed card named it)
    keeps another certificate there from being taken, after the address last answered
    so; the claim ends sooner when that peer's DHT calls fail."""
    tls_ca_file: str | None = None
    """An operator's CA (PEM): servers must present a certificate it issued, as well as
    the one their card names. None: peers' self-signed certificates."""

    def __post_init__(self) -> None:
        require_int("max_message_bytes", self.max_message_bytes, minimum=1024)
        require_int("max_channels", self.max_channels, minimum=1)
        require_int("attempts", self.attempts, minimum=1)
        require_positive("backoff_s", self.backoff_s)
        require_positive("max_backoff_s", self.max_backoff_s)
        require(self.max_backoff_s >= self.backoff_s, "max_backoff_s must be >= backoff_s")
        require_positive("keepalive_time_s", self.keepalive_time_s)
        require_positive("keepalive_timeout_s", self.keepalive_timeout_s)
        require_positive("tls_handshake_timeout_s", self.tls_handshake_timeout_s)
        require_positive("tls_claim_ttl_s", self.tls_claim_ttl_s)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.http2.max_pings_without_data", 0),
            # Reconnect to a restarted peer soon; gRPC's default first backoff is 1 s.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 5000),
            # We retry ourselves, where the deadline is known.
            ("grpc.enable_retries", 0),
        ]


class RpcClient:
    """Calls to other peers. Use inside the application's event loop; close when done.

    ``confirm(endpoint, deadline)`` has the server at ``endpoint`` answer with its signed
    card through a DHT call (which checks it: net/dht/transport.py); it runs once before
    any other call uses a certificate taken on first use. Without it (a client that has
    no card to call with), such a certificate is used as it is.
    """

    def __init__(
        self,
        config: ClientConfig | None = None,
        *,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        rng: random.Random | None = None,
        confirm: Confirm | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or ClientConfig()
        self._confirm = confirm if self.config.tls else None
        self._interceptors = list(interceptors)
        self._rng = rng or random.Random()
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._pems: dict[str, bytes | None] = {}
        ca = None
        if self.config.tls and self.config.tls_ca_file:
            try:
                ca = Path(self.config.tls_ca_file).read_bytes()
            except OSError as exc:
                raise TlsError(f"cannot read the TLS CA file: {exc}") from None
        self.certs = CertBook(ca_pem=ca, claim_ttl_s=self.config.tls_claim_ttl_s, clock=clock)
        """The TLS keys addresses confirmed, and the certificates pinned."""
        self._stubs: dict[tuple[str, str], tuple[grpc.aio.Channel, Any]] = {}
        self._busy: dict[grpc.aio.Channel, int] = {}
        """The calls and streams open on each channel that has any."""
        self._retired: set[grpc.aio.Channel] = set()
        """Busy channels no longer cached, closed once their last call ends."""
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False

    async def __aenter__(self) -> RpcClient:
        self._closed = False
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        """The cached channel to ``endpoint``. With TLS the server's certificate must be
        checked first: use :meth:`open` unless it is known to be."""
        if self._closed:
            # A task that outlived its owner: a call on a channel nobody will close would
            # be left pending when the loop closes (grpc has crashed on such a call).
            raise NetworkError(f"the client is closed: no call to {endpoint}")
        pem: bytes | None = None
        if self.config.tls:
            pem = self.certs.pinned(endpoint)
            if pem is None:
                raise NetworkError(
                    f"no TLS certificate checked for {endpoint} yet (open the channel with "
                    "`await client.open(endpoint, timeout)`)"
                )
        channel = self._channels.get(endpoint)
        if channel is not None and self._pems.get(endpoint) == pem:
            self._channels.move_to_end(endpoint)
            return channel
        if channel is not None:  # the server's certificate changed: a new channel
            self._retire(self._drop(endpoint))
        if pem is None:
            channel = grpc.aio.insecure_channel(
                endpoint,
                options=self.config.channel_options(),
                interceptors=self._interceptors or None,
            )
        else:
            channel = grpc.aio.secure_channel(
                endpoint,
                grpc.ssl_channel_credentials(root_certificates=self.certs.ca_pem or pem),
                options=[
                    *self.config.channel_options(),
                    ("grpc.ssl_target_name_override", self.certs.server_name(endpoint)),
                ],
                interceptors=self._interceptors or None,
            )
        self._channels[endpoint] = channel
        self._pems[endpoint] = pem
        self._trim(keep=endpoint)
        return channel

    def _trim(self, keep: str | None = None) -> None:
        """Close the least recently used idle channels beyond ``max_channels`` (never the
        one to ``keep``, about to be used). Busy ones stay: the cache then holds more for a
        while, as many more as we have calls in flight to distinct peers, which their own
        limits bound (the DHT's background pings, a round's group, one download at a time).
        Refusing a new dial instead would let a stranger who keeps our calls busy (a slow
        answer to a ping) keep us from calling anyone else."""
        excess = len(self._channels) - self.config.max_channels
        if excess <= 0:
            return
        idle = [e for e, c in self._channels.items() if e != keep and c not in self._busy]
        for endpoint in idle[:excess]:  # oldest first
            self._close_later(self._drop(endpoint))

    def _drop(self, endpoint: str) -> grpc.aio.Channel:
        """Take the cached channel to ``endpoint`` out of the cache (it is not closed)."""
        channel = self._channels.pop(endpoint)
        self._pems.pop(endpoint, None)
        self._forget_stubs(endpoint)
        return channel

    def _retire(self, channel: grpc.aio.Channel) -> None:
        """Close a channel taken out of the cache, once no call uses it."""
        if channel in self._busy:
            self._retired.add(channel)
        else:
            self._close_later(channel)

    @contextlib.contextmanager
    def holding(self, channel: grpc.aio.Channel) -> Iterator[grpc.aio.Channel]:
        """Keep ``channel`` (one :meth:`open` just returned, no ``await`` since) open while
        the block runs: the cache closes no channel a call or stream is using. Open each
        stream in such a block, and end it there."""
        self._busy[channel] = self._busy.get(channel, 0) + 1
        try:
            yield channel
        finally:
            left = self._busy.pop(channel, 1) - 1
            if left > 0:
                self._busy[channel] = left
            elif channel in self._retired:
                self._retired.discard(channel)
                self._close_later(channel)
            else:
                self._trim()

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        # Closing is a coroutine; it runs beside us and close() waits for it.
        task = asyncio.get_running_loop().create_task(channel.close(grace=None))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def open(
        self, endpoint: str, timeout: float | Deadline, *, confirms_itself: bool = False
    ) -> grpc.aio.Channel:
        """The channel to ``endpoint``, its server's certificate checked first (TLS) and,
        when taken on first use, confirmed by the server's own signed card, unless
        ``confirms_itself`` (the caller checks the card the call is answered with).

        Raises RpcError: UNAVAILABLE when the server cannot be reached in time,
        UNAUTHENTICATED when its certificate is not the one its address confirmed or its
        own card does not name it."""
        if not self.config.tls:
            return self.channel(endpoint)
        deadline = timeout if isinstance(timeout, Deadline) else Deadline.after(timeout)
        try:
            if self.certs.pinned(endpoint) is None:
                wait = deadline.timeout(self.config.tls_handshake_timeout_s)
                await self.certs.certificate(endpoint, wait)
            if self._must_confirm(endpoint, confirms_itself):
                await self.certs.confirmation(endpoint, self._confirming(endpoint, deadline))
        except RpcError:
            raise  # the confirming call's own error (TlsRefused included) says it all
        except TlsMismatch as exc:
            raise TlsRefused(f"UNAUTHENTICATED: {exc}", endpoint=endpoint) from None
        except NetworkError as exc:
            code = grpc.StatusCode.UNAVAILABLE
            raise RpcError(f"{code.name}: {exc}", endpoint=endpoint, code=code) from None
        return self.channel(endpoint)

    def _must_confirm(self, endpoint: str, confirms_itself: bool) -> bool:
        """Whether a call must have the server confirm its certificate first."""
        if self._confirm is None or confirms_itself:
            return False
        return not self.certs.trusted(endpoint)

    def _confirming(
        self, endpoint: str, deadline: Deadline
    ) -> Callable[[], Coroutine[Any, Any, None]]:
        assert self._confirm is not None
        confirm = self._confirm
        wait = Deadline.after(deadline.timeout(self.config.tls_handshake_timeout_s))
        return lambda: confirm(endpoint, wait)

    def _forget_stubs(self, endpoint: str) -> None:
        for slot in [s for s in self._stubs if s[0] == endpoint]:
            del self._stubs[slot]

    async def _stub(
        self, endpoint: str, method: Method[Req, Resp], deadline: Deadline, confirms_itself: bool
    ) -> tuple[grpc.aio.Channel, Any]:
        """The cached channel to ``endpoint`` and a stub of ``method`` on it."""
        cached = self._stubs.get((endpoint, method.path))
        stale = self.config.tls and (
            self._pems.get(endpoint) != self.certs.pinned(endpoint)
            or self._must_confirm(endpoint, confirms_itself)
        )
        if cached is None or endpoint not in self._channels or stale:
            channel = await self.open(endpoint, deadline, confirms_itself=confirms_itself)
            stub = channel.unary_unary(
                method.path,
                request_serializer=method.request_type.SerializeToString,
                response_deserializer=method.response_type.FromString,
            )
            cached = self._stubs[(endpoint, method.path)] = (channel, stub)
        else:
            self._channels.move_to_end(endpoint)
        return cached

    async def forget(self, endpoint: str) -> None:
        """Close the channel to ``endpoint`` (a peer known to be gone), or drop it from the
        cache and close it once the calls it still carries end."""
        if endpoint not in self._channels:
            return
        channel = self._drop(endpoint)
        if channel in self._busy:
            self._retired.add(channel)
        else:
            await channel.close(grace=None)

    async def close(self) -> None:
        """Close every channel (the calls on them end) and end what runs for the calls
        (TLS fetches and confirmations); no call may be made after."""
        self._closed = True
        await self.certs.close()
        channels = [*self._channels.values(), *self._retired]
        self._channels.clear()
        self._retired.clear()
        self._pems.clear()
        self._stubs.clear()
        for channel in channels:
            await channel.close(grace=None)
        if self._closing:
            await asyncio.gather(*self._closing)

    async def call(
        self,
        endpoint: str,
        method: Method[Req, Resp],
        request: Req,
        *,
        timeout: float | Deadline,
        attempts: int | None = None,
        confirms_itself: bool = False,
    ) -> Resp:
        """Call ``method`` on ``endpoint`` and return its response.

        ``timeout`` bounds the whole call, retries included. ``confirms_itself``: the
        response carries the server's signed card and the caller checks it against the
        certificate (the DHT's calls), so a certificate taken on first use is not
        confirmed first. Raises :class:`RpcError` (a NetworkError) naming the endpoint,
        the method and the gRPC status.
        """
        deadline = timeout if isinstance(timeout, Deadline) else Deadline.after(timeout)
        attempts = self.config.attempts if attempts is None else attempts
        started = time.monotonic()
        attempt = 0
        rechecked = False  # a pin the server no longer has was dropped (once a call)
        while True:
            attempt += 1
            left = deadline.remaining()
            if left <= 0:
                raise RpcError(
                    f"{method.name} to {endpoint}: no time left for attempt {attempt} "
                    f"(deadline passed after {time.monotonic() - started:.2f}s)",
                    endpoint=endpoint,
                    code=grpc.StatusCode.DEADLINE_EXCEEDED,
                )
            try:
                channel, stub = await self._stub(endpoint, method, deadline, confirms_itself)
                with self.holding(channel):
                    response: Resp = await stub(request, timeout=deadline.remaining())
                return response
            except RpcError as exc:  # the certificate could not be had, or was refused
                if exc.code != grpc.StatusCode.UNAVAILABLE or attempt >= attempts:
                    message = (
                        f"{method.name} to {endpoint} failed: {exc} (attempt {attempt} of "
                        f"{attempts}, {time.monotonic() - started:.2f}s)"
                    )
                    if isinstance(exc, TlsRefused):
                        raise TlsRefused(message, endpoint=endpoint) from None
                    raise RpcError(message, endpoint=endpoint, code=exc.code) from None
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                details = (exc.details() or "").strip()
                if self.config.tls and "handshake" in details.lower():
                    # The server no longer has the certificate we pinned (a restart with
                    # another key): check its new one now. That check is no attempt of
                    # ours (once a call): an earlier attempt may have spent itself on the
                    # old connection's error, and the new key must be judged (refused
                    # when its address confirmed another), not reported as a failure to
                    # connect.
                    self.certs.forget(endpoint)
                    if not rechecked:
                        rechecked = True
                        attempt -= 1
                        continue
                retry = code == grpc.StatusCode.UNAVAILABLE and attempt < attempts
                if not retry:
                    raise RpcError(
                        f"{method.name} to {endpoint} failed: {code.name}: {details} "
                        f"(attempt {attempt} of {attempts}, "
                        f"{time.monotonic() - started:.2f}s)",
                        endpoint=endpoint,
                        code=code,
                    ) from None
            cap = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** (attempt - 1))
            await asyncio.sleep(min(self._rng.uniform(0, cap), deadline.remaining()))
