"""A TCP forwarder whose connections reach the server from a chosen loopback address.

A gRPC client cannot pick its source address, so a test that needs callers on distinct
networks has them dial a :class:`SourceProxy`: a :class:`~tcpproxy.TcpProxy` that opens
each connection upstream from ``source`` (on Linux every 127.0.0.0/8 address belongs to
this machine), so the server sees the call come from ``source``. Unlike the fault proxy
it forwards with backpressure (a read waits until the write before it has drained), so a
caller that reads slowly is slow at the server too, instead of being read ahead for here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

from tcpproxy import TcpProxy


class SourceProxy(TcpProxy):
    """Forwards ``127.0.0.1:<port>`` to ``target``, from ``source``."""

    def __init__(self, source: str, target: tuple[str, int]) -> None:
        super().__init__()
        self.source = source
        self.target = lambda: target

    @property
    def endpoint(self) -> str:
        """Where to dial to call ``target`` from ``source``."""
        return f"127.0.0.1:{self.port}"

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.close()
        self._writers.discard(dst)


@asynccontextmanager
async def sources(
    addresses: Sequence[str], target: tuple[str, int]
) -> AsyncIterator[list[SourceProxy]]:
    """One started :class:`SourceProxy` to ``target`` per source address."""
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(SourceProxy(address, target)) for address in addresses
        ]
