"""Signed declarations, group formation by a leader and the checks every member makes."""

import pytest

from swarmloco.net.averaging.group import (
    NONCE_BYTES,
    build_group,
    check_declaration,
    check_group,
    norm_bound,
    sign_declaration,
)
from swarmloco.net.identity import Identity
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

SWARM = "ab" * 20
NUMEL = 64 * 100


def declare(
    identity: Identity,
    *,
    weight: float = 1.0,
    endpoint: str = "127.0.0.1:1000",
    bandwidth: float = 1.0,
    round: int = 3,
    numel: int = NUMEL,
    norm: float = 0.0,
    ranges: tuple[tuple[int, int, int, int], ...] = (),
) -> pb.MemberDeclaration:
    return sign_declaration(
        identity,
        endpoint=endpoint,
        weight=weight,
        bandwidth=bandwidth,
        swarm_id=SWARM,
        round=round,
        numel=numel,
        block_size=64,
        timestamp_ms=1_000_000,
        norm=norm,
        ranges=ranges,
    )


def check(d: pb.MemberDeclaration, **kw):
    args = dict(swarm_id=SWARM, round=3, numel=NUMEL, block_size=64)
    args.update(kw)
    return check_declaration(d, **args)


def test_declarations_are_signed_and_bound_to_their_round():
    me = Identity.generate()
    member = check(declare(me, weight=5.0))
    assert member.peer_id == me.peer_id_hex and member.weight == 5.0 and member.serving
    tampered = declare(me)
    tampered.weight = 1e9
    with pytest.raises(Rejection, match="signature"):
        check(tampered)
    with pytest.raises(Rejection) as info:
        check(declare(me, round=2))
    assert info.value.code == "stale-round"
    with pytest.raises(Rejection) as info:
        check(declare(me, numel=NUMEL + 64))
    assert info.value.code == "bad-size"
    with pytest.raises(Rejection, match="too long ago"):
        check(declare(me), now_ms=1_000_000 + 700_000, max_age_ms=600_000)
    client = check(declare(me, endpoint="", bandwidth=5.0))
    assert client.bandwidth == 0.0 and not client.serving


def test_the_declared_norm_is_signed_and_must_be_a_finite_non_negative_number():
    me = Identity.generate()
    assert check(declare(me, norm=2.5)).norm == 2.5
    tampered = declare(me, norm=2.5)
    tampered.norm = 1e30
    with pytest.raises(Rejection, match="signature"):
        check(tampered)
    for bad in (float("nan"), float("inf"), -1.0):
        forged = declare(me)
        forged.norm = bad  # a liar signs whatever it likes: the value itself is refused
        with pytest.raises(Rejection) as info:
            check(forged)
        assert info.value.code == "bad-norm"


def test_the_dataset_ranges_a_member_declares_are_signed_and_bounded():
    me = Identity.generate()
    ranges = ((0, 3, 0, 8), (0, 5, 16, 4))
    member = check(declare(me, ranges=ranges))
    assert member.ranges == ranges
    assert check(declare(me)).ranges == ()
    tampered = declare(me, ranges=ranges)
    tampered.ranges[0].count = 80  # claiming more sequences than were signed
    with pytest.raises(Rejection, match="signature"):
        check(tampered)
    dropped = declare(me, ranges=ranges)
    del dropped.ranges[1]
    with pytest.raises(Rejection, match="signature"):
        check(dropped)
    for bad in ((0, 1, 0, 0), (0, 1 << 20, 0, 1), (0, 1, 2**48, 1)):
        with pytest.raises(Rejection) as info:
            check(declare(me, ranges=(bad,)))
        assert info.value.code == "bad-declaration"
    with pytest.raises(Rejection, match="at most 16"):
        check(declare(me, ranges=tuple((0, s, 0, 1) for s in range(17))))
    # Sixteen ranges at their longest with every other field at its longest still fit.
    longest = sign_declaration(
        me,
        endpoint="h" * 255 + ":65535",
        weight=1.0,
        bandwidth=1.0,
        swarm_id=SWARM,
        round=2**63,
        numel=NUMEL,
        block_size=64,
        timestamp_ms=2**63,
        norm=1.0,
        membership=b"m" * 192,
        ranges=tuple((2**32 - 1, (1 << 20) - 1, 2**47, 2**47 - 1) for _ in range(16)),
    )
    assert longest.ByteSize() <= 2560


def test_the_norm_bound_is_a_multiple_of_the_lower_median_of_declared_norms():
    assert norm_bound([1.0, 2.0, 3.0], 4.0) == 8.0
    assert norm_bound([1.0, 2.0, 3.0, 4.0], 4.0) == 8.0  # the lower of the middle two
    # A liar declaring a huge norm cannot raise the bound; one declaring a tiny norm lowers
    # it only to the next honest member's (with three or more members).
    assert norm_bound([1.0, 1.2, 1e30], 4.0) == pytest.approx(4.8)
    assert norm_bound([1e-30, 1.0, 1.2], 4.0) == 4.0
    # Two members: the smaller declaration rules (a liar can only shrink the round).
    assert norm_bound([1.0, 1e30], 4.0) == 4.0
    # Undeclared (0) norms are left out; nobody declaring, or no multiple: no bound.
    assert norm_bound([0.0, 2.0, 0.0], 4.0) == 8.0
    assert norm_bound([0.0, 0.0], 4.0) == float("inf")
    assert norm_bound([1.0, 2.0], 0.0) == float("inf")


def test_a_heavy_weight_is_capped_and_kept_and_only_no_weight_is_struck():
    ids = [Identity.generate() for _ in range(4)]
    weights = [100.0, 120.0, 1e9, 90.0]
    decls = [declare(i, weight=w) for i, w in zip(ids, weights)]
    info, struck = build_group(decls, round=3, numel=NUMEL, block_size=64, nonce=b"n" * NONCE_BYTES)
    assert info is not None and struck == {}
    group = check_group(info, me=decls[0], swarm_id=SWARM, cap_multiple=10.0)
    # The lower median of the declared weights is 100: 1e9 counts as 1000, the rest as is.
    assert group.weights == [100.0, 120.0, 1000.0, 90.0]
    assert check_group(info, me=decls[0], swarm_id=SWARM, cap_multiple=0.0).weights == weights
    nan = [declare(i, weight=w) for i, w in zip(ids, [1.0, float("nan"), -1.0, 2.0])]
    _, struck = build_group(nan, round=3, numel=NUMEL, block_size=64, nonce=b"n" * NONCE_BYTES)
    assert set(struck) == {1, 2} and "not a finite positive number" in struck[1]


def test_a_leaders_group_checks_out_on_every_member():
    ids = [Identity.generate() for _ in range(4)]
    decls = [
        declare(ids[0], bandwidth=1.0),
        declare(ids[1], bandwidth=3.0),
        declare(ids[2], endpoint=""),  # client mode: no part
        declare(ids[3], weight=float("inf")),  # struck
    ]
    info, struck = build_group(decls, round=3, numel=NUMEL, block_size=64, nonce=b"n" * NONCE_BYTES)
    assert info is not None and set(struck) == {3}
    for d in decls[:3]:
        group = check_group(info, me=d, swarm_id=SWARM, cap_multiple=10.0)
        assert group.size == 3 and group.group_id == info.group_id
        assert group.parts == ((0, 25), (25, 75), (100, 0))
        assert group.reducing == [0, 1]
    with pytest.raises(Rejection, match="own declaration"):
        check_group(info, me=decls[3], swarm_id=SWARM, cap_multiple=10.0)


def test_a_huge_bandwidth_claim_buys_at_most_four_times_the_median_part():
    # Uncapped, a claim of 1e300 among three members at 12.5 MB/s made its member the
    # reducer of every block, and so of the whole mean.
    ids = [Identity.generate() for _ in range(4)]
    decls = [declare(i, bandwidth=12.5e6) for i in ids[:3]] + [declare(ids[3], bandwidth=1e300)]
    info, _ = build_group(decls, round=3, numel=NUMEL, block_size=64, nonce=b"n" * NONCE_BYTES)
    assert info is not None
    for d in decls:
        group = check_group(info, me=d, swarm_id=SWARM, cap_multiple=10.0)
        assert [blocks for _, blocks in group.parts] == [15, 14, 14, 57]  # 4/7 of 100
    # Members refuse a group cut by the claim as declared.
    bent = pb.GroupInfo()
    bent.CopyFrom(info)
    bent.part_first_block[:] = [0, 0, 0, 0]
    bent.part_blocks[:] = [0, 0, 0, 100]
    with pytest.raises(Rejection, match="proportional"):
        check_group(bent, me=decls[0], swarm_id=SWARM, cap_multiple=10.0)


def test_the_leaders_clients_do_not_lift_the_bandwidth_cap():
    # One partner and the liar serve; two strangers made clients claim 1e300 too. The cap
    # is taken among those that serve (lower median: the honest 12.5 MB/s).
    ids = [Identity.generate() for _ in range(5)]
    decls = [
        declare(ids[0], bandwidth=12.5e6),
        declare(ids[1], bandwidth=1e300),
        declare(ids[2], bandwidth=12.5e6),
        declare(ids[3], bandwidth=1e300),
        declare(ids[4], bandwidth=1e300),
    ]
    info, _ = build_group(
        decls, round=3, numel=NUMEL, block_size=64, nonce=b"n" * NONCE_BYTES, clients={3, 4}
    )
    assert info is not None
    for d in decls:
        group = check_group(info, me=d, swarm_id=SWARM, cap_multiple=10.0)
        assert [blocks for _, blocks in group.parts] == [17, 67, 16, 0, 0]  # 4/6 of 100
        assert group.reducing == [0, 1, 2]


def _mutated(info: pb.GroupInfo, mutate) -> pb.GroupInfo:
    copy = pb.GroupInfo()
    copy.CopyFrom(info)
    mutate(copy)
    return copy


def test_members_refuse_a_group_the_leader_bent():
    ids = [Identity.generate() for _ in range(3)]
    decls = [declare(i) for i in ids]
    info, _ = build_group(decls, round=3, numel=NUMEL, block_size=64, nonce=b"n" * NONCE_BYTES)
    assert info is not None
    me = decls[0]

    def swap_parts(g):
        g.part_blocks[0] += 1
        g.part_blocks[1] -= 1

    def add_no_weight(g):
        g.members.append(declare(Identity.generate(), weight=-1.0))
        g.part_first_block.append(100)
        g.part_blocks.append(0)

    def change_id(g):
        g.group_id = b"\x00" * 16

    def duplicate(g):
        g.members.append(g.members[1])

    def wrong_round(g):
        g.round = 4

    for mutate, what in [
        (swap_parts, "proportional"),
        (add_no_weight, "bad weight"),
        (change_id, "group id"),
        (duplicate, "twice"),
        (wrong_round, "round"),
    ]:
        with pytest.raises(Rejection, match=what):
            check_group(_mutated(info, mutate), me=me, swarm_id=SWARM, cap_multiple=10.0)


def test_no_group_of_several_without_a_serving_member():
    info, _ = build_group(
        [declare(Identity.generate(), endpoint="") for _ in range(2)],
        round=3,
        numel=NUMEL,
        block_size=64,
        nonce=b"n" * NONCE_BYTES,
    )
    assert info is None


def test_a_client_mode_member_alone_reduces_its_own_vector():
    me = declare(Identity.generate(), endpoint="")
    info, _ = build_group([me], round=3, numel=NUMEL, block_size=64, nonce=b"n" * NONCE_BYTES)
    group = check_group(info, me=me, swarm_id=SWARM, cap_multiple=10.0)
    assert group.size == 1 and group.parts == ((0, NUMEL // 64),)


def test_member_part_ranges():
    ids = [Identity.generate() for _ in range(2)]
    decls = [declare(i) for i in ids]
    info, _ = build_group(decls, round=3, numel=NUMEL, block_size=64, nonce=b"n" * NONCE_BYTES)
    group = check_group(info, me=decls[1], swarm_id=SWARM, cap_multiple=10.0)
    assert group.part_range(0) == (0, 50 * 64) and group.part_range(1) == (50 * 64, NUMEL)
    assert group.index_of(ids[1].peer_id_hex) == 1
