"""Hostile members on loopback: nothing one of them sends can crash another member.

Each test runs a round with one hostile member (a scripted fault, or a vector no honest
member would send) and then a clean round with the same peers: every honest member's
round ends in a result or in RoundAborted (never another error, which would take a peer
process down), the offender is counted, and the next round completes for everyone.
"""

import pytest
import torch
from avgutil import assert_exact, assert_identical, averaging_peers, random_vectors, run_round

from swarmloco.errors import RoundAborted
from swarmloco.net.averaging import AllReduceResult, Fault, FaultPlan


def _outcomes(results) -> list[AllReduceResult | RoundAborted]:
    """The results, after checking that every failure is a RoundAborted."""
    for r in results:
        assert isinstance(r, (AllReduceResult, RoundAborted)), repr(r)
    return list(results)


async def _then_a_clean_round(peers, size):
    vectors = random_vectors(size, 64 * 40, seed=77)
    results = _outcomes(await run_round(peers, 2, vectors, [1.0] * size, timeout=15))
    assert all(isinstance(r, AllReduceResult) for r in results), results
    assert_identical(results)
    ids = [p.peer_id for p in peers]
    assert_exact(results[0], dict(zip(ids, vectors)), dict.fromkeys(ids, 1.0))


@pytest.mark.parametrize("corruption", ["nan", "huge"])
async def test_a_reducer_answering_bad_scales_is_struck_and_its_part_rerun(corruption):
    """NaN scales, or finite scales so large that decoding overflows to Inf: the members
    refuse the reducer's results, move its part to the next member, and finish without it."""
    size, hostile = 4, 1
    plan = FaultPlan([Fault(action="corrupt", phase="result", corruption=corruption, round=1)])
    weights = [1.0 + i for i in range(size)]
    vectors = random_vectors(size, 64 * 200, seed=3)
    async with averaging_peers(size, faults={hostile: plan}) as peers:
        results = _outcomes(await run_round(peers, 1, vectors, weights, timeout=15))
        ids = [p.peer_id for p in peers]
        assert plan.fired[0] > 0
        honest = [r for i, r in enumerate(results) if i != hostile]
        assert all(isinstance(r, AllReduceResult) for r in honest), honest
        assert_identical(honest)
        for result in honest:
            assert_exact(result, dict(zip(ids, vectors)), dict(zip(ids, weights)))
            assert ids[hostile] in result.report.excluded
            part = result.report.parts[result.report.members.index(ids[hostile])]
            assert part.epoch >= 1 and part.reducer != ids[hostile]
        assert sum(p.averager.rejections.counts["bad-result"] for p in peers) >= size - 1
        await _then_a_clean_round(peers, size)


async def test_a_member_whose_weighted_update_would_overflow_the_sum_is_struck():
    """Token counts as weights (2e5) and a finite update of 1e36 from one member: the sum
    would be Inf on every reducer. The member is struck; the others average without it.
    (It reduces nothing itself, as a client-mode member: a serving one would refuse its own
    update before sending it.)"""
    size, hostile = 4, 3
    weights = [2e5] * size
    vectors = random_vectors(size, 64 * 200, seed=4)
    vectors[hostile] = vectors[hostile] * 1e36
    async with averaging_peers(size, clients=(hostile,)) as peers:
        results = _outcomes(await run_round(peers, 1, vectors, weights, timeout=15))
        ids = [p.peer_id for p in peers]
        honest = [r for i, r in enumerate(results) if i != hostile]
        assert all(isinstance(r, AllReduceResult) for r in honest), honest
        assert_identical(honest)
        for result in honest:
            assert torch.isfinite(result.mean).all()
            assert ids[hostile] in result.report.excluded
            assert all(ids[hostile] not in p.included for p in result.report.parts)
        assert sum(p.averager.rejections.counts["too-large"] for p in peers) == size - 1
        await _then_a_clean_round(peers, size)


async def test_a_serving_member_refuses_to_send_its_own_update_if_the_sum_would_overflow():
    size, hostile = 3, 2
    vectors = random_vectors(size, 64 * 200, seed=5)
    vectors[hostile] = vectors[hostile] * 1e36
    async with averaging_peers(size) as peers:
        results = _outcomes(await run_round(peers, 1, vectors, [2e5] * size, timeout=15))
        assert isinstance(results[hostile], RoundAborted)
        assert "own update cannot be averaged" in str(results[hostile])
        assert all(isinstance(r, AllReduceResult) for i, r in enumerate(results) if i != hostile)
        await _then_a_clean_round(peers, size)
