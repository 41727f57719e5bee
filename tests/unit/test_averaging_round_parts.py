"""The parts one member's round is made of, each alone (no streams): the agreement, the
per-member deadlines, our contribution, the reductions we run and the output they land in."""

import dataclasses

import pytest
import torch

from swarmloco.core.codec import CodecConfig, dequantize_into_, quantize
from swarmloco.net.averaging import wire
from swarmloco.net.averaging.allreduce import AveragingConfig
from swarmloco.net.averaging.contribution import Contribution
from swarmloco.net.averaging.group import Group, Member
from swarmloco.net.averaging.liveness import Watch
from swarmloco.net.averaging.output import Output
from swarmloco.net.averaging.reducing import Reductions
from swarmloco.net.averaging.round import check_done
from swarmloco.net.averaging.verdicts import PATIENCE_SPAN, Agreement
from swarmloco.net.averaging.view import RoundView, digest_of
from swarmloco.net.averaging.wire import ChunkMessage, ResultMessage
from swarmloco.net.identity import Identity
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

CODEC = CodecConfig(block_size=64, chunk_bytes=4 * (64 + 4), backend="eager")
CONFIG = AveragingConfig(codec=CODEC)


def group(size: int = 2, norms: tuple[float, ...] = ()) -> Group:
    members = tuple(
        Member(f"{i:040x}", b"k" * 32, "127.0.0.1:1", 1.0, norms[i] if norms else 0.0)
        for i in range(size)
    )
    blocks = 8
    return Group(
        group_id=b"g" * 16,
        round=1,
        members=members,
        parts=tuple((blocks * i, blocks) for i in range(size)),
        numel=64 * blocks * size,
        block_size=64,
    )


def take(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


def label(member: int) -> str:
    return f"m{member}"


# -- the agreement ----------------------------------------------------------------------


def test_a_member_applies_only_once_every_live_server_agreed_with_its_digest():
    agreement = Agreement(me=0, serving=True, patience=5.0, label=label)
    step = agreement.step(b"d", servers=[0, 1], now=0.0)
    assert step.announce == b"d" and step.verdict is None and not step.decided
    agreement.done.update({1: b"d", 2: b"d"})
    step = agreement.step(b"d", servers=[0, 1], now=1.0)
    assert step.announce is None and step.verdict.agreed and not step.decided
    agreement.verdicts[1] = pb.Verdict(agreed=True, digest=b"d")
    step = agreement.step(b"d", servers=[0, 1], now=2.0)
    assert step.verdict is None and step.decided and agreement.agreed() == 2


def test_a_serving_member_waits_its_patience_before_declaring_a_disagreement():
    agreement = Agreement(me=0, serving=True, patience=5.0, label=label)
    agreement.done[1] = b"old"
    assert agreement.step(b"d", servers=[0, 1], now=10.0).verdict is None
    assert agreement.step(b"d", servers=[0, 1], now=14.9).verdict is None
    step = agreement.step(b"d", servers=[0, 1], now=15.0)
    assert not step.verdict.agreed and "['m1'] hold another result" in step.verdict.reason
    assert step.disagreement == "member m0 disagrees (members ['m1'] hold another result)"


def test_the_patience_starts_again_while_the_round_moves_on_within_its_span():
    """Member 1 holds an older result while the round moves on here (a rerun sealed, an
    audit judged): member 0 waits a patience from the last progress, not from the first
    disagreement, and PATIENCE_SPAN patiences at most however long progress goes on."""
    agreement = Agreement(me=0, serving=True, patience=5.0, label=label)
    agreement.done[1] = b"old"
    assert agreement.step(b"d", servers=[0, 1], now=10.0).verdict is None
    agreement.progressed(14.0)
    assert agreement.step(b"d", servers=[0, 1], now=18.9).verdict is None
    step = agreement.step(b"d", servers=[0, 1], now=19.0)
    assert not step.verdict.agreed, step
    endless = Agreement(me=0, serving=True, patience=5.0, label=label)
    endless.done[1] = b"old"
    assert endless.step(b"d", servers=[0, 1], now=10.0).verdict is None
    now = 10.0
    while now < 10.0 + PATIENCE_SPAN * 5.0 - 1.0:
        now += 1.0
        endless.progressed(now)
        assert endless.step(b"d", servers=[0, 1], now=now).verdict is None, now
    endless.progressed(10.0 + PATIENCE_SPAN * 5.0)
    step = endless.step(b"d", servers=[0, 1], now=10.0 + PATIENCE_SPAN * 5.0)
    assert not step.verdict.agreed, step


def test_a_clients_digest_decides_nothing_but_what_the_client_applies():
    """Member 2 is a client (a stranger admitted to the group, say) announcing another
    digest: the servers agree among themselves and apply; only the client does not."""
    agreement = Agreement(me=0, serving=True, patience=5.0, label=label)
    agreement.done.update({1: b"d", 2: b"made-up"})
    step = agreement.step(b"d", servers=[0, 1], now=0.0)
    assert step.verdict.agreed and step.disagreement is None
    agreement.verdicts[1] = pb.Verdict(agreed=True, digest=b"d")
    assert agreement.step(b"d", servers=[0, 1], now=1.0).decided
    client = Agreement(me=2, serving=False, patience=5.0, label=label)
    client.verdicts.update({0: pb.Verdict(agreed=True, digest=b"d")})
    assert client.step(b"made-up", servers=[0, 1], now=1.0).disagreement is not None


def aborted(done: dict[int, bytes], verdicts: dict[int, bytes], servers=(0, 1, 2, 3)):
    """Member 0's step once its patience is spent, its digest ``d``: ``done`` and
    ``verdicts`` (agreed where ``d``) as the other servers announced them."""
    agreement = Agreement(me=0, serving=True, patience=5.0, label=label)
    agreement.done.update(done)
    agreement.verdicts.update(
        {m: pb.Verdict(agreed=d == b"d", digest=d) for m, d in verdicts.items()}
    )
    for now in (100.0, 110.0):  # patience spent: for digests, then for verdicts
        agreement.step(b"d", servers=list(servers), now=now)
    return agreement.step(b"d", servers=list(servers), now=120.0)


def test_the_one_server_out_of_line_with_every_other_is_named_and_no_one_in_a_split():
    """Servers 0-3. A forged verdict from 3 while every digest is ours: 3 is named. A
    digest of 3 differing from all others': 3 is named. Two out of line, or only two
    servers in all: nobody is (who is right cannot be told)."""

    ours = {1: b"d", 2: b"d", 3: b"d"}
    step = aborted(ours, {1: b"d", 3: b"forged"})
    assert step.disagreement and step.dissenters == (3,)
    step = aborted({**ours, 3: b"other"}, {1: b"d", 3: b"other"})
    assert step.disagreement and step.dissenters == (3,)
    step = aborted({1: b"d", 2: b"x", 3: b"x"}, {3: b"x"})
    assert step.disagreement and step.dissenters == ()
    step = aborted({1: b"x"}, {1: b"x"}, servers=(0, 1))
    assert step.disagreement and step.dissenters == ()


def test_servers_out_of_line_with_most_are_named_all():
    """Servers 0-4. Two forged verdicts while every digest is ours: both are out of line
    (the lone rule names neither). Two digests differing from the three others': both. A
    split of two against three, seen from the two: nobody (they are not most)."""

    five = (0, 1, 2, 3, 4)
    ours = {1: b"d", 2: b"d", 3: b"d", 4: b"d"}
    step = aborted(ours, {1: b"d", 3: b"forged", 4: b"forged"}, five)
    assert step.disagreement and step.dissenters == () and set(step.out_of_line) == {3, 4}
    step = aborted({**ours, 3: b"x", 4: b"x"}, {3: b"x"}, five)
    assert step.disagreement and step.dissenters == () and set(step.out_of_line) == {3, 4}
    step = aborted({1: b"d", 2: b"x", 3: b"x", 4: b"x"}, {2: b"x"}, five)
    assert step.disagreement and step.out_of_line == ()
    step = aborted({1: b"d", 2: b"d", 3: b"x"}, {3: b"x"})
    assert step.dissenters == (3,) and step.out_of_line == (3,)  # the lone one is out of line
    step = aborted({1: b"x"}, {1: b"x"}, servers=(0, 1))
    assert step.out_of_line == ()  # two servers: who is right cannot be told


def test_a_server_waits_for_every_servers_digest_before_naming_who_disagreed():
    agreement = Agreement(me=0, serving=True, patience=5.0, label=label)
    agreement.done.update({1: b"d", 3: b"d"})  # 2's digest still on its way
    agreement.verdicts[3] = pb.Verdict(agreed=False, digest=b"forged")
    assert agreement.step(b"d", servers=[0, 1, 2, 3], now=0.0).disagreement is None
    agreement.done[2] = b"d"
    # The verdicts of 1 and 2, which hold our digest, are on their way too: two forged
    # verdicts would not be told from one if only the first were awaited.
    assert agreement.step(b"d", servers=[0, 1, 2, 3], now=1.0).disagreement is None
    agreement.verdicts.update({x: pb.Verdict(agreed=True, digest=b"d") for x in (1, 2)})
    step = agreement.step(b"d", servers=[0, 1, 2, 3], now=2.0)
    assert step.disagreement and step.dissenters == (3,) and step.out_of_line == (3,)
    late = Agreement(me=0, serving=True, patience=5.0, label=label)
    late.verdicts[3] = pb.Verdict(agreed=False, digest=b"forged")
    late.step(b"d", servers=[0, 1, 2, 3], now=0.0)
    step = late.step(b"d", servers=[0, 1, 2, 3], now=5.0)  # patience spent: abort, no name
    assert step.disagreement and step.dissenters == ()


def said(digest: bytes, seq: int = 1) -> pb.MemberDone:
    return pb.MemberDone(digest=digest, seq=seq)


def shown(author_digest: bytes, **evidence: pb.MemberDone) -> pb.Verdict:
    """A disagreeing verdict of a server holding ``author_digest`` that shows the
    announcements ``m<index>=...`` it holds."""
    verdict = pb.Verdict(agreed=False, digest=author_digest, reason="another result")
    for name, done in evidence.items():
        verdict.evidence.add(member=int(name[1:]), done=done)
    return verdict


def weighed(announcements: dict[int, list[pb.MemberDone]], verdicts: dict[int, pb.Verdict]):
    """Member 0 of servers 0-3, its digest ``d``, once its patience is spent: the others'
    ``announcements`` to it in order, and their verdicts (``d`` agreed where not given)."""
    agreement = Agreement(me=0, serving=True, patience=5.0, label=label)
    for member, dones in announcements.items():
        for done in dones:
            agreement.heard(member, done)
    agreement.verdicts.update({m: pb.Verdict(agreed=True, digest=b"d") for m in (1, 2, 3)})
    agreement.verdicts.update(verdicts)
    for now in (100.0, 110.0):
        agreement.step(b"d", servers=[0, 1, 2, 3], now=now)
    return agreement.step(b"d", servers=[0, 1, 2, 3], now=120.0)


def test_a_member_that_told_two_servers_two_digests_is_named_not_the_server_it_lied_to():
    """3 told us ``d`` and told 2 ``x``, both signed as its first announcement: 2's verdict
    disagrees and shows what 3 told it. 3 is proven two-faced and named; 2, whose
    disagreement 3's signed word explains, is not (at the code before, 2 was named as the
    one server whose verdict disagreed)."""
    everyone = {1: [said(b"d")], 2: [said(b"d")], 3: [said(b"d")]}
    step = weighed(everyone, {2: shown(b"d", m3=said(b"x"))})
    assert step.disagreement and step.dissenters == (3,) and step.out_of_line == (3,)
    # Two liars telling 2 another digest each: both named on the proof, though with them
    # out, those holding our digest are no majority.
    step = weighed(everyone, {2: shown(b"d", m1=said(b"x"), m3=said(b"y"))})
    assert step.dissenters == (1, 3) and step.out_of_line == ()
    # Two digests under one number to us alone prove it too.
    step = weighed({**everyone, 3: [said(b"x"), said(b"d")]}, {2: shown(b"d", m3=said(b"x"))})
    assert step.dissenters == (3,)


def test_what_a_verdict_shows_names_no_one_it_does_not_prove():
    """An announcement 3 made before its last (a rerun changed what it held) explains 2's
    verdict without proving anything: nobody is named. One that names the author itself, or
    one with the author's own digest, explains nothing: the author is the lone one."""
    rerun = {1: [said(b"d")], 2: [said(b"d")], 3: [said(b"x"), said(b"d", seq=2)]}
    step = weighed(rerun, {2: shown(b"d", m3=said(b"x"))})
    assert step.disagreement and step.dissenters == () and step.out_of_line == ()
    everyone = {1: [said(b"d")], 2: [said(b"d")], 3: [said(b"d")]}
    for verdict in (shown(b"d", m2=said(b"x")), shown(b"d", m3=said(b"d"))):
        step = weighed(everyone, {2: verdict})
        assert step.dissenters == (2,) and step.out_of_line == (2,)


def test_a_server_that_told_another_a_newer_digest_than_us_is_waited_for_then_named():
    agreement = Agreement(me=0, serving=True, patience=5.0, label=label)
    for member in (1, 2, 3):
        agreement.heard(member, said(b"d"))
    agreement.verdicts.update({m: pb.Verdict(agreed=True, digest=b"d") for m in (1, 3)})
    agreement.verdicts[2] = shown(b"d", m3=said(b"x", seq=2))
    assert agreement.step(b"d", servers=[0, 1, 2, 3], now=0.0).disagreement is None
    step = agreement.step(b"d", servers=[0, 1, 2, 3], now=5.0)
    assert step.disagreement and step.dissenters == (3,) and step.out_of_line == (3,)


def seals_of(*hashes: bytes) -> list[pb.Seal]:
    """Seals of parts 0.. (each reduced by its own member at epoch 0) over ``hashes``."""
    return [pb.Seal(part=p, epoch=0, reducer=p, hash=h) for p, h in enumerate(hashes)]


def test_a_reducer_that_sealed_one_part_twice_is_named_and_the_member_it_lied_to_is_not():
    """3 sent member 2 other results of part 3 than everyone else, sealing each: 2's
    digest differs from ours in part 3 alone, under the claim we hold it by. Our verdict is
    made at once (no patience: it will not come round), 3 is proven two-faced and named,
    and 2, whose verdict disagrees on the result it was sent, is not out of line."""
    ours, lied = seals_of(b"a", b"b", b"c", b"d"), seals_of(b"a", b"b", b"c", b"x")
    agreement = Agreement(me=0, serving=True, patience=5.0, label=label)
    for member, seals, digest in ((1, ours, b"d"), (2, lied, b"e"), (3, ours, b"d")):
        agreement.heard(member, pb.MemberDone(digest=digest, seq=1, seals=seals))
    step = agreement.step(b"d", servers=[0, 1, 2, 3], now=10.0, seals=ours)
    assert agreement.two_faced == {3} and step.verdict is not None and not step.verdict.agreed
    agreement.verdicts.update({m: pb.Verdict(agreed=True, digest=b"d") for m in (1, 3)})
    agreement.verdicts[2] = pb.Verdict(agreed=False, digest=b"e")
    step = agreement.step(b"d", servers=[0, 1, 2, 3], now=11.0, seals=ours)
    assert step.disagreement and step.dissenters == (3,) and step.out_of_line == (3,)
    # Under another claim (a rerun of part 3 at epoch 1), the same difference proves
    # nothing: 2 may hold the part from before the rerun, and is waited for.
    rerun = [*ours[:3], pb.Seal(part=3, epoch=1, reducer=0, hash=b"y")]
    waiting = Agreement(me=0, serving=True, patience=5.0, label=label)
    for member, seals, digest in ((1, rerun, b"d"), (2, lied, b"e"), (3, rerun, b"d")):
        waiting.heard(member, pb.MemberDone(digest=digest, seq=1, seals=seals))
    assert waiting.step(b"d", servers=[0, 1, 2, 3], now=10.0, seals=rerun).verdict is None
    assert waiting.two_faced == set()


def test_a_verdict_shows_the_signed_announcements_that_differ_from_its_digest():
    agreement = Agreement(me=0, serving=True, patience=5.0, label=label)
    agreement.heard(1, said(b"d"))
    agreement.heard(2, said(b"x"))
    agreement.heard(2, said(b"y", seq=2))
    assert agreement.step(b"d", servers=[0, 1, 2], now=10.0).verdict is None
    verdict = agreement.step(b"d", servers=[0, 1, 2], now=15.0).verdict
    assert not verdict.agreed
    assert [(e.member, e.done.seq, e.done.digest) for e in verdict.evidence] == [(2, 2, b"y")]
    assert agreement.seq == 1 and agreement.announced[0][1].digest == b"d"


def test_an_announcement_counts_only_signed_by_its_member_with_seals_by_their_reducers():
    identities = [Identity.generate() for _ in range(2)]
    members = tuple(Member(i.peer_id_hex, i.public_key, "127.0.0.1:1", 1, 1) for i in identities)
    signed = dataclasses.replace(group(2), members=members)

    def seal(part: int, hash: bytes = b"h" * 16, by: int | None = None) -> pb.Seal:
        seal = pb.Seal(part=part, epoch=0, reducer=part, hash=hash)
        payload = wire.seal_payload(signed.group_id, signed.round, seal)
        seal.signature = identities[part if by is None else by].sign(wire.SEAL_DOMAIN, payload)
        return seal

    def done(seals=None, digest=None, seq=1, by=1, round=1) -> pb.MemberDone:
        seals = [seal(0), seal(1)] if seals is None else seals
        digest = digest_of(signed.group_id, signed.round, seals) if digest is None else digest
        payload = wire.done_payload(signed.group_id, round, 1, seq, digest)
        signature = identities[by].sign(wire.DONE_DOMAIN, payload)
        return pb.MemberDone(digest=digest, seq=seq, signature=signature, seals=seals)

    verified: set[bytes] = set()
    check_done(done(), signed, 1, verified)
    assert len(verified) == 2  # both seals: a second announcement with them needs no look
    with pytest.raises(Rejection, match="not signed by its member") as refused:
        check_done(done(by=0), signed, 1)  # member 0 signing as member 1
    assert refused.value.code == "bad-signature"
    forged = done()
    forged.digest = b"x" * 16
    for bad in (forged, done(round=2)):
        with pytest.raises(Rejection, match="not signed by its member"):
            check_done(bad, signed, 1)
    with pytest.raises(Rejection, match="numbered 0"):
        check_done(done(seq=0), signed, 1)
    with pytest.raises(Rejection, match="a digest of 3 bytes"):
        check_done(done(digest=b"ddd"), signed, 1)
    with pytest.raises(Rejection, match="another digest than its seals make"):
        check_done(done(digest=b"d" * 16), signed, 1)
    with pytest.raises(Rejection, match="one seal per part"):
        check_done(done(seals=[seal(0)]), signed, 1)
    with pytest.raises(Rejection, match="a seal not signed by its reducer"):
        check_done(done(seals=[seal(0), seal(1, by=0)]), signed, 1)


def test_a_verdict_that_differs_from_our_digest_ends_the_round_with_its_reason():
    agreement = Agreement(me=2, serving=False, patience=5.0, label=label)
    agreement.verdicts[0] = pb.Verdict(agreed=True, digest=b"other")
    step = agreement.step(b"d", servers=[0, 1], now=0.0)
    assert step.disagreement == "member m0 disagrees (its result differs from ours)"
    assert step.verdict is None and not step.decided


# -- per-member deadlines ---------------------------------------------------------------


def test_a_member_silent_past_the_liveness_timeout_fails_naming_the_silent_stream():
    watch = Watch(members=3, started=0.0, config=CONFIG)
    watch.start(0.0)
    assert watch.judges(watch.tick)
    now = CONFIG.liveness_timeout_s + 1.0
    assert watch.silence(1, now, answers_heard=0.5, stream_heard=None, lacking=False) == (
        "silent for 10.5s (its answers)"
    )
    assert watch.silence(1, now, answers_heard=None, stream_heard=0.0, lacking=False) == (
        "silent for 11.0s (its stream to us)"
    )
    assert watch.silence(1, now, answers_heard=None, stream_heard=None, lacking=True) is None


def test_after_our_own_loop_stalled_nobody_is_judged_and_silence_counts_from_then():
    watch = Watch(members=2, started=0.0, config=CONFIG)
    watch.start(0.0)
    stalled = 30.0  # a GC pause, a blocking call: every member looks silent
    assert not watch.judges(stalled)
    assert watch.judges(stalled + watch.tick)
    assert (
        watch.silence(1, stalled + 1.0, answers_heard=0.0, stream_heard=0.0, lacking=False) is None
    )


def test_a_reducer_without_a_result_fails_only_while_we_lack_its_part():
    watch = Watch(members=2, started=0.0, config=CONFIG)
    late = CONFIG.reducer_timeout_s + 1.0
    assert watch.silence(1, late, answers_heard=None, stream_heard=None, lacking=False) is None
    assert watch.silence(1, late, answers_heard=None, stream_heard=None, lacking=True) == (
        "no result for 21.0s"
    )
    watch.heard_result(1, late - 1.0)
    assert watch.silence(1, late, answers_heard=None, stream_heard=None, lacking=True) is None


# -- our contribution, our reductions, the output ---------------------------------------


def parts_of(g: Group, me: int = 0):
    view = RoundView(g, me, CODEC)
    ours = Contribution(group=g, view=view, codec=CODEC, norm_bound=float("inf"), take=take)
    reducing = Reductions(
        group=g,
        view=view,
        me=me,
        config=CONFIG,
        contribution=ours,
        clock=lambda: 0.0,
        take=take,
        sign=Identity.generate().sign,
    )
    output = Output(result=torch.zeros(g.numel), group=g, view=view, codec=CODEC)
    return view, ours, reducing, output


def test_our_part_reduced_alone_lands_in_the_output_and_stays_in_the_backlog():
    g = group()
    view, ours, reducing, output = parts_of(g)
    vector = torch.randn(g.numel, generator=torch.Generator().manual_seed(1))
    ours.encode(vector, None)
    assert reducing.start(0, 0, senders=[0]) is None  # epoch 0: no rerun notice
    landed = 0
    while (done := reducing.finish_next(0)) is not None:
        args = (done.part, done.epoch, 0, done.index, done.payload, done.scales)
        assert output.apply(*args, done.contributors, done.message)
        landed += 1
    assert landed == len(view.spans[0]) and view.chunks_complete(0)
    assert [phase for phase, _ in reducing.backlog()] == ["result"] * landed
    q, s = (
        torch.empty(g.numel, dtype=torch.int8),
        torch.empty(g.numel // 64, dtype=CODEC.scale_torch_dtype),
    )
    quantize(vector, CODEC, out=(q, s))
    expected = torch.empty(g.numel)
    dequantize_into_(expected, q, s, CODEC)
    start, stop = g.part_range(0)
    assert torch.equal(output.result[start:stop], expected[start:stop])


def test_an_update_above_the_groups_norm_bound_is_scaled_below_it_and_the_callers_stays():
    g = group()
    view = RoundView(g, 0, CODEC)
    ours = Contribution(group=g, view=view, codec=CODEC, norm_bound=1.0, take=take)
    vector = torch.full((g.numel,), 1.0)
    ours.encode(vector, None)
    assert ours.clipped == pytest.approx(1.0 / vector.norm().item(), rel=1e-5)
    assert torch.equal(vector, torch.full((g.numel,), 1.0))


def test_a_chunk_past_the_end_of_a_part_or_a_result_of_the_wrong_size_is_refused():
    g = group()
    view, ours, reducing, output = parts_of(g)
    ours.encode(torch.zeros(g.numel), None)
    reducing.start(0, 0, senders=[0, 1])
    chunks = len(view.spans[0])
    empty = memoryview(b"")
    with pytest.raises(Rejection) as refused:
        reducing.accept(1, ChunkMessage(g.group_id, 1, 0, 0, chunks, empty, empty))
    assert refused.value.code == "bad-index"
    wrong = ResultMessage(
        part=1, epoch=0, index=0, payload=memoryview(b"x"), scales=empty, contributors=b""
    )
    with pytest.raises(Rejection) as refused:
        output.receive(1, wrong, b"")
    assert refused.value.code == "bad-size"
    assert not output.receive(0, wrong, b"")  # member 0 does not reduce part 1: stale
