"""Averaging through a real TCP proxy that breaks the link in the middle of a round.

Three peers on loopback; the third announces a proxy's port instead of its own, so all
that the other two send it (matchmaking, chunks, heartbeats) and all it answers on those
calls crosses ``tcpproxy.TcpProxy``. A round that the proxy cuts, blackholes or delays must
end, for every member, in a completed round or a clean ``RoundAborted``, within the
round's deadline; the members that complete hold the same bytes, the exact mean of the
contributors their report names.
"""

import asyncio
import time

import pytest
from avgutil import (
    FAST,
    Leftovers,
    assert_exact,
    assert_identical,
    average,
    averaging_peers,
    random_vectors,
)
from tcpproxy import TcpProxy

from swarmloco.errors import RoundAborted
from swarmloco.net.averaging import AllReduceResult
from swarmloco.net.deadline import Deadline

DEADLINE_S = 15.0
BEHIND = 2  # the peer behind the proxy


async def _round(peers, round, vectors, weights):
    started = time.monotonic()
    deadline = Deadline.after(DEADLINE_S)
    results = await asyncio.gather(
        *(average(p, round, v, w, deadline=deadline) for p, v, w in zip(peers, vectors, weights)),
        return_exceptions=True,
    )
    return results, time.monotonic() - started


def _check(results, ids, vectors, weights) -> list[AllReduceResult]:
    """Every member completed or aborted cleanly; those that completed agree, exactly."""
    for r in results:
        assert isinstance(r, AllReduceResult | RoundAborted), repr(r)
    done = [r for r in results if isinstance(r, AllReduceResult)]
    assert done, results
    assert_identical(done)
    for r in done:
        assert_exact(r, dict(zip(ids, vectors)), dict(zip(ids, weights)))
    return done


@pytest.mark.parametrize("mode", ["cut", "blackhole", "delay"])
async def test_a_link_cut_blackholed_or_delayed_mid_round_ends_the_round_in_time(mode):
    weights = [1.0, 2.0, 3.0]
    vectors = random_vectors(3, 64 * 600, seed=11)
    async with (
        TcpProxy() as proxy,
        averaging_peers(3, proxies={BEHIND: proxy}, config=FAST) as peers,
    ):
        ids = [p.peer_id for p in peers]
        assert peers[BEHIND].node.endpoint == f"127.0.0.1:{proxy.port}"
        # Through the healthy proxy: a full round (it also opens the channels).
        results, _ = await _round(peers, 1, vectors, weights)
        done = _check(results, ids, vectors, weights)
        assert len(done) == 3 and not done[0].report.excluded
        assert proxy.forwarded > 60_000  # the third peer's traffic did cross the proxy

        before = Leftovers.now()
        proxy.arm(mode, after_bytes=20_000, delay_s=0.2)
        results, elapsed = await _round(peers, 2, vectors, weights)
        assert proxy.fired.is_set()  # the fault landed inside the round
        assert elapsed < DEADLINE_S + 2.0, elapsed
        done = _check(results, ids, vectors, weights)
        # The two peers that reach each other directly always complete the round.
        assert all(isinstance(results[i], AllReduceResult) for i in (0, 1)), results
        report = done[0].report
        if mode == "delay":  # latency slows a round down, it does not break it
            assert len(done) == 3 and not report.excluded, report
        else:  # a broken stream or silence (liveness): the third peer is left out
            assert ids[BEHIND] in report.excluded, report
        await before.assert_back(sockets=False)

        if mode != "blackhole":
            # The link works again (a cut link is dialed anew): the next round is whole.
            proxy.mode = "pass"
            results, _ = await _round(peers, 3, vectors, weights)
            done = _check(results, ids, vectors, weights)
            assert len(done) == 3 and not done[0].report.excluded, done[0].report
