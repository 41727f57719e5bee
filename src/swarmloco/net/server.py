"""The one gRPC server of a peer: every service of the peer on one port, hardened.

Limits against misbehaving or hostile clients (DESIGN section 8): the largest message it
accepts, how many RPCs run at once (beyond that a call is refused with RESOURCE_EXHAUSTED
instead of queueing without bound), how many streams one connection may open, how long
a new connection may take to finish its handshake, keepalive pings that find dead
connections, and how long a ping may go unanswered. The standard gRPC health service is
always on, so `grpc_health_probe` works against any peer; server reflection (for
`grpcurl`) is off unless asked for, so a public peer does not list its services to anyone.

Calls are admitted by :class:`CallSlots`, in three pools, so that no caller can take the
slots another kind of call needs: calls at large, counted per source network (a /24, a
/64, a loopback or private address by itself) and in all; long-lived calls (health
``Watch``, reflection: they stay open without doing this peer's work) on a small budget of
their own, per network and in all; and a reserve for the hosts of the group this peer
averages with now, which the averaging layer names with an expiry
(:meth:`CallSlots.reserve`) and no stranger can take.

The port serves TLS by default, with the peer's own key and self-signed certificate
(net/tls.py): callers check the certificate against the peer's signed card.

Other layers add their services with :class:`Service` registrations before the server
starts (gRPC cannot add services to a running server); :func:`unary_service` builds one
whose handlers never see undecodable bytes: a malformed request is refused with
INVALID_ARGUMENT and counted, instead of surfacing as an UNKNOWN error with a traceback in
the log (which a stream of garbage would turn into a flood).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from swarmloco.core.config import require, require_int, require_positive
from swarmloco.errors import NetworkError
from swarmloco.net.endpoints import (
    canonical_host,
    format_endpoint,
    host_of_grpc_peer,
    is_unspecified,
    source_network,
)
from swarmloco.net.heap import release_after
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.net.tls import TlsCredentials

logger = logging.getLogger(__name__)


class _CancelledCalls(logging.Filter):
    """grpc logs a call whose handler was cancelled as an unhandled exception, with its
    traceback; a peer leaving cancels what is still running on its loop, a call that came
    in at that moment among it. Nothing went wrong: that record is dropped, no other."""

    def filter(self, record: logging.LogRecord) -> bool:
        cancelled = record.exc_info is not None and record.exc_info[0] is asyncio.CancelledError
        return not (cancelled and record.getMessage().startswith("Exception not handled"))


logging.getLogger("grpc._cython.cygrpc").addFilter(_CancelledCalls())


@dataclasses.dataclass(frozen=True)
class Service:
    """A gRPC service to serve: its full name and how to add it to a server.

    Example: ``Service("swarmloco.v1.Dht", lambda s: add_DhtServicer_to_server(impl, s))``.
    """

    name: str
    register: Callable[[grpc.aio.Server], None]


UnaryHandler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]]


def refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str) -> None:
    """End the call with ``code`` and ``reason`` once the handler returns (a unary handler
    returns any response, or None: grpc sends none with a status that is not OK).

    Use it rather than ``context.abort`` where the request may be large: grpc keeps an
    abort's exception, and with it every frame of its traceback and the request they hold,
    in a reference cycle that only the cyclic garbage collector frees, maybe minutes
    later (refused 7 MiB requests piled up that way)."""
    context.set_code(code)
    context.set_details(reason)


@dataclasses.dataclass(frozen=True)
class _Malformed:
    """What a request that does not decode becomes: its size, for ``release_after``."""

    size: int


def decoder(message_type: type[Message]) -> Callable[[bytes], Any]:
    """A request deserializer that turns undecodable bytes into a marker, not an exception."""

    def decode(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except Exception:  # any parse failure of untrusted bytes means "malformed"
            return _Malformed(len(data))

    return decode


def unary_service(
    name: str,
    methods: Mapping[str, tuple[type[Message], UnaryHandler]],
    *,
    rejections: RejectionLog,
) -> Service:
    """A service of unary methods ``{name: (request type, handler)}``, safe against garbage."""
    generic = grpc.method_handlers_generic_handler(
        name, unary_method_handlers(methods, rejections=rejections)
    )
    return Service(name, lambda server: server.add_generic_rpc_handlers((generic,)))


def unary_method_handlers(
    methods: Mapping[str, tuple[type[Message], UnaryHandler]],
    *,
    rejections: RejectionLog,
) -> dict[str, grpc.RpcMethodHandler]:
    """The method handlers of :func:`unary_service`, for a service that also streams."""

    def wrap(method: str, request_type: type[Message], handler: UnaryHandler) -> UnaryHandler:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Message:
            if isinstance(request, _Malformed):
                rejection = Rejection(
                    "malformed", f"{method}: the request is not a valid {request_type.__name__}"
                )
                rejections.record(rejection, context.peer())
                release_after(request.size)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, rejection.reason)
            return await handler(request, context)

        return call

    return {
        method: grpc.unary_unary_rpc_method_handler(
            wrap(method, request_type, handler),
            request_deserializer=decoder(request_type),
            response_serializer=lambda message: message.SerializeToString(),
        )
        for method, (request_type, handler) in methods.items()
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address to bind (0.0.0.0 or :: for every interface)."""
    port: int = 0
    """Port to bind; 0 picks a free one (read it back from ``PeerServer.port``)."""
    max_message_bytes: int = 8 * 1024 * 1024
    """Largest message received or sent; larger ones fail with RESOURCE_EXHAUSTED."""
    max_receive_bytes: int | None = None
    """Largest message received, when smaller than ``max_message_bytes`` (None: the same).
    gRPC refuses a larger one before it is whole; one under the limit is held whole in
    memory before any handler can refuse it, so a peer receives no more than its services
    need (a training peer: its swarm's averaging chunks)."""
    max_concurrent_rpcs: int = 512
    """Calls at large handled at once (all but long-lived calls and the members' reserve);
    beyond this new calls are refused with RESOURCE_EXHAUSTED instead of queueing."""
    max_concurrent_streams: int = 128
    """Streams one HTTP/2 connection may have open at once."""
    max_rpcs_per_network: int = 64
    """Calls at large handled at once from one source network (a /24 of IPv4, a /64 of
    IPv6, a loopback or private address by itself), all its connections together; beyond
    this its new calls are refused (by default 64 of 512: it takes eight networks to fill
    ``max_concurrent_rpcs``)."""
    max_long_calls: int = 32
    """Long-lived calls (health ``Watch``, reflection) open at once, on a budget of their
    own: however many there are, they take no slot of other calls."""
    max_long_calls_per_network: int = 4
    """Long-lived calls open at once from one source network."""
    max_sessions: int = 256
    """Sessions (:data:`SESSION_CALLS`: a pipeline driver's with a stage replica) open at
    once, on a budget of their own: they take no slot of other calls."""
    max_sessions_per_network: int = 32
    """Sessions open at once from one source network."""
    reserved_rpcs: int = 128
    """Calls held at once for the hosts of the group this peer averages with now (named
    by the averaging layer, :meth:`CallSlots.reserve`); a stranger never gets these.
    Members' calls beyond it are calls at large."""
    handshake_timeout_s: float = 5.0
    """A new connection that has not finished its handshake by then is closed."""
    keepalive_time_s: float = 60.0
    """Server-side keepalive ping interval on idle connections."""
    keepalive_timeout_s: float = 20.0
    """A connection whose keepalive ping is not acknowledged in this time is closed."""
    ping_timeout_s: float = 20.0
    """How long any HTTP/2 ping may go unanswered (grpc.http2.ping_timeout_ms)."""
    min_client_ping_interval_s: float = 10.0
    """Clients pinging more often than this are told off and, after strikes, cut off."""
    max_connection_idle_s: float = 120.0
    """Connections without calls for this long are closed."""
    grace_s: float = 2.0
    """At shutdown, calls in flight get this long to finish."""
    tls: bool = True
    """Serve TLS (the key given to PeerServer, else a fresh one). Every peer of a swarm
    must agree: a TLS caller cannot talk to a plain server, nor the reverse."""
    reflection: bool = False
    """Serve gRPC server reflection (lets `grpcurl` list the services)."""
    tls_cert_file: str | None = None
    """An operator's own certificate (PEM, chain after the leaf) instead of the peer's
    self-signed one; needs ``tls_key_file``."""
    tls_key_file: str | None = None
    """The key of ``tls_cert_file`` (unencrypted PEM)."""

    def __post_init__(self) -> None:
        require(isinstance(self.host, str), "host must be a string")
        require_int("port", self.port, minimum=0)
        require(self.port < 65536, f"port must be < 65536, got {self.port}")
        require_int("max_message_bytes", self.max_message_bytes, minimum=1024)
        if self.max_receive_bytes is not None:
            require_int("max_receive_bytes", self.max_receive_bytes, minimum=1024)
        require_int("max_concurrent_rpcs", self.max_concurrent_rpcs, minimum=1)
        require_int("max_concurrent_streams", self.max_concurrent_streams, minimum=1)
        require_int("max_rpcs_per_network", self.max_rpcs_per_network, minimum=1)
        require_int("max_long_calls", self.max_long_calls, minimum=1)
        require_int("max_long_calls_per_network", self.max_long_calls_per_network, minimum=1)
        require_int("max_sessions", self.max_sessions, minimum=1)
        require_int("max_sessions_per_network", self.max_sessions_per_network, minimum=1)
        require_int("reserved_rpcs", self.reserved_rpcs, minimum=0)
        for name in (
            "handshake_timeout_s",
            "keepalive_time_s",
            "keepalive_timeout_s",
            "ping_timeout_s",
            "min_client_ping_interval_s",
            "max_connection_idle_s",
            "grace_s",
        ):
            require_positive(name, getattr(self, name))
        require(
            (self.tls_cert_file is None) == (self.tls_key_file is None),
            "tls_cert_file and tls_key_file go together",
        )

    def options(self) -> list[tuple[str, Any]]:
        ms = lambda seconds: int(seconds * 1000)  # noqa: E731
        return [
            ("grpc.max_receive_message_length", self.receive_limit),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.server_handshake_timeout_ms", ms(self.handshake_timeout_s)),
            ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.http2.ping_timeout_ms", ms(self.ping_timeout_s)),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_client_ping_interval_s)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.max_connection_idle_ms", ms(self.max_connection_idle_s)),
            # Two peers must never share a port by accident.
            ("grpc.so_reuseport", 0),
        ]

    @property
    def receive_limit(self) -> int:
        """The largest message this server receives."""
        if self.max_receive_bytes is None:
            return self.max_message_bytes
        return min(self.max_receive_bytes, self.max_message_bytes)

    @property
    def grpc_max_rpcs(self) -> int:
        """gRPC's own cap on calls at once, a backstop behind :class:`CallSlots`: a call
        that the slots refuse still counts there while its refusal goes out, so it is set
        well above the pools together (else a flood of refused calls would shut out
        the members' reserve)."""
        return 2 * self.max_concurrent_rpcs + self.max_long_calls + self.reserved_rpcs


LONG_CALLS = frozenset(
    {
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    }
)
"""Calls that stay open as long as the caller likes without doing this peer's work."""
SESSION_CALLS = frozenset({"/swarmloco.v1.Stage/Session", "/swarmloco.v1.Stage/Attend"})
"""Calls a caller keeps open while it works with this peer, doing no work themselves: a
pipeline driver's session with a stage replica (its end tells the replica the driver is
gone, docs/DESIGN.md section 10)."""


class Pool(enum.Enum):
    """Where a call's slot comes from."""

    AT_LARGE = "at-large"
    """Any caller's calls, per source network and in all."""
    LONG = "long"
    """Long-lived calls (:data:`LONG_CALLS`), per source network and in all."""
    RESERVED = "reserved"
    """Calls from the hosts of the group this peer averages with now, counted per host."""
    SESSION = "session"
    """Sessions (:data:`SESSION_CALLS`), per source network and in all."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """A call's place: its pool, and what it counts under there (a network or a host)."""

    pool: Pool
    key: str


class CallSlots:
    """Which calls may run now: the bookkeeping behind :class:`PeerServer`'s admission.

    :meth:`take` gives a call a :class:`Slot` or raises a :class:`Rejection` saying which
    limit it hit; :meth:`give` returns the slot when the call ends. A long-lived call only
    ever takes a long slot, so a caller that opens hundreds of health ``Watch`` streams
    holds ``max_long_calls_per_network`` of them and nothing else. A call from a reserved
    host takes a reserved slot while there are some left, then one at large. Members share
    the reserve without a cap each: they are few, known, and signed into the group (and
    on one machine, a local swarm's members are all one host). Pure: no I/O, and the
    clock (for reservations' expiry) is injected.
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_reserved_hosts: int = 4096,
    ) -> None:
        self.config = config
        self._clock = clock
        self._max_reserved_hosts = max_reserved_hosts
        self._held: dict[Pool, collections.Counter[str]] = {p: collections.Counter() for p in Pool}
        self._reserved: dict[str, float] = {}
        self.taken: collections.Counter[Pool] = collections.Counter()
        """Slots given so far, by pool."""

    @property
    def in_flight(self) -> int:
        """Calls holding a slot now, in every pool."""
        return sum(self.in_use(pool) for pool in Pool)

    def in_use(self, pool: Pool) -> int:
        return sum(self._held[pool].values())

    def held(self, pool: Pool) -> dict[str, int]:
        """Slots held in ``pool`` now, by network (or host, for the reserve)."""
        return dict(self._held[pool])

    def reserve(self, hosts: Iterable[str], *, until: float) -> None:
        """Put calls from ``hosts`` on the reserve until ``until`` (on this object's clock,
        ``time.monotonic`` by default): the hosts of the group this peer averages with now,
        named once the group forms. A host already reserved keeps the later expiry."""
        now = self._clock()
        self._reserved = {h: t for h, t in self._reserved.items() if t > now}
        for host in hosts:
            key = canonical_host(host)
            if key and until > now:
                self._reserved[key] = max(until, self._reserved.get(key, until))
        if len(self._reserved) > self._max_reserved_hosts:
            # Only rounds overlapping without end get here: keep the latest expiries.
            latest = sorted(self._reserved.items(), key=lambda item: item[1])
            self._reserved = dict(latest[-self._max_reserved_hosts :])

    def reserved(self, host: str) -> bool:
        """Whether calls from ``host`` may take the reserve now."""
        until = self._reserved.get(canonical_host(host))
        return until is not None and until > self._clock()

    def take(self, host: str, *, long: bool, session: bool = False) -> Slot:
        """A slot for a call from ``host`` (``long``: one of :data:`LONG_CALLS`;
        ``session``: one of :data:`SESSION_CALLS`), or a :class:`Rejection` naming the
        limit it hit."""
        config = self.config
        network = source_network(host)
        if session:
            return self._open(
                Pool.SESSION, network, config.max_sessions_per_network, config.max_sessions,
                code="too-many-sessions", what="sessions",
            )  # fmt: skip
        if long:
            return self._open(
                Pool.LONG, network, config.max_long_calls_per_network, config.max_long_calls,
                code="too-many-long-calls", what="long-lived calls (health Watch, reflection)",
            )  # fmt: skip
        member = canonical_host(host)
        if self.reserved(member) and self.in_use(Pool.RESERVED) < config.reserved_rpcs:
            return self._hold(Pool.RESERVED, member)
        if self._held[Pool.AT_LARGE][network] >= config.max_rpcs_per_network:
            raise Rejection(
                "too-many-calls",
                f"{config.max_rpcs_per_network} calls from {network} are in flight already",
            )
        if self.in_use(Pool.AT_LARGE) >= config.max_concurrent_rpcs:
            raise Rejection(
                "server-busy",
                f"this peer is handling {config.max_concurrent_rpcs} calls already",
            )
        return self._hold(Pool.AT_LARGE, network)

    def _open(
        self, pool: Pool, network: str, per_network: int, total: int, *, code: str, what: str
    ) -> Slot:
        """A slot of a pool of calls that stay open (long calls, sessions): ``per_network``
        of them from one network at most, ``total`` in all."""
        if self._held[pool][network] >= per_network:
            raise Rejection(code, f"{per_network} {what} from {network} are open already")
        if self.in_use(pool) >= total:
            raise Rejection(code, f"this peer holds {total} {what} already")
        return self._hold(pool, network)

    def give(self, slot: Slot) -> None:
        held = self._held[slot.pool]
        held[slot.key] -= 1
        if held[slot.key] <= 0:
            del held[slot.key]

    def _hold(self, pool: Pool, key: str) -> Slot:
        self._held[pool][key] += 1
        self.taken[pool] += 1
        return Slot(pool, key)


class SlotLimit(grpc.aio.ServerInterceptor):
    """Admits each call through ``slots``: a call refused there ends at once with
    RESOURCE_EXHAUSTED (its caller tries again later or elsewhere), and the refusal is
    counted with its reason; a call let in holds its slot until it ends (a stream until
    its last message)."""

    def __init__(self, slots: CallSlots, rejections: RejectionLog) -> None:
        self.slots = slots
        self._rejections = rejections

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        long = details.method in LONG_CALLS
        session = details.method in SESSION_CALLS
        kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        kind = next(k for k in kinds if getattr(handler, k) is not None)
        limited = self._limited(getattr(handler, kind), long=long, session=session)
        return handler._replace(**{kind: limited})  # type: ignore[attr-defined]

    def _enter(
        self, context: grpc.aio.ServicerContext, *, long: bool, session: bool
    ) -> Slot | Rejection:
        host = host_of_grpc_peer(context.peer())
        try:
            return self.slots.take(host, long=long, session=session)
        except Rejection as rejection:
            # Logged once per source network and reason: a flood from one network is
            # one line every few seconds, however many addresses it calls from.
            self._rejections.record(rejection, source_network(host))
            return rejection

    def _limited(
        self, behaviour: Callable[..., Any], *, long: bool, session: bool
    ) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behaviour):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                slot = self._enter(context, long=long, session=session)
                if isinstance(slot, Rejection):
                    refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, _refusal(slot))
                    return
                try:
                    async for item in behaviour(request, context):
                        yield item
                finally:
                    self.slots.give(slot)

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            slot = self._enter(context, long=long, session=session)
            if isinstance(slot, Rejection):
                # Not context.abort: its exception would keep the request (up to the
                # message limit) alive in a reference cycle (see ``refuse``).
                refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, _refusal(slot))
                return None
            try:
                return await behaviour(request, context)
            finally:
                self.slots.give(slot)

        return call


def _refusal(rejection: Rejection) -> str:
    return f"{rejection.reason}; try again later"


MAX_SERVICE_NAME_CHARS = 200
"""The longest service name the health service looks up (ours are under 40)."""


class BoundedHealth(health.aio.HealthServicer):
    """The standard health service, refusing service names longer than any real one with
    INVALID_ARGUMENT (counted): a ``Watch`` keeps its request, and the name as a dictionary
    key, for as long as it stays open."""

    def __init__(self, rejections: RejectionLog) -> None:
        super().__init__()
        self._rejections = rejections

    def _refused(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> bool:
        """Whether the request was refused (its status set: the caller returns at once)."""
        # The message's size first: reading the name would copy it, however long.
        size = request.ByteSize()
        if size <= 4 * MAX_SERVICE_NAME_CHARS + 8:
            return False
        reason = f"a health service name is at most {MAX_SERVICE_NAME_CHARS} characters"
        self._rejections.record(Rejection("malformed", reason), context.peer())
        release_after(size)
        refuse(context, grpc.StatusCode.INVALID_ARGUMENT, reason)
        return True

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        if self._refused(request, context):
            return health_pb2.HealthCheckResponse()
        return await super().Check(request, context)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        if not self._refused(request, context):
            await super().Watch(request, context)


class PeerServer:
    """An async context manager that serves ``services`` (plus health, and reflection if
    configured), over TLS with ``credentials`` (default: a fresh key) unless ``config.tls``
    is off."""

    def __init__(
        self,
        config: ServerConfig,
        services: Sequence[Service] = (),
        *,
        credentials: TlsCredentials | None = None,
    ) -> None:
        self.config = config
        self.credentials = (credentials or TlsCredentials.generate()) if config.tls else None
        self._services = list(services)
        self._server: grpc.aio.Server | None = None
        self.rejections = RejectionLog(logger)
        self._health = BoundedHealth(self.rejections)
        self.slots = CallSlots(config)
        """Who may call now; the averaging layer reserves its group's hosts here."""
        self.port = 0

    def add_service(self, service: Service) -> None:
        if self._server is not None:
            raise RuntimeError("add services before the server starts")
        self._services.append(service)

    @property
    def tls_fingerprint(self) -> bytes:
        """What the peer's card publishes of its TLS key (empty without TLS)."""
        return self.credentials.fingerprint if self.credentials is not None else b""

    @property
    def service_names(self) -> list[str]:
        return [s.name for s in self._services]

    def endpoint(self, announce_host: str | None = None) -> str:
        """``HOST:PORT`` others can dial: ``announce_host`` or else the bound host."""
        host = announce_host or self.config.host
        if is_unspecified(host):
            raise ValueError("bound to every interface: say which host to announce")
        return format_endpoint(host, self.port)

    async def __aenter__(self) -> PeerServer:
        server = grpc.aio.server(
            options=self.config.options(),
            maximum_concurrent_rpcs=self.config.grpc_max_rpcs,
            interceptors=[SlotLimit(self.slots, self.rejections)],
        )
        for service in self._services:
            service.register(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if self.config.reflection:
            names = [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
            reflection.enable_server_reflection(names, server)
        address = format_endpoint(self.config.host or "0.0.0.0", self.config.port)
        try:
            if self.credentials is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, self.credentials.server_credentials())
        except RuntimeError as exc:
            port = 0
            cause = f": {exc}"
        else:
            cause = ""
        if port == 0:
            raise NetworkError(
                f"cannot listen on {address}{cause} (is the port in use or the host not "
                "an address of this machine?)"
            )
        await server.start()
        self._server = server
        self.port = port
        for name in ("", *self.service_names):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.debug("serving %s on port %d", ", ".join(self.service_names), port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        await self._health.enter_graceful_shutdown()
        # The grace is for our calls in flight. With none, grpc still waits all of it while
        # other peers hold connections open (2 s of every peer's exit, measured). Long
        # calls and sessions do no work to finish: a stranger's Watch must not delay every
        # exit.
        idle = self.slots.in_use(Pool.LONG) + self.slots.in_use(Pool.SESSION)
        working = self.slots.in_flight - idle
        await server.stop(self.config.grace_s if working else 0)
