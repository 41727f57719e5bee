"""The bridge between the training thread and the peer's event loop."""

import asyncio
import concurrent.futures
import random
import threading

import pytest

from swarmloco.net.dht.memory import MemoryCluster
from swarmloco.net.records import peers_key
from swarmloco.runtime.loop_thread import LoopThread


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("test-loop")]


@pytest.fixture
def bridge():
    with LoopThread(name="test-loop") as lt:
        yield lt
    assert not loop_threads()


def test_run_returns_the_result_from_the_loop_thread(bridge):
    async def where() -> str:
        await asyncio.sleep(0)
        return threading.current_thread().name

    assert bridge.run(where(), timeout=5) == "test-loop"


def test_the_coroutine_exception_is_raised_in_the_caller(bridge):
    async def fail():
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        bridge.run(fail(), timeout=5)


def test_a_timeout_of_the_coroutine_itself_is_not_taken_for_ours(bridge):
    async def own_timeout():
        async with asyncio.timeout(0):
            await asyncio.sleep(10)

    with pytest.raises(TimeoutError) as raised:
        bridge.run(own_timeout(), timeout=5)
    assert "gave up" not in str(raised.value)


def test_a_timeout_cancels_the_coroutine_and_waits_for_its_cleanup(bridge):
    cleaned = threading.Event()

    async def forever():
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.05)  # cleanup that itself awaits
            cleaned.set()

    with pytest.raises(TimeoutError, match=r"gave up after 0\.1 s"):
        bridge.run(forever(), timeout=0.1)
    assert cleaned.is_set()  # before run() returned, not eventually

    async def tasks_left() -> int:
        return len(asyncio.all_tasks()) - 2  # the serving task and this one

    assert bridge.run(tasks_left(), timeout=5) == 0


def test_submit_overlaps_work_and_stop_cancels_what_was_left(bridge):
    started, cancelled = threading.Event(), threading.Event()

    async def background():
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def quick(x: int) -> int:
        return x * 2

    pending = bridge.submit(background())
    assert bridge.submit(quick(21)).result(timeout=5) == 42
    assert started.wait(5)
    bridge.stop()
    assert cancelled.is_set()
    with pytest.raises(concurrent.futures.CancelledError):
        pending.result(timeout=5)


def test_calls_after_stop_and_from_the_loop_itself_are_clear_errors():
    lt = LoopThread(name="test-loop").start()

    async def nested():
        return lt.run(asyncio.sleep(0), timeout=1)

    with pytest.raises(RuntimeError, match="await the coroutine instead"):
        lt.run(nested(), timeout=5)
    lt.stop()
    assert not loop_threads()
    with pytest.raises(RuntimeError, match="not running"):
        lt.run(asyncio.sleep(0), timeout=1)
    with pytest.raises(RuntimeError, match="already started"):
        lt.start()


def test_uses_uvloop_when_asked_and_the_standard_loop_otherwise():
    uvloop = pytest.importorskip("uvloop")
    with LoopThread(name="test-loop") as fast:
        assert isinstance(fast.loop, uvloop.Loop)
    with LoopThread(name="test-loop", use_uvloop=False) as plain:
        assert not isinstance(plain.loop, uvloop.Loop)


def test_a_dht_on_the_loop_driven_from_the_training_thread(bridge):
    """What the daemon does: the network lives on the loop, the caller only bridges."""
    rng = random.Random(3)
    key = peers_key(f"{rng.getrandbits(160):040x}")
    value = {"endpoint": "127.0.0.1:1", "role": "trainer", "version": "0.1.0", "public": True}

    async def scenario():
        async with MemoryCluster(rng=rng) as cluster:
            for _ in range(10):
                await cluster.add()
            stored = await cluster.nodes[0].store(key, value, ttl=60)
            found = await cluster.nodes[-1].get(key)
            return stored, len(found.entries)

    stored, entries = bridge.run(scenario(), timeout=30)
    assert stored >= 1 and entries == 1


def test_a_stopped_grpc_servers_calls_end_by_themselves_not_cancelled(capfd):
    """A peer stops its gRPC server and then its loop: the server's calls still ending
    then are left to end (cancelled inside grpc, one printed a traceback at a peer's
    exit); what is truly left over is cancelled."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    async def forever() -> None:
        await asyncio.Event().wait()

    def once() -> tuple[list[asyncio.Task], asyncio.Task]:
        lt = LoopThread(name="test-loop").start()

        async def serve_then_stop_all() -> tuple[list[asyncio.Task], asyncio.Task]:
            server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            await watch.read()
            await server.stop(0)
            watch.cancel()
            left = asyncio.get_running_loop().create_task(forever())
            # The loop stops now, as a peer's does once its server stopped, maybe before
            # the server's calls had their turn to end.
            lt._stopping.set()
            calls = [
                t for t in asyncio.all_tasks() if t.get_coro().__name__ == "_schedule_rpc_coro"
            ]
            return calls, left

        try:
            return lt.run(serve_then_stop_all(), timeout=10)
        finally:
            lt.stop()

    # Whether a call is still ending when the loop stops is up to grpc's completion
    # thread: try until one was.
    for _ in range(50):
        calls, left = once()
        assert left.cancelled()
        if calls:
            break
    assert calls, "no call of the stopped server was still ending at 50 loop stops"
    assert all(t.done() and not t.cancelling() for t in calls)  # ended, never cancelled
    assert "CancelledError" not in capfd.readouterr().err
