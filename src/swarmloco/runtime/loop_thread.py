"""The peer's one event loop, in a thread of its own, and the bridge the training thread
uses to reach it.

The training loop runs in the main thread (CUDA and torch are happiest there); everything
that talks to the network runs on one asyncio loop owned by a :class:`LoopThread`. The
training thread hands it coroutines through :meth:`LoopThread.run` (wait for the result,
with a timeout) or :meth:`LoopThread.submit` (a future to collect later, for an outer round
that overlaps inner steps). There is no other way across: no hidden executors, no loop
created anywhere else.

A timeout cancels the coroutine and waits for its cleanup before raising, so nothing keeps
running on the loop after the caller gave up. :meth:`LoopThread.stop` cancels whatever is
still running there, closes the loop and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_CLEANUP_GRACE_S = 5.0  # how long a cancelled coroutine may take to unwind


_GRPC_CALL_TASKS = frozenset({"_schedule_rpc_coro", "_handle_exceptions", "_handle_rpc"})
"""What grpc's asyncio server names the tasks of a call it serves."""


def _grpc_call(task: asyncio.Task[Any]) -> bool:
    return getattr(task.get_coro(), "__name__", None) in _GRPC_CALL_TASKS


def _loop_factory(use_uvloop: bool) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if not use_uvloop:
        return None
    try:
        import uvloop
    except ImportError:  # optional speed-up; the standard loop works the same
        return None
    return uvloop.new_event_loop


class LoopThread:
    """An asyncio event loop running in a daemon thread, started by :meth:`start` (or
    ``with``) and stopped by :meth:`stop`. The constructor starts nothing."""

    def __init__(self, *, name: str = "swarmloco-loop", use_uvloop: bool = True) -> None:
        self.name = name
        self.use_uvloop = use_uvloop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    # -- lifecycle --

    def start(self) -> LoopThread:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} was already started")
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise RuntimeError(f"{self.name} failed to start") from self._failure
        return self

    def _main(self) -> None:
        try:
            with asyncio.Runner(loop_factory=_loop_factory(self.use_uvloop)) as runner:
                runner.run(self._serve())
        except BaseException as e:  # reported to start(); the thread must not die silently
            self._failure = e
            logger.exception("%s stopped with an error", self.name)
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._ready.set()
        await self._stopping.wait()
        # Cancel what callers left running (submitted futures nobody collected) and let
        # it unwind before the loop closes.
        current = asyncio.current_task()
        leftover = [t for t in asyncio.all_tasks() if t is not current]
        # A stopped gRPC server's calls end by themselves once its core has failed their
        # last operation (within a millisecond); cancelled inside grpc's own code instead,
        # one prints a CancelledError traceback. They get the grace to end first.
        calls = [t for t in leftover if _grpc_call(t)]
        if calls:
            await asyncio.wait(calls, timeout=_CLEANUP_GRACE_S)
        leftover = [t for t in leftover if not t.done()]
        for task in leftover:
            task.cancel()
        if leftover:
            logger.info("%s: cancelling %d task(s) still running at stop", self.name, len(leftover))
            await asyncio.wait(leftover, timeout=_CLEANUP_GRACE_S)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything still running on the loop, close it and join the thread."""
        thread, loop, stopping = self._thread, self._loop, self._stopping
        if thread is None or loop is None or stopping is None:
            return
        if threading.current_thread() is thread:
            raise RuntimeError(f"{self.name}.stop() called from its own loop: it would deadlock")
        with contextlib.suppress(RuntimeError):  # the loop already closed
            loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"{self.name} did not stop within {timeout} s")
        self._loop = None

    def __enter__(self) -> LoopThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (for code that must schedule callbacks on it)."""
        if self._loop is None:
            raise RuntimeError(f"{self.name} is not running")
        return self._loop

    # -- the bridge --

    def _loop_for(self, coro: Coroutine[Any, Any, Any]) -> asyncio.AbstractEventLoop:
        if self._thread is not None and threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                f"called from {self.name} itself: await the coroutine instead of bridging"
            )
        try:
            return self.loop
        except RuntimeError:
            coro.close()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop and return at once; ``.result(timeout)`` collects it,
        ``.cancel()`` cancels it on the loop."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop_for(coro))

    def run(self, coro: Coroutine[Any, Any, T], *, timeout: float | None) -> T:
        """Run ``coro`` on the loop and wait for its result (its exception is raised here).

        After ``timeout`` seconds the coroutine is cancelled, its cleanup is awaited (up to
        a few seconds) and :class:`TimeoutError` is raised. An interrupt of the waiting
        thread (Ctrl-C) cancels the coroutine the same way.
        """
        loop = self._loop_for(coro)
        name = getattr(coro, "__qualname__", repr(coro))
        outcome: concurrent.futures.Future[T] = concurrent.futures.Future()
        finished = threading.Event()
        tasks: list[asyncio.Task[T]] = []

        def settle(task: asyncio.Task[T]) -> None:
            if task.cancelled():
                outcome.cancel()
            elif (error := task.exception()) is not None:
                outcome.set_exception(error)
            else:
                outcome.set_result(task.result())
            finished.set()

        def start() -> None:
            task = loop.create_task(coro)
            task.add_done_callback(settle)
            tasks.append(task)

        loop.call_soon_threadsafe(start)
        try:
            return outcome.result(timeout)
        except BaseException as e:
            if outcome.done() and not outcome.cancelled():
                raise  # the coroutine's own exception (a TimeoutError of its own included)
            # start() ran before this callback (the loop runs callbacks in order).
            loop.call_soon_threadsafe(lambda: tasks[0].cancel())
            if not finished.wait(_CLEANUP_GRACE_S):
                logger.warning(
                    "%s: %s is still unwinding %.0f s after it was cancelled",
                    self.name,
                    name,
                    _CLEANUP_GRACE_S,
                )
            if isinstance(e, TimeoutError):
                raise TimeoutError(f"gave up after {timeout} s waiting for {name}") from None
            raise
