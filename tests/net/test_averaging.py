"""Averaging on loopback: real NetNodes, real gRPC, in one process.

Every successful round is checked three ways: all members hold identical bytes, the
result equals the exact weighted mean of the contributors the report names (chunk by
chunk) within the codec's bound, and the round leaves no task, thread or socket behind.
"""

import asyncio
import dataclasses
import time

import pytest
import torch
from avgutil import (
    FAST,
    SWARM,
    Leftovers,
    assert_exact,
    assert_identical,
    average,
    averaging_peers,
    random_vectors,
    run_round,
)

from swarmloco.core.aggregate import AggregatorConfig
from swarmloco.core.codec import CodecConfig, ErrorFeedback, chunk_spans, dequantize, quantize
from swarmloco.core.grouping import capped_weights
from swarmloco.errors import RoundAborted
from swarmloco.net.averaging import AllReduceResult, Fault, FaultPlan, MatchmakingConfig
from swarmloco.net.averaging.allreduce import AveragingConfig
from swarmloco.net.averaging.matchmaking import leader_rank
from swarmloco.net.deadline import Deadline


def ok(results) -> list[AllReduceResult]:
    bad = [r for r in results if isinstance(r, BaseException)]
    assert not bad, bad
    return list(results)


@pytest.mark.parametrize("size", [2, 3, 5, 8])
async def test_every_member_ends_with_the_same_exact_mean(size):
    weights = [1.0 + i for i in range(size)]
    vectors = random_vectors(size, 64 * 37 + 5, seed=size)
    baseline = await Leftovers.before_grpc()
    async with averaging_peers(size) as peers:
        ok(await run_round(peers, 1, vectors, weights))  # opens the channels it will reuse
        before = Leftovers.now()
        results = ok(await run_round(peers, 2, vectors, weights))
        await before.assert_back()
        ids = [p.peer_id for p in peers]
        assert_identical(results)
        for result in results:
            assert_exact(result, dict(zip(ids, vectors)), dict(zip(ids, weights)))
            report = result.report
            assert set(report.members) == set(ids) and not report.excluded
            assert all(set(p.included) == set(ids) for p in report.parts)
            assert all(n == p.chunks for p in report.parts for n in p.included.values())
            assert report.agreed == size and report.bytes_sent > 0
    await baseline.assert_back()


@pytest.mark.parametrize("method", ["mean", "trimmed_mean", "centered_clip"])
async def test_parts_in_the_default_codecs_chunks_are_audited_under_every_aggregator(method):
    """The default codec's chunks (1 MiB, 64 segments each, whose norms every statement
    carries): every serving member audits each part another member reduced, every audit
    passes, nothing is refused, and the round applies one result."""
    codec = CodecConfig(backend="eager")
    config = AveragingConfig(codec=codec, aggregator=AggregatorConfig(method=method))
    size = 3
    vectors = random_vectors(size, 3 * (1 << 20) + 4096, seed=21, block=codec.block_size)
    async with averaging_peers(size, config=config) as peers:
        results = ok(await run_round(peers, 1, vectors, [1.0] * size, timeout=60))
        passed = [p.averager.stats["audits-passed"] for p in peers]
        refused = [sum(p.averager.rejections.counts.values()) for p in peers]
    assert_identical(results)
    assert all(not r.report.excluded and not r.report.liars for r in results)
    assert all(len(chunk_spans(p.stop - p.start, codec)) >= 2 for p in results[0].report.parts)
    assert passed == [size - 1] * size and refused == [0] * size, (passed, refused)


async def test_uneven_parts_and_client_mode_members():
    # Bandwidths 1 : 3 : 2, and two client-mode members that only send and receive.
    size, clients = 5, (3, 4)
    weights = [2.0, 1.0, 1.0, 3.0, 0.5]
    vectors = random_vectors(size, 64 * 60, seed=11)
    async with averaging_peers(size, clients=clients, bandwidths={0: 1.0, 1: 3.0, 2: 2.0}) as peers:
        results = ok(await run_round(peers, 1, vectors, weights))
        assert_identical(results)
        ids = [p.peer_id for p in peers]
        for result in results:
            assert_exact(result, dict(zip(ids, vectors)), dict(zip(ids, weights)))
        parts = {p.reducer: (p.stop - p.start) // 64 for p in results[0].report.parts}
        assert parts == {ids[0]: 10, ids[1]: 30, ids[2]: 20}
        assert all(ids[c] in p.included for c in clients for p in results[0].report.parts)


async def test_a_group_of_one_returns_its_own_vector():
    vector = random_vectors(1, 640, seed=1)[0]
    async with averaging_peers(1, matchmaking=MatchmakingConfig(gather_s=0.3)) as peers:
        result = await average(peers[0], 1, vector, 1.0, deadline=Deadline.after(10))
        assert torch.equal(result.mean, vector) and result.report.members == (peers[0].peer_id,)


async def test_a_client_mode_peer_that_no_serving_peer_joins_averages_alone():
    # Peer 0 serves but takes no part in round 1: the client waits one gathering window
    # for a leader, then applies its own vector (nobody could dial it to join it).
    vector = random_vectors(1, 640, seed=3)[0]
    config = MatchmakingConfig(gather_s=0.5, poll_s=0.1)
    async with averaging_peers(2, clients=(1,), matchmaking=config) as peers:
        client = peers[1]
        assert client.node.endpoint == ""
        started = time.monotonic()
        result = await average(client, 1, vector, 1.0, deadline=Deadline.after(10))
        assert time.monotonic() - started >= 0.5
        assert torch.equal(result.mean, vector) and result.report.members == (client.peer_id,)


async def test_a_client_mode_peer_alone_aborts_when_a_group_must_be_larger():
    vector = random_vectors(1, 640, seed=4)[0]
    config = MatchmakingConfig(min_group_size=2, gather_s=0.3, poll_s=0.1)
    async with averaging_peers(2, clients=(1,), matchmaking=config) as peers:
        with pytest.raises(RoundAborted, match="no serving peer to average with"):
            await average(peers[1], 1, vector, 1.0, deadline=Deadline.after(10))


async def test_a_round_that_cannot_gather_enough_members_aborts_cleanly():
    config = MatchmakingConfig(min_group_size=3, max_group_size=3, gather_s=0.5, poll_s=0.1)
    vectors = random_vectors(2, 640, seed=2)
    baseline = await Leftovers.before_grpc()
    async with averaging_peers(2, matchmaking=config) as peers:
        before = Leftovers.now()
        results = await run_round(peers, 1, vectors, [1.0, 1.0], timeout=5)
        assert all(isinstance(r, RoundAborted) for r in results), results
        await before.assert_back(sockets=False)
    await baseline.assert_back()


async def test_results_go_into_a_reused_buffer_and_rounds_follow_each_other():
    vectors = random_vectors(3, 64 * 20, seed=3)
    outs = [torch.full_like(v, float("nan")) for v in vectors]
    async with averaging_peers(3) as peers:
        for round in (1, 2):
            deadline = Deadline.after(20)
            results = ok(
                await asyncio.gather(
                    *(
                        _average_into(p, round, v, out, deadline)
                        for p, v, out in zip(peers, vectors, outs)
                    )
                )
            )
            assert all(r.mean is out for r, out in zip(results, outs))
            assert_identical(results)
        assert len(chunk_spans(64 * 20 // 3, peers[0].averager.config.codec)) > 1


async def _average_into(peer, round, vector, out, deadline):
    group = await peer.matchmaker.form_group(
        round, weight=1.0, numel=vector.numel(), block_size=64, deadline=deadline
    )
    return await peer.averager.all_reduce(group, vector, deadline=deadline, out=out)


# -- hostile members ------------------------------------------------------------------------


async def _hostile_round(size, hostile, plan, *, clients=(), rounds=(1,), weights=None):
    weights = weights or [1.0 + i for i in range(size)]
    vectors = random_vectors(size, 64 * 40, seed=size + hostile)
    async with averaging_peers(size, clients=clients, faults={hostile: plan}) as peers:
        for round in rounds:
            results = await run_round(peers, round, vectors, weights, timeout=15)
        ids = [p.peer_id for p in peers]
    honest = [r for i, r in enumerate(results) if i != hostile]
    honest = ok(honest)
    assert_identical(honest)
    for result in honest:
        assert_exact(result, dict(zip(ids, vectors)), dict(zip(ids, weights)))
        assert all(ids[hostile] not in p.included for p in result.report.parts)
        assert ids[hostile] in result.report.excluded
    assert not isinstance(results[hostile], AllReduceResult) or not torch.equal(
        results[hostile].mean, honest[0].mean
    )
    return honest


@pytest.mark.parametrize("corruption, code", [("nan", "bad-chunk"), ("truncate", "bad-size")])
async def test_nan_scales_and_wrong_shapes_are_refused_and_counted(corruption, code):
    plan = FaultPlan([Fault(action="corrupt", phase="chunk", corruption=corruption)])
    honest = await _hostile_round(4, 3, plan)
    assert plan.fired[0] > 0
    assert sum(r.report.rejections.get(code, 0) for r in honest) >= 3


async def test_a_chunk_replayed_from_an_earlier_round_is_refused():
    # The client-mode member is honest in round 1 and replays its round-1 chunk in round 2.
    plan = FaultPlan([Fault(action="replay", phase="chunk", round=2)])
    honest = await _hostile_round(4, 3, plan, clients=(3,), rounds=(1, 2))
    assert plan.fired[0] >= 3  # at least the first chunk to each serving member
    assert sum(r.report.rejections.get("stale-round", 0) for r in honest) == 3


@pytest.mark.parametrize("heavy_leads", [False, True])
async def test_a_weight_far_above_the_median_is_capped_and_its_work_kept(heavy_leads):
    # The heavy member (a fast peer, or one that trained long before a catch-up) is the
    # round's leader or one of its followers: either way it stays in the group, and its
    # update counts as 10 x the lower median of the declared weights on every member.
    size = 4
    vectors = random_vectors(size, 64 * 40, seed=9)
    async with averaging_peers(size) as peers:
        ids = [p.peer_id for p in peers]
        order = sorted(range(size), key=lambda i: leader_rank(SWARM, 1, ids[i]))
        heavy = order[0] if heavy_leads else order[-1]
        weights = [1e9 if i == heavy else 1.0 + i / 2 for i in range(size)]
        results = await run_round(peers, 1, vectors, weights, timeout=15)
    results = ok(results)
    assert_identical(results)
    counted = capped_weights(weights, 10.0)
    assert counted[heavy] == 10.0 * sorted(weights)[1] < 1e9
    for result in results:
        assert ids[heavy] in result.report.members and not result.report.excluded
        assert_exact(result, dict(zip(ids, vectors)), dict(zip(ids, counted)))


# -- failures ---------------------------------------------------------------------------------


async def _round_with_victim(size, victim, plan, *, clients=(), victim_deadline=6.0, config=FAST):
    weights = [1.0 + i for i in range(size)]
    vectors = random_vectors(size, 64 * 200, seed=size * 7 + victim)
    async with averaging_peers(
        size, clients=clients, faults={victim: plan}, config=config
    ) as peers:
        ids = [p.peer_id for p in peers]
        before = Leftovers.now()
        deadlines = [Deadline.after(victim_deadline if i == victim else 15.0) for i in range(size)]
        results = await asyncio.gather(
            *(
                average(p, 1, v, w, deadline=d)
                for p, v, w, d in zip(peers, vectors, weights, deadlines)
            ),
            return_exceptions=True,
        )
        await before.assert_back(sockets=False)
    survivors = ok([r for i, r in enumerate(results) if i != victim])
    assert_identical(survivors)
    for result in survivors:
        assert_exact(result, dict(zip(ids, vectors)), dict(zip(ids, weights)))
        assert ids[victim] in result.report.excluded
    assert isinstance(results[victim], RoundAborted), results[victim]
    return survivors, ids


async def test_a_sender_cut_mid_stream_counts_in_the_chunks_it_delivered():
    plan = FaultPlan([Fault(action="cut", phase="chunk", after_bytes=2000)])
    survivors, ids = await _round_with_victim(4, 3, plan, clients=(3,))
    assert plan.fired[0] == 3
    for part in survivors[0].report.parts:
        assert 0 < part.included.get(ids[3], 0) < part.chunks or ids[3] not in part.included


def _rerun_part(report, victim: str):
    """The victim's part in the report (rerun by another member, one or more epochs up)."""
    part = report.parts[report.members.index(victim)]
    assert part.epoch >= 1 and part.reducer != victim
    return part


async def test_a_reducer_cut_mid_stream_has_its_part_rerun_by_the_next_member():
    plan = FaultPlan([Fault(action="cut", phase="result", after_bytes=1500)])
    survivors, ids = await _round_with_victim(4, 1, plan)
    assert plan.fired[0] >= 1
    part = _rerun_part(survivors[0].report, ids[1])
    assert set(part.included) == set(ids) - {ids[1]}


async def test_a_reducer_stuck_in_its_handler_is_detected_and_its_part_rerun():
    plan = FaultPlan([Fault(action="stall", phase="handler", skip=6)])
    survivors, ids = await _round_with_victim(4, 2, plan)
    assert plan.fired[0] >= 1
    # Its own streams to the others stay healthy: what it sent as a sender may count.
    _rerun_part(survivors[0].report, ids[2])


async def test_a_round_that_cannot_finish_by_its_deadline_aborts_for_everyone():
    slow = dataclasses.replace(
        FAST, liveness_timeout_s=30.0, sender_timeout_s=30.0, reducer_timeout_s=40.0
    )
    plan = FaultPlan([Fault(action="stall", phase="handler", skip=3)])
    vectors = random_vectors(3, 64 * 40, seed=4)
    baseline = await Leftovers.before_grpc()
    async with averaging_peers(3, faults={1: plan}, config=slow) as peers:
        before = Leftovers.now()
        results = await run_round(peers, 1, vectors, [1.0] * 3, timeout=3.0)
        assert all(isinstance(r, RoundAborted) for r in results), results
        assert all("deadline" in str(r) for r in results)
        await before.assert_back(sockets=False)
    await baseline.assert_back()


async def test_error_feedback_keeps_the_residual_of_a_round_and_rolls_back_an_aborted_one():
    vectors = random_vectors(2, 64 * 20, seed=8)
    feedback = [ErrorFeedback(v.numel(), FAST.codec) for v in vectors]
    async with averaging_peers(2) as peers:
        deadline = Deadline.after(15)
        results = ok(
            await asyncio.gather(
                *(
                    _average_with_feedback(p, 1, v, ef, deadline)
                    for p, v, ef in zip(peers, vectors, feedback)
                )
            )
        )
        assert_identical(results)
        for v, ef in zip(vectors, feedback):
            q, s = quantize(v, FAST.codec)
            assert torch.equal(ef.residual, v - dequantize(q, s, 64, "eager"))
        # Round 2 cannot form (min_group_size 3): the residual is what it was.
        before = [ef.residual.clone() for ef in feedback]
        for p in peers:
            p.matchmaker.config = MatchmakingConfig(min_group_size=3, gather_s=0.3, poll_s=0.1)
        with pytest.raises(RoundAborted):
            await _average_with_feedback(peers[0], 2, vectors[0], feedback[0], Deadline.after(5))
        assert torch.equal(feedback[0].residual, before[0])


async def _average_with_feedback(peer, round, vector, feedback, deadline):
    group = await peer.matchmaker.form_group(
        round, weight=1.0, numel=vector.numel(), block_size=64, deadline=deadline
    )
    return await peer.averager.all_reduce(group, vector, deadline=deadline, error_feedback=feedback)


async def test_a_stall_of_our_own_event_loop_is_not_the_members_silence():
    # All members share this process's loop: a 4.5 s busy loop on it (longer than the 3 s
    # liveness timeout) stalls every member at once, as a long GC pause or a blocking call
    # would stall a real peer. The messages sent meanwhile are queued, not lost: nobody
    # may be failed for a silence that was the watcher's own. (Timeouts three times FAST's:
    # on a busy machine the backlog after the stall takes a while to go through.)
    size = 4
    plan = FaultPlan([Fault(action="spin", phase="chunk", skip=2, times=1, seconds=4.5)])
    config = dataclasses.replace(
        FAST, liveness_timeout_s=3.0, sender_timeout_s=3.0, reducer_timeout_s=6.0
    )
    weights = [1.0 + i for i in range(size)]
    vectors = random_vectors(size, 64 * 40, seed=21)
    async with averaging_peers(size, faults={1: plan}, config=config) as peers:
        results = ok(await run_round(peers, 1, vectors, weights, timeout=30))
        ids = [p.peer_id for p in peers]
    assert plan.fired[0] == 1
    assert_identical(results)
    for result in results:
        assert_exact(result, dict(zip(ids, vectors)), dict(zip(ids, weights)))
        assert set(result.report.members) == set(ids) and not result.report.excluded
