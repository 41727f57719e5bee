"""A DHT node's settings (:class:`DhtConfig`) and the message size a DHT-only node takes.

Every part of the node (lookups, contacts, replication, the request handlers) reads its
limits from one :class:`DhtConfig`; it lives apart from the node so that those parts need
not import the node to know them.
"""

from __future__ import annotations

import dataclasses

from swarmloco.core.config import require, require_int, require_positive
from swarmloco.net.dht.storage import StorageConfig

DHT_MESSAGE_BYTES = 1024 * 1024
"""The largest message a node that serves only the DHT (a bootstrap node) receives: a store
request of :attr:`DhtConfig.max_request_bytes` with its framing fits. A training peer's
server takes larger ones (averaging chunks); a DHT-only node has no use for them, and every
byte of a large message is held in memory before it can be refused."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DhtConfig:
    k: int = 20
    """Bucket size and replication factor: records live on the k closest nodes."""
    alpha: int = 3
    """Queries in flight per lookup."""
    get_quorum: int = 2
    """A get may stop once it has records and this many of the closest nodes, one per
    network, answered. Records live on the k closest nodes and newcomers are handed theirs
    on arrival, so the closest two hold every subkey unless both lost a store; 3 costs one
    more tail wait."""
    max_per_subnet: int = 2
    """Contacts per bucket from one /24 (IPv4) or /64 (IPv6), and nodes of one such network
    among the k closest that a lookup keeps, asks and stores to."""
    limit_private_subnets: bool = False
    """Count loopback and private addresses by subnet as public ones are (simulations), in
    the routing table's subnet cap and in storage's quotas per source network. Otherwise
    the routing cap exempts them and storage counts each such address by itself."""
    rpc_timeout_s: float = 2.0
    """Longest wait for one DHT call."""
    lookup_timeout_s: float = 8.0
    """Longest one store or get may take, all its calls included."""
    join_timeout_s: float = 5.0
    """Longest wait for the initial peers to answer."""
    join_grace_s: float = 0.5
    """Once one initial peer answered, how much longer the others get to answer too."""
    refresh_interval_s: float = 600.0
    """A bucket without a lookup for this long is refreshed with a lookup into it."""
    republish_interval_s: float = 600.0
    """How often a node re-stores its own records (they reach nodes that joined since)."""
    liveness_interval_s: float = 120.0
    """Contacts not heard from for this long are pinged and dropped if they fail."""
    unreachable_s: float = 30.0
    """A contact whose call failed is not asked again in lookups for this long when other
    nodes name it (they may not have noticed yet: a frozen or partitioned peer would cost
    every lookup a call timeout); it counts again at once when it calls us or answers."""
    sweep_interval_s: float = 60.0
    """How often expired records are dropped from storage."""
    rejoin_interval_s: float = 5.0
    """A node whose routing table ran empty (every contact failed, e.g. after the process
    was frozen) joins again through the peers it first joined through, this often."""
    max_records_per_request: int = 64
    """Most records in one store request."""
    max_request_bytes: int = 512 * 1024
    """Most bytes of records (``Record.size``) this node puts in one store request it
    sends (a record larger than this goes alone): DHT-only nodes such as a bootstrap node
    receive messages of at most :data:`DHT_MESSAGE_BYTES`."""
    checked_records_bytes: int = 8 * 1024 * 1024
    """Records read from other nodes that a node remembers as checked, in bytes of memory
    (``held_bytes``): a full ``peers`` key (4,096 records, about 5 MiB) read again costs
    lookups, not signature checks."""
    max_clock_skew_s: float = 600.0
    """Store requests dated further from our clock are refused (replays); a node whose
    clock is further off the peers it joins through refuses to start."""
    warn_clock_skew_s: float = 5.0
    """A clock further off the entry peers' than this is warned about (the node keeps the
    swarm's time anyway: :meth:`DHTNode.clock`)."""
    clock_sample: int = 8
    """Peers a joining node asks the time of once its routing table is filled, besides the
    entry peers: one per source network no entry peer is on. The node keeps the median of
    one vote per network, so that entry peers whose clocks are off (or who lie about them)
    are outvoted (0: keep the entry peers' time)."""
    storage: StorageConfig = dataclasses.field(default_factory=StorageConfig)

    def __post_init__(self) -> None:
        require_int("k", self.k, minimum=1)
        require_int("alpha", self.alpha, minimum=1)
        require_int("get_quorum", self.get_quorum, minimum=1)
        require(self.get_quorum <= self.k, "get_quorum must be <= k")
        require_int("max_per_subnet", self.max_per_subnet, minimum=1)
        require_int("max_records_per_request", self.max_records_per_request, minimum=1)
        require_int("max_request_bytes", self.max_request_bytes, minimum=1)
        require_int("checked_records_bytes", self.checked_records_bytes, minimum=0)
        require_int("clock_sample", self.clock_sample, minimum=0)
        for name in (
            "rpc_timeout_s",
            "lookup_timeout_s",
            "join_timeout_s",
            "join_grace_s",
            "refresh_interval_s",
            "republish_interval_s",
            "liveness_interval_s",
            "unreachable_s",
            "sweep_interval_s",
            "rejoin_interval_s",
            "max_clock_skew_s",
            "warn_clock_skew_s",
        ):
            require_positive(name, getattr(self, name))
