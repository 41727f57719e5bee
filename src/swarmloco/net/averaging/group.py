"""The group of one averaging round: signed member declarations, how a leader forms the
group from them and how every member checks the group it is handed.

All pure: no sockets, no clock of its own (times are arguments). A member declares what it
brings to round r (key, endpoint, weight, bandwidth, vector size, its update's norm) and
signs it; the leader strikes declarations whose weight is no weight (not finite and
positive: :func:`weight_violations`), orders the rest, cuts the vector into parts
proportional to the declared bandwidths (:func:`part_blocks`; client-mode members get
none, nor do the members the leader takes as clients: its strangers, when it has partners)
and names the group by hashing all of it with a nonce. Because the declarations
travel signed and unchanged, every member re-checks everything the leader did
(:func:`check_group`) instead of trusting it, and derives the same bound on every update
from the declared norms (:meth:`Group.norm_bound`) and the same weights from the declared
ones, each capped at a multiple of their lower median (:attr:`Group.weights`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import msgpack

from swarmloco.core.codec import num_blocks
from swarmloco.core.grouping import (
    capped_weights,
    part_bandwidths,
    part_blocks,
    weight_violations,
)
from swarmloco.net.admission import MAX_CERTIFICATE_BYTES
from swarmloco.net.endpoints import MAX_ENDPOINT_CHARS
from swarmloco.net.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    peer_id_of,
    verify,
)
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

if TYPE_CHECKING:
    from swarmloco.net.admission import Gate

DECLARATION_DOMAIN = b"swarmloco/v1/member-declaration\x00"
GROUP_ID_BYTES = 16
NONCE_BYTES = 16
MAX_RANGES = 16
"""Dataset ranges one declaration carries at most (``dataset/ledger.py``)."""
MAX_RANGE_SHARD = 1 << 20
MAX_DECLARATION_BYTES = 2560
"""The largest serialized declaration accepted: every field at its longest (an endpoint
of 262 characters of up to 4 bytes each, a membership certificate, 16 dataset ranges)
with room to spare."""


@dataclasses.dataclass(frozen=True)
class Member:
    """One member of a group, from its checked declaration."""

    peer_id: str
    """Hex peer id (BLAKE2b-160 of the public key)."""
    public_key: bytes
    endpoint: str
    """HOST:PORT it serves on; empty in client mode."""
    weight: float
    bandwidth: float
    norm: float = 0.0
    """The L2 norm it declared for its update (0: not declared)."""
    ranges: tuple[tuple[int, int, int, int], ...] = ()
    """On a pinned dataset: ``(epoch, shard, first, count)`` of the sequences its update
    completes (``dataset/ledger.py``)."""

    @property
    def serving(self) -> bool:
        """Whether it reduces a part (client-mode members only send and receive)."""
        return bool(self.endpoint) and self.bandwidth > 0


@dataclasses.dataclass(frozen=True)
class Group:
    """The group of one round, as every member holds it after :func:`check_group`."""

    group_id: bytes
    round: int
    members: tuple[Member, ...]
    parts: tuple[tuple[int, int], ...]
    """``(first_block, blocks)`` of part i, reduced by member i (empty for clients)."""
    numel: int
    """Padded length of the averaged vector."""
    block_size: int
    cap_multiple: float = 0.0
    """Weights count up to this multiple of the members' lower median (0: uncapped)."""

    @property
    def size(self) -> int:
        return len(self.members)

    def index_of(self, peer_id: str) -> int:
        for i, member in enumerate(self.members):
            if member.peer_id == peer_id:
                return i
        raise KeyError(f"peer {peer_id} is not in group {self.group_id.hex()}")

    def part_range(self, part: int) -> tuple[int, int]:
        """Element range ``[start, stop)`` of a part in the flat vector."""
        first, blocks = self.parts[part]
        return first * self.block_size, (first + blocks) * self.block_size

    @property
    def reducing(self) -> list[int]:
        """Members with a non-empty part."""
        return [i for i, (_, blocks) in enumerate(self.parts) if blocks > 0]

    @property
    def weights(self) -> list[float]:
        """What each member's update counts for in the mean: its declared weight (tokens
        since its last round), capped (:func:`capped_weights`). The same on every member."""
        return capped_weights([m.weight for m in self.members], self.cap_multiple)

    def norm_bound(self, multiple: float) -> float:
        """The largest L2 norm an update may have in this group: ``multiple`` times the
        lower median of the norms its serving members declared (undeclared ones aside; every
        member's when none of them declared one). A member declaring a huge norm cannot
        raise it unless most members do; one declaring a tiny norm can at most lower it to
        the next honest one's (in groups of three or more). Clients do not count: a leader's
        strangers are its clients, and two of them declaring tiny norms in a group of four
        would otherwise shrink every member's update to nothing. ``inf`` when ``multiple``
        is 0 or nobody declared a norm."""
        served = norm_bound([m.norm for m in self.members if m.serving], multiple)
        if math.isfinite(served) or multiple <= 0:
            return served
        return norm_bound([m.norm for m in self.members], multiple)


def norm_bound(norms: Sequence[float], multiple: float) -> float:
    """``multiple`` x the lower median of the positive ``norms`` (``inf``: no bound)."""
    declared = sorted(n for n in norms if n > 0)
    if multiple <= 0 or not declared:
        return math.inf
    return multiple * declared[(len(declared) - 1) // 2]


# -- declarations ----------------------------------------------------------------------------


def _declaration_payload(d: pb.MemberDeclaration) -> bytes:
    return msgpack.packb(
        [
            d.public_key,
            d.endpoint,
            float(d.weight),
            float(d.bandwidth),
            d.swarm_id,
            d.round,
            d.numel,
            d.block_size,
            d.timestamp_ms,
            float(d.norm),
            *([[[r.epoch, r.shard, r.first, r.count] for r in d.ranges]] if d.ranges else []),
        ],
        use_bin_type=True,
    )


def sign_declaration(
    identity: Identity,
    *,
    endpoint: str,
    weight: float,
    bandwidth: float,
    swarm_id: str,
    round: int,
    numel: int,
    block_size: int,
    timestamp_ms: int,
    norm: float = 0.0,
    membership: bytes = b"",
    ranges: Sequence[tuple[int, int, int, int]] = (),
) -> pb.MemberDeclaration:
    """This peer's signed declaration for ``round`` (``norm``: of its update; 0: not
    declared; ``membership``: its certificate, in a private swarm; ``ranges``: the
    dataset's sequences its update completes)."""
    declaration = pb.MemberDeclaration(
        public_key=identity.public_key,
        endpoint=endpoint,
        weight=float(weight),
        bandwidth=float(bandwidth) if endpoint else 0.0,
        swarm_id=swarm_id,
        round=round,
        numel=numel,
        block_size=block_size,
        timestamp_ms=timestamp_ms,
        norm=float(norm),
        membership=membership,
        ranges=[
            pb.SequenceRange(epoch=e, shard=sh, first=first, count=count)
            for e, sh, first, count in ranges
        ],
    )
    declaration.signature = identity.sign(DECLARATION_DOMAIN, _declaration_payload(declaration))
    return declaration


def check_declaration(
    d: pb.MemberDeclaration,
    *,
    swarm_id: str,
    round: int,
    numel: int,
    block_size: int,
    now_ms: int | None = None,
    max_age_ms: int = 0,
    admission: Gate | None = None,
    network: str = "",
) -> Member:
    """The member a declaration describes, after checking it fits this round.

    ``now_ms``/``max_age_ms`` (leader side) refuse declarations signed too long ago or in
    the future, so an old declaration cannot be replayed into a later group of the same
    round number. ``admission`` (a private swarm, or a public one's proofs of work)
    refuses a declaration without a valid credential for its key, checked last, for the
    source ``network`` it came from ("": not known). Raises Rejection with the reason.

    Every bytes and string field is length-checked first, before anything is hashed,
    verified or kept: the signature does not cover the certificate, and a declaration
    travels to every member inside the group.
    """
    size = d.ByteSize()  # first: reading a bytes or string field copies it, however long
    if size > MAX_DECLARATION_BYTES:
        raise Rejection(
            "bad-declaration",
            f"declaration is {size} bytes; a declaration is at most {MAX_DECLARATION_BYTES}",
        )
    if (
        len(d.public_key) != PUBLIC_KEY_BYTES
        or len(d.signature) != SIGNATURE_BYTES
        or len(d.endpoint) > MAX_ENDPOINT_CHARS
        or len(d.swarm_id) != len(swarm_id)
        or len(d.membership) > MAX_CERTIFICATE_BYTES
    ):
        raise Rejection(
            "bad-declaration",
            f"declaration fields have the wrong size (key {len(d.public_key)} bytes, "
            f"signature {len(d.signature)}, endpoint {len(d.endpoint)} characters, swarm id "
            f"{len(d.swarm_id)}, certificate {len(d.membership)} bytes; at most "
            f"{MAX_ENDPOINT_CHARS} characters of endpoint and {MAX_CERTIFICATE_BYTES} bytes "
            "of certificate)",
        )
    if d.swarm_id != swarm_id or d.round != round:
        raise Rejection(
            "stale-round",
            f"declaration is for swarm {d.swarm_id[:12]} round {d.round}, not {round}",
        )
    if d.numel != numel or d.block_size != block_size:
        raise Rejection(
            "bad-size",
            f"declaration is for {d.numel} values in blocks of {d.block_size}, "
            f"this round averages {numel} in blocks of {block_size}",
        )
    if not math.isfinite(d.weight) or not math.isfinite(d.bandwidth) or d.bandwidth < 0:
        raise Rejection("bad-weight", "declared weight or bandwidth is not a finite number")
    if not math.isfinite(d.norm) or d.norm < 0:
        raise Rejection("bad-norm", f"declared update norm {d.norm} is not a finite number >= 0")
    if d.bandwidth > 0 and not d.endpoint:
        raise Rejection("bad-declaration", "a client-mode member cannot declare bandwidth")
    if len(d.ranges) > MAX_RANGES or any(
        r.count == 0 or r.shard >= MAX_RANGE_SHARD or r.first + r.count >= 2**48 or r.epoch >= 2**32
        for r in d.ranges
    ):
        raise Rejection(
            "bad-declaration",
            f"declared {len(d.ranges)} dataset ranges; at most {MAX_RANGES}, each of at "
            "least one sequence within bounds",
        )
    if now_ms is not None and max_age_ms and abs(now_ms - d.timestamp_ms) > max_age_ms:
        raise Rejection("stale-round", "declaration was signed too long ago (or in the future)")
    if not verify(d.public_key, d.signature, DECLARATION_DOMAIN, _declaration_payload(d)):
        raise Rejection("bad-signature", "declaration signature does not match")
    peer_id = peer_id_of(d.public_key).hex()
    if admission is not None:
        admission.check(peer_id, d.membership, network=network)
    return Member(
        peer_id=peer_id,
        public_key=bytes(d.public_key),
        endpoint=d.endpoint,
        weight=float(d.weight),
        bandwidth=float(d.bandwidth),
        norm=float(d.norm),
        ranges=tuple((r.epoch, r.shard, r.first, r.count) for r in d.ranges),
    )


# -- forming and checking a group -----------------------------------------------------------


def _group_id(
    round: int,
    declarations: Sequence[pb.MemberDeclaration],
    parts: Sequence[tuple[int, int]],
    nonce: bytes,
) -> bytes:
    h = hashlib.blake2b(b"swarmloco/v1/group\x00", digest_size=GROUP_ID_BYTES)
    h.update(struct.pack("<Q", round))
    for d in declarations:
        h.update(struct.pack("<H", len(d.signature)))
        h.update(d.signature)
    for first, blocks in parts:
        h.update(struct.pack("<QQ", first, blocks))
    h.update(nonce)
    return h.digest()


def _part_bandwidths(serving: list[float]) -> list[float]:
    """What the parts are cut by: the serving members' declared reduction bandwidths, each
    capped (:func:`~swarmloco.core.grouping.part_bandwidths`), except that a group of one
    reduces its own vector (no network), client mode or not."""
    return [1.0] if len(serving) == 1 else part_bandwidths(serving)


def build_group(
    declarations: Sequence[pb.MemberDeclaration],
    *,
    round: int,
    numel: int,
    block_size: int,
    nonce: bytes,
    clients: Collection[int] = (),
) -> tuple[pb.GroupInfo | None, dict[int, str]]:
    """The leader's group from checked declarations (leader first, then in joining order).

    Returns the group (None if no member can serve a part) and ``{index in declarations:
    reason}`` of the members struck for their weight (no weight: :func:`weight_violations`).
    A large weight stays as declared (the declaration is signed): every member caps it
    the same way where it is used (:attr:`Group.weights`). ``clients``: indices of members
    that serve no part whatever they declared (they send and receive only); ignored if
    nobody else could serve.
    """
    struck = weight_violations([d.weight for d in declarations])
    kept_at = [i for i in range(len(declarations)) if i not in struck]
    kept = [declarations[i] for i in kept_at]
    declared = [d.bandwidth if d.endpoint else 0.0 for d in kept]
    chosen = [0.0 if i in clients else b for i, b in zip(kept_at, declared, strict=True)]
    if len(kept) > 1 and sum(chosen) > 0:
        declared = chosen  # capped among those that serve, not the leader's clients
    bandwidths = _part_bandwidths(declared)
    if not kept or sum(bandwidths) <= 0:
        return None, struck
    parts = part_blocks(num_blocks(numel, block_size), bandwidths)
    info = pb.GroupInfo(
        group_id=_group_id(round, kept, parts, nonce),
        round=round,
        members=kept,
        part_first_block=[first for first, _ in parts],
        part_blocks=[blocks for _, blocks in parts],
        nonce=nonce,
    )
    return info, struck


def check_group(
    info: pb.GroupInfo,
    *,
    me: pb.MemberDeclaration,
    swarm_id: str,
    cap_multiple: float,
    admission: Gate | None = None,
    max_clients_taken: int = 2,
) -> Group:
    """Check everything about a group a leader sent us; Rejection with the reason if wrong.

    The group must contain our own declaration unchanged, every declaration must be signed
    by its member for this round and vector (and, in a private swarm, show a membership
    certificate for its key), no member twice, every weight a finite positive number, and
    the parts and the group id must be what we compute ourselves. Weights above
    ``cap_multiple`` times the lower median count as that (:attr:`Group.weights`). The
    leader may make at most ``max_clients_taken`` serving members clients (its strangers:
    ``MatchmakingConfig.max_strangers``).
    """
    round, numel, block_size = me.round, me.numel, me.block_size
    if info.round != round:
        raise Rejection("stale-round", f"group is for round {info.round}, not {round}")
    members = [
        check_declaration(
            d,
            swarm_id=swarm_id,
            round=round,
            numel=numel,
            block_size=block_size,
            admission=admission,
        )
        for d in info.members
    ]
    ids = [m.peer_id for m in members]
    if len(set(ids)) != len(ids):
        raise Rejection("bad-group", "a member appears twice in the group")
    if not any(d.SerializeToString() == me.SerializeToString() for d in info.members):
        raise Rejection("bad-group", "our own declaration is not in the group (or was changed)")
    violations = weight_violations([m.weight for m in members])
    if violations:
        raise Rejection("bad-weight", f"the group admits a bad weight: {violations}")
    declared = [m.bandwidth if m.serving else 0.0 for m in members]
    bandwidths = _part_bandwidths(declared)
    if sum(bandwidths) <= 0:
        raise Rejection("bad-group", "no member of the group serves a part")
    blocks = num_blocks(numel, block_size)
    sent = list(zip(info.part_first_block, info.part_blocks, strict=False))
    parts = part_blocks(blocks, bandwidths)
    if sent != parts and len(sent) == len(members):
        # The leader may take members as clients (its strangers): their parts are empty,
        # the rest cut by the others' bandwidths (capped among them); they then serve
        # nothing, here as there.
        served = _part_bandwidths([b if sent[i][1] > 0 else 0.0 for i, b in enumerate(declared)])
        taken = sum(1 for b, s in zip(declared, served, strict=True) if b > 0 and s <= 0)
        if taken <= max_clients_taken and sum(served) > 0 and part_blocks(blocks, served) == sent:
            parts = sent
            members = [
                m if served[i] > 0 or not m.serving else dataclasses.replace(m, bandwidth=0.0)
                for i, m in enumerate(members)
            ]
    if sent != parts or len(info.part_first_block) != len(info.part_blocks):
        raise Rejection("bad-group", "the part boundaries are not proportional to bandwidth")
    if len(info.nonce) != NONCE_BYTES or info.group_id != _group_id(
        round, info.members, parts, info.nonce
    ):
        raise Rejection("bad-group", "the group id does not match the group")
    return Group(
        group_id=bytes(info.group_id),
        round=round,
        members=tuple(members),
        parts=tuple(parts),
        numel=numel,
        block_size=block_size,
        cap_multiple=cap_multiple,
    )


def single_group(me: pb.MemberDeclaration, nonce: bytes) -> pb.GroupInfo:
    """The group of one (a leader nobody joined, or a client-mode peer nobody serves)."""
    info, _ = build_group(
        [me],
        round=me.round,
        numel=me.numel,
        block_size=me.block_size,
        nonce=nonce,
    )
    assert info is not None, "a peer always forms a group of one"
    return info
