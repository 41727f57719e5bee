"""A swarm's records in the DHT: its manifest and its list of peers.

- :func:`publish_manifest` / :func:`fetch_manifest`: the manifest is stored under
  ``swarmloco/v1/<swarm id>/manifest``; every node and every reader checks that its bytes
  hash to the swarm id, so a peer can only ever get the run it asked for.
- :func:`creator_peer_id`: the peer id of the run's creator, whom the swarm id vouches for.
- :func:`announce_peer` / :func:`find_peers`: each peer keeps one signed entry under
  ``swarmloco/v1/<swarm id>/peers`` (endpoint, role, version, public flag);
  :func:`withdraw_peer` replaces it with a farewell (role ``left``) when the peer leaves.
"""

from __future__ import annotations

import dataclasses
import random

from swarmloco import __version__
from swarmloco.core.manifest import SwarmManifest, check_swarm_id
from swarmloco.errors import ManifestError, NetworkError
from swarmloco.net.dht.node import DHTNode
from swarmloco.net.identity import peer_id_of
from swarmloco.net.records import manifest_key, peers_key

MANIFEST_TTL_S = 7 * 24 * 3600.0
PEER_TTL_S = 300.0


def creator_peer_id(manifest: SwarmManifest) -> str:
    """The peer id (hex) of the run's creator ("" when the manifest names none): the swarm
    id hashes the manifest, so whoever was given the id was given this key too."""
    return peer_id_of(bytes.fromhex(manifest.creator)).hex() if manifest.creator else ""


async def publish_manifest(
    dht: DHTNode, manifest: SwarmManifest, *, ttl: float = MANIFEST_TTL_S
) -> int:
    """Store the manifest on the nodes closest to its key; return how many stored it."""
    stored = await dht.store(manifest_key(manifest.swarm_id), manifest.to_bytes(), ttl=ttl)
    if stored == 0:
        raise NetworkError(
            f"no DHT node stored the manifest of swarm {manifest.swarm_id}; is the network "
            "reachable (see the log for refusals)?"
        )
    return stored


async def fetch_manifest(dht: DHTNode, swarm_id: str) -> SwarmManifest:
    """The manifest of ``swarm_id``, verified against it.

    Raises ManifestError saying whether the id is unknown to the network or what was
    served instead hashes to another id.
    """
    swarm_id = check_swarm_id(swarm_id)
    result = await dht.get(manifest_key(swarm_id))
    entry = result.entries.get("")
    if entry is None:
        mismatched = [r for r in result.rejected if r.code == "manifest-mismatch"]
        if mismatched:
            raise ManifestError(
                f"{mismatched[0].reason} (served by {mismatched[0].peer}); refusing it"
            )
        raise ManifestError(
            f"swarm {swarm_id} is unknown to this network: none of the {result.responded} DHT "
            "nodes asked has its manifest. Check the id, and that --peer belongs to the "
            "network where the swarm was created."
        )
    return SwarmManifest.from_bytes(entry.value, expected_id=swarm_id)


@dataclasses.dataclass(frozen=True)
class PeerEntry:
    """One peer of a swarm as it announced itself."""

    peer_id: str
    endpoint: str
    role: str
    version: str
    public: bool
    expiration: float


async def announce_peer(dht: DHTNode, swarm_id: str, *, role: str, ttl: float = PEER_TTL_S) -> int:
    """Publish this peer's entry in the swarm's peer list (re-announce before ``ttl``)."""
    value = {
        "endpoint": dht.endpoint,
        "role": role,
        "version": __version__,
        "public": bool(dht.endpoint),
    }
    return await dht.store(peers_key(swarm_id), value, ttl=ttl)


async def find_peers(dht: DHTNode, swarm_id: str) -> list[PeerEntry]:
    """The live peers of ``swarm_id``, in random order: a record's expiration is its
    owner's choice (a stranger may set the longest a node keeps, honest peers
    ``PEER_TTL_S``), so it never ranks peers; callers rank them on what they saw
    themselves."""
    result = await dht.get(peers_key(swarm_id))
    peers = [
        PeerEntry(
            peer_id=entry.subkey,
            endpoint=entry.value["endpoint"],
            role=entry.value["role"],
            version=entry.value["version"],
            public=entry.value["public"],
            expiration=entry.expiration,
        )
        for entry in result.entries.values()
        if entry.value["role"] != "left"
    ]
    random.shuffle(peers)
    return peers


async def withdraw_peer(dht: DHTNode, swarm_id: str, *, ttl: float = PEER_TTL_S) -> int:
    """Replace this peer's entry with a farewell (role ``left``, which :func:`find_peers`
    leaves out): stored later than any announcement, it wins on every node that stores it
    (a later expiration replaces an earlier one), until the peer announces itself again."""
    return await announce_peer(dht, swarm_id, role="left", ttl=ttl)
