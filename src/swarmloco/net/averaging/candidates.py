"""Whom a peer asks to lead it in a round, and whether the round's group formed without it:
plain functions of the round's DHT entries (no I/O).

The order of leadership is a hash nobody chooses (:func:`leader_rank`). A peer with
partners follows only partners ahead of it in that order. A peer without partners (a
newcomer) follows the peers ahead of it, and, first, leaders with partners that say they
are gathering now (``formed: 1``) wherever they stand in the order: peers with partners
never follow a stranger, so a newcomer first in the order would otherwise lead, and
average, alone. A client-mode peer, which cannot lead, may follow any serving peer.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection, Iterable, Mapping

from swarmloco.net.dht.node import Entry


@dataclasses.dataclass(frozen=True)
class Candidate:
    rank: bytes
    peer_id: str
    endpoint: str
    gathering: bool = False
    """Its leader says it gathers its group now (and has partners)."""


def leader_rank(swarm_id: str, round: int, peer_id: str) -> bytes:
    """Where ``peer_id`` stands in the order of leadership of ``round`` (lowest leads).

    A hash nobody chooses: a peer cannot move itself ahead by what it announces, and each
    round draws a new order, so one peer leads about one round in as many as there are
    peers ready for it.
    """
    payload = f"{swarm_id}\x00{round}\x00{peer_id}".encode()
    return hashlib.blake2b(payload, digest_size=16, person=b"swarmloco-leader").digest()


def formed_marked(
    entries: Iterable[Entry],
    *,
    mine: str,
    numel: int,
    ours: Collection[str],
    partners: Collection[str],
) -> bool:
    """Whether a peer outside our own group (``ours``) marks its entry ``formed`` (once
    this peer has partners, only a partner's mark counts: a stranger's would make it wait
    for a result that never comes)."""
    return any(
        e.value.get("formed", 0) > 1 and e.value["numel"] == numel
        for e in entries
        if e.subkey != mine and e.subkey not in ours and (not partners or e.subkey in partners)
    )


def servers(
    entries: Iterable[Entry], *, mine: str, numel: int, partners: Collection[str]
) -> list[Entry]:
    """The entries of serving peers (ours excepted) with our vector size that may lead us."""
    return [
        e
        for e in entries
        if e.subkey != mine
        and not e.value["client_mode"]
        and e.value["endpoint"]
        and e.value["numel"] == numel
        and (not partners or e.subkey in partners)  # a stranger never leads a partner
    ]


def leader_candidates(
    entries: Iterable[Entry],
    *,
    swarm_id: str,
    round: int,
    mine: str,
    serving: bool,
    partners: Collection[str],
    lonely: bool,
    records: Mapping[str, str] | None,
) -> list[Candidate]:
    """The peers of ``entries`` (see :func:`servers`) this peer may follow, in the order it
    asks them. ``lonely``: it led this round before and gathered too few, so it follows
    any peer now; ``records``: the endpoints of the swarm's peer list, when only peers
    announced there (at that endpoint) may lead."""
    own = leader_rank(swarm_id, round, mine)
    found = []
    for entry in entries:
        if records is not None and records.get(entry.subkey) != entry.value["endpoint"]:
            continue  # not announced in the swarm's peer list (at that endpoint)
        rank = leader_rank(swarm_id, round, entry.subkey)
        gathering = entry.value.get("formed") == 1
        ahead = rank < own or not serving
        follow_any = not partners and (gathering or lonely)
        if ahead or follow_any:
            found.append(Candidate(rank, entry.subkey, entry.value["endpoint"], gathering))
    # Gathering leaders first (a newcomer's), then the order of leadership.
    found.sort(key=lambda c: (not (c.gathering and not partners), c.rank))
    return found
