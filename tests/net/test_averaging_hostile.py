"""Hostile members on loopback: nothing one of them sends can crash another member.

Each test runs a round with one hostile member (a scripted fault, or a vector no honest
member would send) and then a clean round with the same peers: every honest member's
round ends in a result or in RoundAborted (never another error, which would take a peer
process down), the offender is counted, and the next round completes for everyone.
"""

import collections
import dataclasses
from collections.abc import Callable

import pytest
import torch
from avgutil import (
    CODEC,
    FAST,
    PATIENT,
    SWARM,
    assert_exact,
    assert_identical,
    averaging_peers,
    random_vectors,
    run_round,
)

from swarmloco.core.aggregate import AggregatorConfig
from swarmloco.core.codec import chunk_spans
from swarmloco.errors import RoundAborted
from swarmloco.net.averaging import AllReduceResult, Fault, FaultPlan
from swarmloco.net.averaging.allreduce import AveragingConfig
from swarmloco.net.averaging.candidates import leader_rank
from swarmloco.net.averaging.faults import Corruption, Phase

# A member that does not scale its own update down to the group's bound (a liar's code).
_UNBOUNDED = dataclasses.replace(FAST, aggregator=AggregatorConfig(norm_clip=0.0))


def _outcomes(results) -> list[AllReduceResult | RoundAborted]:
    """The results, after checking that every failure is a RoundAborted."""
    for r in results:
        assert isinstance(r, (AllReduceResult, RoundAborted)), repr(r)
    return list(results)


def _honest_results(peers, results, plan, hostile):
    """The peer ids, and the honest members' results (with their index) after checking
    that the fault fired and that every honest member completed the round on one result."""
    assert plan.fired[0] > 0
    honest = [(i, r) for i, r in enumerate(results) if i != hostile]
    assert all(isinstance(r, AllReduceResult) for _, r in honest), honest
    assert_identical([r for _, r in honest])
    return [p.peer_id for p in peers], honest


async def _then_a_clean_round(peers, size):
    vectors = random_vectors(size, 64 * 40, seed=77)
    results = _outcomes(await run_round(peers, 2, vectors, [1.0] * size, timeout=15))
    assert all(isinstance(r, AllReduceResult) for r in results), results
    assert_identical(results)
    ids = [p.peer_id for p in peers]
    assert_exact(results[0], dict(zip(ids, vectors)), dict.fromkeys(ids, 1.0))


@pytest.mark.parametrize("blocks", [200, 4])
@pytest.mark.parametrize("corruption", ["nan", "huge"])
async def test_a_reducer_answering_bad_scales_is_struck_and_its_part_rerun(corruption, blocks):
    """NaN scales, or finite scales so large that decoding overflows to Inf: the members
    refuse the reducer's results, move its part to the next member, and finish without it.
    With 4 blocks each part is one chunk: the refused chunk would have been the part's
    last, and must not count as received (the part would be left out of the rerun, its
    slice of the result whatever the buffer held, different on every member)."""
    size, hostile = 4, 1
    plan = FaultPlan([Fault(action="corrupt", phase="result", corruption=corruption, round=1)])
    weights = [1.0 + i for i in range(size)]
    vectors = random_vectors(size, 64 * blocks, seed=3)
    async with averaging_peers(size, faults={hostile: plan}) as peers:
        results = _outcomes(await run_round(peers, 1, vectors, weights, timeout=15))
        ids, honest = _honest_results(peers, results, plan, hostile)
        refused = 0
        for i, result in honest:
            assert_exact(result, dict(zip(ids, vectors)), dict(zip(ids, weights)))
            if not peers[i].averager.rejections.counts["bad-result"]:
                continue  # got no bad result from it (under heavy load, not every member does)
            refused += 1
            assert ids[hostile] in result.report.excluded
            part = result.report.parts[result.report.members.index(ids[hostile])]
            assert part.epoch >= 1 and part.reducer != ids[hostile]
        assert refused >= 1
        await _then_a_clean_round(peers, size)


@pytest.mark.parametrize("method", ["mean", "trimmed_mean"])
@pytest.mark.parametrize("corruption", ["amplify", "flat"])
async def test_a_reducer_answering_a_result_larger_than_its_senders_allow_is_struck(
    corruption, method
):
    """A reducer's result, scaled x1000 (``amplify``) or +1 everywhere under scales of 1e4
    (``flat``): finite, so the decoder takes it, but longer than any aggregate of the
    group's bounded slices. Every other member refuses it (``too-large``), its part is
    reduced again by the next member, and the honest result is exact. (Before results were
    bounded, every member applied the liar's part as sent.)"""
    size, hostile = 4, 1
    plan = FaultPlan([Fault(action="corrupt", phase="result", corruption=corruption, round=1)])
    config = dataclasses.replace(PATIENT, aggregator=AggregatorConfig(method=method))
    weights = [1.0 + i for i in range(size)]
    vectors = random_vectors(size, 64 * 200, seed=8)
    async with averaging_peers(size, faults={hostile: plan}, config=config) as peers:
        results = _outcomes(await run_round(peers, 1, vectors, weights, timeout=15))
        ids, honest = _honest_results(peers, results, plan, hostile)
        refused = 0
        for i, result in honest:
            part = result.report.parts[result.report.members.index(ids[hostile])]
            assert part.reducer != ids[hostile]
            if method == "mean":
                assert_exact(result, dict(zip(ids, vectors)), dict(zip(ids, weights)))
            else:  # within the honest values, coordinate by coordinate
                stacked = torch.stack(vectors)
                slack = 2 * float(stacked.abs().max()) / 127
                assert (result.mean <= stacked.max(0).values + slack).all()
                assert (result.mean >= stacked.min(0).values - slack).all()
            refused += peers[i].averager.rejections.counts["too-large"]
        assert refused >= 1
        clean = _outcomes(await run_round(peers, 2, vectors, weights, timeout=15))
        assert all(isinstance(r, AllReduceResult) for r in clean), clean
        assert_identical(clean)


@pytest.mark.parametrize("method", ["mean", "trimmed_mean"])
async def test_members_sending_plus_one_under_huge_scales_are_struck(method):
    """Two members of five send every value as +1 under scales of 1e4: the rounding each
    chunk's scales allow used to grow with the scales, so such a slice measured exactly its
    own allowance and passed any norm bound (the mean, and a trimmed mean trimming one,
    became about 1e4 everywhere). The allowance is capped at what an honest sender's scales
    reach: every reducer strikes them (``too-large``) and the others average without them."""
    size, liars = 5, (3, 4)
    plan = FaultPlan([Fault(action="corrupt", phase="chunk", corruption="flat", round=1)])
    config = dataclasses.replace(PATIENT, aggregator=AggregatorConfig(method=method))
    vectors = random_vectors(size, 64 * 200, seed=9)
    faults = dict.fromkeys(liars, plan)
    async with averaging_peers(size, clients=liars, faults=faults, config=config) as peers:
        results = _outcomes(await run_round(peers, 1, vectors, [1.0] * size, timeout=15))
        ids = [p.peer_id for p in peers]
        assert plan.fired[0] > 0
        honest = [r for i, r in enumerate(results) if i not in liars]
        assert all(isinstance(r, AllReduceResult) for r in honest), honest
        assert_identical(honest)
        for result in honest:
            counted = {m for p in result.report.parts for m in p.included}
            assert counted.isdisjoint({ids[i] for i in liars})
            if method == "mean":
                assert_exact(result, dict(zip(ids, vectors)), dict.fromkeys(ids, 1.0))
            largest = max(float(v.abs().max()) for v in vectors)
            assert float(result.mean.abs().max()) <= largest * 1.01
        assert sum(p.averager.rejections.counts["too-large"] for p in peers) >= 2


async def test_a_member_whose_weighted_update_would_overflow_the_sum_is_struck():
    """Token counts as weights (2e5) and a finite update of 1e36 from one member: the sum
    would be Inf on every reducer. The member is struck; the others average without it.
    (It reduces nothing itself, as a client-mode member: a serving one would refuse its own
    update before sending it.)"""
    size, hostile = 4, 3
    weights = [2e5] * size
    vectors = random_vectors(size, 64 * 200, seed=4)
    vectors[hostile] = vectors[hostile] * 1e36
    async with averaging_peers(size, clients=(hostile,), configs={hostile: _UNBOUNDED}) as peers:
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
    # Without the norm bound (which would scale the update down before it is sent).
    size, hostile = 3, 2
    vectors = random_vectors(size, 64 * 200, seed=5)
    vectors[hostile] = vectors[hostile] * 1e36
    async with averaging_peers(size, config=_UNBOUNDED) as peers:
        results = _outcomes(await run_round(peers, 1, vectors, [2e5] * size, timeout=15))
        assert isinstance(results[hostile], RoundAborted)
        assert "own update cannot be averaged" in str(results[hostile])
        assert all(isinstance(r, AllReduceResult) for i, r in enumerate(results) if i != hostile)
        await _then_a_clean_round(peers, size)


@pytest.mark.parametrize("method", ["mean", "centered_clip"])
async def test_a_member_sending_a_huge_finite_update_moves_nobody(method):
    """One member of four declares an honest norm and sends 1e30 (the poisoning of the
    hostile-peers issue, where every member applied a mean of 2.5e29): each reducer strikes
    it at its first chunk, the others average without it, exactly."""
    size, hostile = 4, 3
    vectors = random_vectors(size, 64 * 200, seed=6)
    honest_norm = float(vectors[hostile].norm())
    vectors[hostile] = vectors[hostile] * 1e30
    norms = [None] * size
    norms[hostile] = honest_norm
    config = dataclasses.replace(FAST, aggregator=AggregatorConfig(method=method))
    liar = {hostile: _UNBOUNDED}
    async with averaging_peers(size, clients=(hostile,), config=config, configs=liar) as peers:
        results = _outcomes(
            await run_round(peers, 1, vectors, [1.0] * size, timeout=15, norms=norms)
        )
        ids = [p.peer_id for p in peers]
        honest = [r for i, r in enumerate(results) if i != hostile]
        assert all(isinstance(r, AllReduceResult) for r in honest), honest
        assert_identical(honest)
        for result in honest:
            assert all(ids[hostile] not in p.included for p in result.report.parts)
            if method == "mean":
                assert_exact(result, dict(zip(ids, vectors)), dict.fromkeys(ids, 1.0))
            largest = max(float(v.abs().max()) for i, v in enumerate(vectors) if i != hostile)
            assert float(result.mean.abs().max()) <= largest * 1.01
        assert sum(p.averager.rejections.counts["too-large"] for p in peers) == size - 1


async def test_an_honest_member_far_above_the_group_is_scaled_to_the_bound_not_struck():
    """A member whose update is 100x the others' (a bug, or a different learning rate)
    still counts, scaled down to 4x the median declared norm: its influence is bounded,
    and the round completes for everyone."""
    size, big = 3, 2
    vectors = random_vectors(size, 64 * 200, seed=7)
    vectors[big] = vectors[big] * 100
    async with averaging_peers(size) as peers:
        results = _outcomes(await run_round(peers, 1, vectors, [1.0] * size, timeout=15))
        assert all(isinstance(r, AllReduceResult) for r in results), results
        assert_identical(results)
        median = sorted(float(v.norm()) for v in vectors)[1]
        report = results[big].report
        assert report.norm_bound == pytest.approx(4 * median, rel=1e-6)
        assert report.clipped == pytest.approx(4 * median / float(vectors[big].norm()), rel=1e-4)
        assert all(r.report.clipped == 1.0 for i, r in enumerate(results) if i != big)
        ids = [p.peer_id for p in peers]
        scaled = [v * (report.clipped if i == big else 1.0) for i, v in enumerate(vectors)]
        assert_exact(results[0], dict(zip(ids, scaled)), dict.fromkeys(ids, 1.0))
        assert not any(p.averager.rejections.counts for p in peers)


@pytest.mark.parametrize("size, liars", [(4, 1), (8, 2)])
async def test_every_aggregator_keeps_the_honest_mean_against_huge_flipped_and_steady_liars(
    size, liars
):
    """1 of 4 and 2 of 8 members lie, in one round per aggregator and attack: x1e30 with an
    honest declared norm, sign-flipped x1000, and a constant direction sent at just under
    the group's bound (the one a norm check cannot catch). The bound each aggregator keeps
    the honest members' result within, where ``R`` is the largest distance of an honest
    update from the honest mean (the honest spread) and ``B`` the group's norm bound:

    - huge and flipped updates exceed ``B``: every reducer strikes the liars, so all three
      aggregators give the honest members' own aggregate (within ``R``);
    - the steady liar: the mean moves by up to ``liars / size * B`` (and does here);
      the trimmed mean (trimming as many as there are liars) stays inside the honest
      values coordinate by coordinate, CenteredClip within ``R`` chunk by chunk.
    """
    honest_count = size - liars
    torch.manual_seed(size)
    base = torch.randn(64 * 40)
    honest = [base + 0.1 * torch.randn(base.numel()) for _ in range(honest_count)]
    stacked = torch.stack(honest)
    center = stacked.mean(0)
    spread = float((stacked - center).norm(dim=1).max())
    slack = 2 * float(stacked.abs().max()) / 127  # int8 rounding, per coordinate
    norms = sorted(float(h.double().norm()) for h in honest)
    bound = 4.0 * norms[(len(norms) - 1) // 2]  # every declared norm below is honest's
    steady = torch.ones(base.numel()) / base.numel() ** 0.5 * bound * 0.999
    attacks = {
        "huge": ([h * 1e30 for h in honest[:liars]], [float(h.norm()) for h in honest[:liars]]),
        "flipped": ([h * -1000 for h in honest[:liars]], [None] * liars),
        "steady": ([steady.clone() for _ in range(liars)], [None] * liars),
    }
    aggregators = [
        AggregatorConfig(method="mean"),
        AggregatorConfig(method="trimmed_mean", trim=liars),
        AggregatorConfig(method="centered_clip"),
    ]
    liar_ids = range(honest_count, size)
    async with averaging_peers(size, clients=tuple(liar_ids)) as peers:
        ids = [p.peer_id for p in peers]
        round = 0
        for aggregator in aggregators:
            for i, peer in enumerate(peers):  # a liar does not scale its update down
                clip = 0.0 if i in liar_ids else aggregator.norm_clip
                peer.averager.config = dataclasses.replace(
                    FAST, aggregator=dataclasses.replace(aggregator, norm_clip=clip)
                )
            for attack, (sent, declared) in attacks.items():
                round += 1
                results = _outcomes(
                    await run_round(
                        peers,
                        round,
                        honest + sent,
                        [1.0] * size,
                        timeout=20,
                        norms=[None] * honest_count + declared,
                    )
                )
                what = f"{aggregator.method}, {attack}"
                mine = results[:honest_count]
                assert all(isinstance(r, AllReduceResult) for r in mine), (what, mine)
                assert_identical(mine)
                mean = mine[0].mean
                moved = float((mean - center).norm())
                struck = attack != "steady"
                for result in mine:
                    counted = {m for p in result.report.parts for m in p.included}
                    assert counted.isdisjoint({ids[i] for i in liar_ids}) == struck, what
                if struck or aggregator.method == "centered_clip":
                    for span in chunk_spans(mean.numel(), FAST.codec):
                        piece = slice(span.start, span.stop)
                        radius = float((stacked[:, piece] - center[piece]).norm(dim=1).max())
                        limit = radius + slack * span.numel**0.5
                        assert float((mean[piece] - center[piece]).norm()) <= limit, what
                elif aggregator.method == "trimmed_mean":
                    assert (mean >= stacked.min(0).values - slack).all(), what
                    assert (mean <= stacked.max(0).values + slack).all(), what
                else:  # the plain mean follows the steady liars as far as the bound lets it
                    assert spread < moved <= liars / size * bound + spread, (what, moved)


@pytest.mark.parametrize("phase", ["done", "verdict"])
async def test_a_digest_longer_than_any_is_refused_and_the_member_counted(phase):
    """A member whose digest (``done``) or verdict carries 1 MiB instead of 16 bytes: it is
    refused before it is kept or compared, counted as malformed, and the honest members
    finish the round without it."""
    size, hostile = 4, 1
    plan = FaultPlan([Fault(action="corrupt", phase=phase, corruption="bloat", round=1)])
    vectors = random_vectors(size, 64 * 40, seed=5)
    async with averaging_peers(size, faults={hostile: plan}) as peers:
        results = _outcomes(await run_round(peers, 1, vectors, [1.0] * size, timeout=15))
        assert plan.fired[0] > 0
        honest = [r for i, r in enumerate(results) if i != hostile]
        assert all(isinstance(r, AllReduceResult) for r in honest), honest
        assert_identical(honest)
        assert all(peers[hostile].peer_id in r.report.excluded for r in honest)
        assert sum(p.averager.rejections.counts["malformed"] for p in peers) == size - 1
        await _then_a_clean_round(peers, size)


async def test_a_leaders_strangers_are_its_clients_and_a_forged_digest_aborts_nothing():
    """Peers 0 and 1 averaged together before (partners); 2 and 3 are strangers to them,
    and 2 announces a forged digest of its result. The partner that leads takes the
    strangers as clients: their updates count, but they reduce no part and give no
    verdict, so the forged digest decides nothing but what the forger applies. (Before,
    the strangers served parts like anyone, and the forged digest made every server
    disagree: the round aborted for all.)"""
    size, forger = 4, 2
    vectors = random_vectors(size, 64 * 40, seed=10)
    async with averaging_peers(size) as peers:
        ids = [p.peer_id for p in peers]
        partners = set(ids[:2])
        for p in peers[:2]:
            p.matchmaker.partners = lambda me=p.peer_id: partners - {me}
        # A round whose first in the order of leadership is a partner (strangers follow
        # whoever leads; partners follow only each other).
        round = next(
            r
            for r in range(1, 1000)
            if min(ids, key=lambda i: leader_rank(SWARM, r, i)) in partners
        )
        plan = FaultPlan([Fault(action="corrupt", phase="done", corruption="forge", round=round)])
        peers[forger].averager.faults = plan
        results = _outcomes(await run_round(peers, round, vectors, [1.0] * size, timeout=20))
    assert plan.fired[0] > 0
    assert all(isinstance(r, AllReduceResult) for r in results), results
    assert_identical(results)
    report = results[0].report
    assert set(report.members) == set(ids)
    assert sorted(part.reducer for part in report.parts) == sorted(ids[:2])  # theirs alone
    assert_exact(results[0], dict(zip(ids, vectors)), dict.fromkeys(ids, 1.0))


NO_AUDIT = dataclasses.replace(PATIENT, audit=False)


def _all_partners(peers) -> list[str]:
    """Make every peer the partner of every other; their ids."""
    ids = [p.peer_id for p in peers]
    for p in peers:
        p.matchmaker.partners = lambda me=p.peer_id: set(ids) - {me}
    return ids


def _round_not_led_by(ids: list[str], liars: set[str], after: int = 0) -> int:
    """The first round past ``after`` whose leader (the lowest rank of ``ids``) is none of
    ``liars``."""
    return next(
        r
        for r in range(after + 1, 1000)
        if min(ids, key=lambda i: leader_rank(SWARM, r, i)) not in liars
    )


async def test_two_partners_lying_together_serve_no_more_and_the_retry_applies():
    """Five partners; two answer every stream they serve with a forged verdict. Neither
    is alone out of line, so the lone rule names neither (and every attempt aborted, for
    as long as they kept lying); they are out of line with the three others, most of the
    servers: each honest member makes them clients of its next attempts, which apply.
    Honest 2 serves from 3's address: being out of line names keys only (members lying to
    some can put honest servers there), so 2 still serves at 0 and 1."""
    size, liars = 5, (3, 4)
    vectors = random_vectors(size, 64 * 40, seed=12)
    hosts = {0: "127.0.0.1", 1: "127.0.0.2", 2: "127.0.0.9", 3: "127.0.0.9", 4: "127.0.0.8"}
    async with averaging_peers(size, hosts=hosts) as peers:
        ids = _all_partners(peers)
        round = _round_not_led_by(ids, {ids[x] for x in liars})
        plans = [FaultPlan([Fault(action="corrupt", phase="verdict", corruption="forge")])]
        plans.append(FaultPlan([Fault(action="corrupt", phase="verdict", corruption="forge")]))
        for liar, plan in zip(liars, plans, strict=True):
            peers[liar].averager.faults = plan
        first = _outcomes(await run_round(peers, round, vectors, [1.0] * size, timeout=20))
        second = _outcomes(await run_round(peers, round, vectors, [1.0] * size, timeout=20))
    assert all(plan.fired[0] > 0 for plan in plans)
    named = {ids[x] for x in liars}
    for result in first[:3]:
        assert isinstance(result, RoundAborted), first
        assert not result.dissenters and result.out_of_line == named, first
    honest = second[:3]
    assert all(isinstance(r, AllReduceResult) for r in honest), second
    assert_identical(honest)
    assert {part.reducer for part in honest[0].report.parts} == set(ids[:3])


async def _one_liar_named(
    fault: Callable[[list[str]], Fault], seed: int, config: AveragingConfig = PATIENT
) -> tuple[list[str], list[RoundAborted]]:
    """Four partners; 3 lies as ``fault(ids)`` says. Every honest member's first attempt
    aborts naming 3 alone, and the next attempt applies without 3 serving. The peer ids and
    the first attempt's aborts, for more checks."""
    size, liar = 4, 3
    vectors = random_vectors(size, 64 * 40, seed=seed)
    async with averaging_peers(size, config=config) as peers:
        ids = _all_partners(peers)
        round = _round_not_led_by(ids, {ids[liar]})
        plan = FaultPlan([fault(ids)])
        peers[liar].averager.faults = plan
        first = _outcomes(await run_round(peers, round, vectors, [1.0] * size, timeout=20))
        second = _outcomes(await run_round(peers, round, vectors, [1.0] * size, timeout=20))
    assert plan.fired[0] > 0
    aborts = []
    for result in first[:liar]:
        assert isinstance(result, RoundAborted) and result.dissenters == {ids[liar]}, first
        aborts.append(result)
    honest = second[:liar]
    assert all(isinstance(r, AllReduceResult) for r in honest), second
    assert_identical(honest)
    assert ids[liar] not in {part.reducer for part in honest[0].report.parts}
    return ids, aborts


async def _lie_to_one_member(
    phase: Phase, corruption: Corruption, seed: int, config: AveragingConfig = PATIENT
) -> None:
    """3 sends member 2 alone a ``corruption`` of its ``phase`` messages, signed as its own
    (the true ones to 0 and 1): every honest member names 3 (see :func:`_one_liar_named`),
    and none names 2."""
    ids, aborts = await _one_liar_named(
        lambda ids: Fault(action="corrupt", phase=phase, corruption=corruption, peer=ids[2]),
        seed,
        config,
    )
    for result in aborts:
        assert ids[2] not in result.out_of_line, result


async def test_a_partner_telling_one_server_another_digest_is_named_not_that_server():
    """3 announces its true digest to 0 and 1 and another one to 2, signed as its own (the
    seal of its own part over other results, and the digest they make). 2 disagrees and its
    verdict shows what 3 signed: 3 is proven two-faced everywhere. (Before, 0 and 1 saw
    every digest agree and one verdict disagree, and named the honest 2 as the lone server
    out of line.)"""
    await _lie_to_one_member("done", "forge", seed=13)


async def test_a_reducer_sending_one_member_other_results_is_named_and_applies_nowhere():
    """3 sends member 2 its part's results reversed (the same norm, within every bound),
    sealed as it sent them, and the true results to 0 and 1: 2's seal of part 3 differs
    from everyone else's under one claim, both signed by 3. (Before, a digest covered only
    who counted in each chunk: all four digests agreed, and 2 applied another mean than the
    others.) Audits off: 2's audit would catch a lie this wide first (the next test); the
    seals are what catches one on segments no audit drew."""
    await _lie_to_one_member("result", "negate", seed=14, config=NO_AUDIT)


@dataclasses.dataclass
class _Round:
    """One round of :func:`_audited_rounds`: every member's outcome, and after it, per
    honest member, its ``audit-failed`` count and its averager's counters, and how many
    times each misbehaving member's fault fired so far; with ``retry``, the honest members'
    aborts of a first attempt that did not apply."""

    results: list[AllReduceResult | RoundAborted]
    failed: list[int]
    stats: list[collections.Counter[str]]
    fired: dict[int, int]
    aborted: list[RoundAborted] = dataclasses.field(default_factory=list)


async def _audited_rounds(
    faults: dict[int, Fault | list[Fault]],
    *,
    size: int,
    seed: int,
    numel: int = 64 * 40,
    configs: dict[int, AveragingConfig] | None = None,
    rounds: int = 1,
    retry: bool = False,
    plans: dict[int, FaultPlan] | None = None,
) -> tuple[list[str], list[torch.Tensor], list[_Round]]:
    """``size`` partners, the last ones misbehaving as ``faults`` says (by index), in
    ``rounds`` rounds that none of them leads (``plans``: faults of honest members too, not
    counted as misbehaving); the peer ids, the vectors and each round.
    With ``retry``, an attempt that every honest member aborted, each naming someone, is
    tried once more: misbehaving servers may abort one attempt (a server's verdict is
    every member's to heed), and whoever each honest member named is a client of its next
    (see :func:`_one_liar_named`); who is named depends on the order in which notices and
    proofs arrived (a member that took a liar's rerun before the proof that it lied holds
    another part than the auditor), so the names are not checked here."""
    honest = min(faults)
    vectors = random_vectors(size, numel, seed=seed)
    faulty = {i: FaultPlan(f if isinstance(f, list) else [f]) for i, f in faults.items()}
    done = []
    async with averaging_peers(size, configs=configs) as peers:
        ids = _all_partners(peers)
        for i, plan in {**(plans or {}), **faulty}.items():
            peers[i].averager.faults = plan
        liars = {ids[i] for i in faults}
        number = 0
        for _ in range(rounds):
            number = _round_not_led_by(ids, liars, after=number)
            results = _outcomes(await run_round(peers, number, vectors, [1.0] * size, timeout=60))
            aborted: list[RoundAborted] = []
            if retry and all(isinstance(r, RoundAborted) for r in results[:honest]):
                aborted = results[:honest]
                assert all(exc.dissenters | exc.out_of_line for exc in aborted), aborted
                results = _outcomes(
                    await run_round(peers, number, vectors, [1.0] * size, timeout=60)
                )
            done.append(
                _Round(
                    results,
                    [p.averager.rejections.counts["audit-failed"] for p in peers[:honest]],
                    [collections.Counter(p.averager.stats) for p in peers[:honest]],
                    {i: plan.fired[0] for i, plan in faulty.items()},
                    aborted,
                )
            )
    return ids, vectors, done


def _applied_without(round: _Round, ids: list[str], liar: int, vectors) -> None:
    """Every honest member applied one result, ``liar`` reduces nothing in it, its part was
    reduced again by another member, and that part is the mean of the senders counted in
    it (the liar's own slice among them where the new reducer still took it: its lie was
    its reduction), to the codec's rounding."""
    honest = round.results[: len(round.failed)]
    assert all(isinstance(r, AllReduceResult) for r in honest), round.results
    assert_identical(honest)
    report = honest[0].report
    assert ids[liar] not in {p.reducer for p in report.parts}
    (part,) = [p for p in report.parts if p.part == report.members.index(ids[liar])]
    assert part.epoch >= 1
    counted = [i for i, peer in enumerate(ids) if part.included.get(peer) == part.chunks]
    assert len(counted) >= 2, part.included
    got = honest[0].mean[part.start : part.stop]
    senders = torch.stack([vectors[i] for i in counted])[:, part.start : part.stop].mean(dim=0)
    assert torch.linalg.vector_norm(got - senders) < 0.02 * torch.linalg.vector_norm(senders)


_REVERSED = Fault(action="corrupt", phase="result", corruption="negate")


async def test_a_reducer_sending_everyone_one_made_up_mean_fails_its_audits_and_is_rerun():
    """3 sends every member its part's mean reversed (the same norm, within every bound),
    the same to all and sealed: every seal and digest agrees. Each honest member audits a
    random segment of part 3 against its senders' signed bytes, fails 3, and the part is
    reduced again by a backup: the round applies with the senders' mean, 3 reducing
    nothing. (Without audits, the three honest members agree on part 3 reversed; only the
    liar's own copy, which this fault plan leaves true, disagreed and aborted the attempt:
    a liar that keeps its lie itself has the round applied.)"""
    liar = 3
    ids, vectors, (round,) = await _audited_rounds({liar: _REVERSED}, size=4, seed=15)
    assert round.fired[liar] > 0
    _applied_without(round, ids, liar, vectors)
    passed = [stats["audits-passed"] for stats in round.stats]
    assert round.failed == [1, 1, 1] and min(passed) >= 1, (round.failed, passed)
    for result in round.results[:liar]:
        assert result.report.liars == (ids[liar],), result.report.liars


async def test_a_reducer_whose_colluder_never_answers_audits_still_fails_them():
    """3 sends every member its part's mean reversed, as above, and 4, its colluder, never
    answers an audit's fetch (nor audits). An honest auditor waits the senders' timeout for
    4's segment, then holds 3's result to what 4's signed segment norm could move it: a
    reversed mean is far past that, so 3 fails and its part is reduced again (the first
    auditor to judge fails it; the others' audits of that claim end with the rerun). The
    parts of honest reducers pass with 4 silent. (Before, a silent contributor left every
    audit without a verdict and the honest members took the reversed part: two keys
    defeated the audits, and only the liar's own copy, left true, aborted the attempt.)
    In the next round nobody asks 4 again: its segments are bounded at once, so it costs
    each auditor one wait, not one a round.
    The first attempt may abort: 3 may send a verdict that disagrees, or a member (4
    above all, which takes every part unaudited) may take the rerun 3 makes of an honest
    member's part once that member failed 3 and cut its stream to it, if the rerun
    reaches it before the proof that 3 lied (the members that failed 3 do not take it).
    Every honest member then aborts, names who was out of line with it and makes them
    clients of its next attempt, which applies."""
    liar, colluder = 3, 4
    silence = Fault(action="drop", phase="segment")
    ids, vectors, (first, second) = await _audited_rounds(
        {liar: _REVERSED, colluder: silence},
        size=5,
        seed=17,
        configs={colluder: NO_AUDIT},
        rounds=2,
        retry=True,
    )
    assert first.fired[liar] > 0 and first.fired[colluder] > 0
    bounded = [stats["audits-unanswered"] for stats in first.stats]
    assert sum(first.failed) >= 1 and min(bounded) >= 1, (first.failed, bounded)
    if first.aborted:  # the retry applied, 3 reducing nothing in it
        honest = first.results[:liar]
        assert all(isinstance(r, AllReduceResult) for r in honest), first.results
        assert_identical(honest)
        assert ids[liar] not in {p.reducer for p in honest[0].report.parts}
    else:
        _applied_without(first, ids, liar, vectors)
        for n, result in zip(first.failed, first.results, strict=False):
            assert result.report.liars == ((ids[liar],) if n else ()), result.report.liars
    assert all(isinstance(r, AllReduceResult) for r in second.results[:liar]), second.results
    skipped = [stats["audit-fetches-skipped"] for stats in second.stats]
    assert second.fired[colluder] == first.fired[colluder] and min(skipped) >= 1, skipped


async def test_an_audit_that_catches_a_reducer_proves_it_to_the_other_members():
    """3 sends every member its part's mean reversed and answers no audit's fetch of its
    own segment. Member 0 waits a second for it, 1 and 2 ten: 0 fails 3 first and shows
    them what it found (3's signed answer, the segments of 0, 1 and 2), and each judges it
    on the result it holds and fails 3 at once, its own audit not over. So none of them
    takes the rerun 3 then makes of 0's part (0 cut its stream to 3): the first attempt
    applies, 3 reducing nothing. (Before, 1 and 2 waited out their own audits meanwhile,
    took that rerun while 0 kept its part, and the attempt could end with two digests.)"""
    liar = 3
    quick = dataclasses.replace(PATIENT, sender_timeout_s=1.0)
    silent = Fault(action="drop", phase="segment")
    ids, vectors, (round,) = await _audited_rounds(
        {liar: [_REVERSED, silent]}, size=4, seed=19, configs={0: quick}
    )
    assert round.fired[liar] > 0
    _applied_without(round, ids, liar, vectors)
    assert round.stats[0]["proofs-shown"] >= 1, round.stats[0]
    for member in (1, 2):
        assert round.stats[member]["proofs-taken"] == 1, round.stats[member]
        assert round.results[member].report.liars == (ids[liar],)


async def test_a_proof_showing_other_bytes_than_a_contributor_signed_fails_nobody():
    """As above, but 0 alters the first segment of every proof it shows (its hashes kept):
    each member judging it finds that segment is not the one its sender signed, so the
    proof proves nothing, and neither the reducer nor that sender is failed on it. 1 and 2
    fail 3 on their own audits (or take its part's rerun), and the round applies, within
    one more attempt (see the colluder test)."""
    liar = 3
    quick = dataclasses.replace(PATIENT, sender_timeout_s=1.0)
    silent = Fault(action="drop", phase="segment")
    altered = Fault(action="corrupt", phase="proof", corruption="negate")
    _ids, _vectors, (round,) = await _audited_rounds(
        {liar: [_REVERSED, silent]},
        size=4,
        seed=19,
        configs={0: quick},
        retry=True,
        plans={0: FaultPlan([altered])},
    )
    assert all(isinstance(r, AllReduceResult) for r in round.results[:liar]), round.results
    for member in (1, 2):
        stats = round.stats[member]
        assert stats["proofs-unproven"] >= 1 and stats["proofs-taken"] == 0, stats
        excluded = round.results[member].report.excluded
        assert not any("audit shows" in why for why in excluded.values()), excluded


async def test_a_reducer_spiking_one_chunk_of_a_large_part_fails_every_audit():
    """3 sends every member the first of its part's 40 result chunks x20, the rest true:
    within the part's bound (the part measures about 3.3 times the honest one), and on a
    chunk an audit's recomputation draws 1 time in 40. Every auditor holds every segment
    of the part to what its senders' signed norms allow there, whichever it drew, so 3
    fails and its part is reduced again. (Before, the three honest auditors all missed it
    about 93% of the time, and the round applied the spike.)"""
    size, liar = 4, 3
    assert len(chunk_spans(64 * 4 * 40, CODEC)) == 40
    spike = Fault(action="corrupt", phase="result", corruption="spike")
    ids, vectors, (round,) = await _audited_rounds(
        {liar: spike}, size=size, seed=18, numel=64 * 4 * 40 * size
    )
    assert round.fired[liar] > 0
    _applied_without(round, ids, liar, vectors)
    assert sum(round.failed) >= 1, round.failed


async def test_a_member_answering_an_audit_with_other_bytes_than_it_signed_is_struck():
    """3 answers every audit with its segment reversed (the hashes of what it signed kept):
    a sender trying to frame the reducers it sent to. Each honest auditor finds the segment
    is not the one 3 signed to the reducer, whose answer shows 3's own statement: it
    strikes 3 (or fails it, where 3 reduced the part), never an honest reducer, and the
    round applies among the others."""
    liar = 3
    framing = Fault(action="corrupt", phase="segment", corruption="negate")
    ids, _vectors, (round,) = await _audited_rounds({liar: framing}, size=4, seed=16)
    assert round.fired[liar] > 0
    honest = round.results[:liar]
    assert all(isinstance(r, AllReduceResult) for r in honest), round.results
    assert_identical(honest)
    assert all(n >= 1 for n in round.failed), round.failed
    for result in honest:
        assert result.report.liars == (ids[liar],), result.report.liars
        excluded = result.report.excluded
        assert set(excluded) == {ids[liar]}, excluded
        # Struck as a sender, or failed as the reducer whose own segment it altered.
        assert "its segment is not the one it signed" in excluded[ids[liar]], excluded


async def test_partners_on_the_network_of_a_demoted_one_serve_no_more():
    """Five partners, 3 and 4 two keys of one machine (127.0.0.9), the others each on an
    address of its own. 3 forges its verdicts in the first attempt and is named alone out
    of line; 4, honest then, forges them from the second. Each honest member took 4, last
    seen serving from 3's network, as a stranger with 3: the second attempt makes both
    clients and applies. (Before, the second attempt aborted too, naming 4: a key each.)"""
    size, liars = 5, (3, 4)
    vectors = random_vectors(size, 64 * 40, seed=15)
    hosts = {0: "127.0.0.1", 1: "127.0.0.2", 2: "127.0.0.3", 3: "127.0.0.9", 4: "127.0.0.9"}
    forged = [FaultPlan([Fault(action="corrupt", phase="verdict", corruption="forge")])]
    forged.append(FaultPlan([Fault(action="corrupt", phase="verdict", corruption="forge")]))
    async with averaging_peers(size, hosts=hosts) as peers:
        ids = _all_partners(peers)
        round = _round_not_led_by(ids, {ids[x] for x in liars})
        peers[3].averager.faults = forged[0]
        first = _outcomes(await run_round(peers, round, vectors, [1.0] * size, timeout=20))
        peers[4].averager.faults = forged[1]
        second = _outcomes(await run_round(peers, round, vectors, [1.0] * size, timeout=20))
        serving = [p.matchmaker._partners() for p in peers[:3]]
    assert forged[0].fired[0] > 0
    for result in first[:3]:
        assert isinstance(result, RoundAborted) and result.dissenters == {ids[3]}, first
    honest = second[:3]
    assert all(isinstance(r, AllReduceResult) for r in honest), second
    assert_identical(honest)
    reducers = {part.reducer for part in honest[0].report.parts}
    assert reducers == set(ids[:3]), (reducers, ids)
    assert forged[1].fired[0] == 0  # a client gives no verdict
    for me, partners in enumerate(serving):  # the honest ones on other addresses still serve
        assert partners == set(ids[:3]) - {ids[me]}, (me, partners)


async def test_a_partner_that_alone_aborts_a_round_serves_no_more_and_the_retry_applies():
    """Four partners; one answers every stream it serves with a forged verdict (another
    digest). The attempt aborts for all, and each honest member names it as the one server
    out of line with every other and takes it as a stranger for a while: the next attempt
    makes it a client (no part, no verdict) and applies. (Before, every attempt aborted for
    as long as it kept lying, and it stayed a partner, since no round applied.)"""
    forged = Fault(action="corrupt", phase="verdict", corruption="forge")
    await _one_liar_named(lambda ids: forged, seed=11)
