"""A real TCP proxy on 127.0.0.1 that forwards to a peer's server and can break the link.

A peer announces the proxy's port (``NodeConfig.announce_port``), so everything other
peers send it goes through the proxy, as through a router or a flaky link. The proxy
counts the bytes it forwards (both directions) and, once ``arm(...)``ed, turns faulty when
that count passes a threshold, so a fault lands in the middle of a round's streams:

- ``cut``: every open connection is closed at once (the connection reset of a dropped
  link); new connections go through again;
- ``blackhole``: connections stay open, new ones are accepted, and every byte from then
  on is swallowed (a link that silently stops delivering);
- ``delay``: every byte is forwarded ``delay_s`` later (latency, not a rate cap).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Literal

Mode = Literal["pass", "cut", "blackhole", "delay"]


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target()`` (asked at each connection: a server's
    port may be known only once it started), connecting from ``source``: with 127.0.0.N
    the target sees each client of the proxy as a caller at that address."""

    def __init__(self, *, source: str = "127.0.0.1") -> None:
        self.source = source
        self.target: Callable[[], tuple[str, int]] | None = None
        self.mode: Mode = "pass"
        self.delay_s = 0.0
        self.forwarded = 0
        """Bytes forwarded so far, both directions together."""
        self.fired = asyncio.Event()
        self._armed: tuple[Mode, int] | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    def arm(self, mode: Mode, *, after_bytes: int, delay_s: float = 0.0) -> None:
        """Turn ``mode`` on once ``after_bytes`` more bytes went through."""
        self.delay_s = delay_s
        self._armed = (mode, self.forwarded + after_bytes)

    def cut(self) -> None:
        """Close every open connection now (new ones go through): after a ``blackhole``,
        the bytes it swallowed are gone, and a stream going on without them is corrupt."""
        self._fire("cut")

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def _fire(self, mode: Mode) -> None:
        self.mode = mode
        self._armed = None
        self.fired.set()
        if mode == "cut":
            for w in list(self._writers):
                w.transport.abort()  # RST, not a polite FIN
            self._writers.clear()
            self.mode = "pass"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.target is not None, "set the proxy's target before peers dial it"
        try:
            up_reader, up_writer = await asyncio.open_connection(
                *self.target(), local_addr=(self.source, 0)
            )
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.get_running_loop().create_task(self._pipe(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        # Delayed data waits in a queue, so latency does not also cut the rate.
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        sender = asyncio.get_running_loop().create_task(self._send(queue, dst))
        try:
            while data := await src.read(65536):
                if self.mode == "blackhole":
                    continue
                self.forwarded += len(data)
                due = time.monotonic() + (self.delay_s if self.mode == "delay" else 0.0)
                queue.put_nowait((due, data))
                if self._armed is not None and self.forwarded >= self._armed[1]:
                    self._fire(self._armed[0])
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)
            with contextlib.suppress(ConnectionError, OSError):
                await sender
            if self.mode != "blackhole":  # a black hole never says goodbye (closed on exit)
                dst.close()
                self._writers.discard(dst)

    async def _send(
        self, queue: asyncio.Queue[tuple[float, bytes] | None], dst: asyncio.StreamWriter
    ) -> None:
        while (item := await queue.get()) is not None:
            due, data = item
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)  # the injected latency itself
            if self.mode == "blackhole" or dst.is_closing():
                continue
            dst.write(data)
            await dst.drain()
