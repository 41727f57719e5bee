"""The parts of one entered peer that its collaborators share (:class:`PeerParts`).

``Swarm`` builds them on enter, in order (the manifest, the DiLoCo state, the checkpoints,
the network), and hands them to the collaborators that do the swarm's work between two
steps: the pacer (``runtime/pacer.py``), the round driver (``runtime/rounds.py``) and the
follower that keeps the peer's state the swarm's (``runtime/follow.py``). Each part owns
its own state; this is only how they reach each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from swarmloco.core.adoption import Evidence
from swarmloco.core.runspec import RunSpec
from swarmloco.dataset.ledger import Landed
from swarmloco.runtime.box import Box, BoxParams
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.keeper import CheckpointKeeper
from swarmloco.runtime.loop_thread import LoopThread
from swarmloco.runtime.network import SwarmNetwork
from swarmloco.runtime.progress import LocalProgress
from swarmloco.runtime.snapshots import Snapshots
from swarmloco.runtime.status import StatusSheet
from swarmloco.runtime.trial import Trial
from swarmloco.train.diloco import DilocoState

DeclaredRange = tuple[int, int, int, int]
"""``(epoch, shard, first, count)``: sequences of a pinned dataset (``dataset/ledger.py``)."""


class RangeKeeper(Protocol):
    """What a peer's data reader is told of the rounds, so that every sequence of a
    pinned dataset lands once (``dataset/leases.py``'s :class:`LeasedData`)."""

    def declare(self, round: int, fragment: int) -> list[DeclaredRange]:
        """The ranges this round's update completes (its declaration carries them)."""

    def landed(
        self,
        round: int,
        declared: Mapping[str, Sequence[DeclaredRange]],
        included: Mapping[str, bool],
        me: str,
    ) -> None:
        """The round was applied: what each member declared, whether it counted whole."""

    def failed(self, round: int) -> None:
        """The round failed: nothing changes."""

    def discard(self) -> None:
        """The local work was thrown away: what it read is read again."""

    def adopted(self, landed: Landed) -> None:
        """This peer took another state (downloaded, or its own after a roll-back), in
        which ``landed`` landed."""

    def restored(self, landed: Landed) -> None:
        """The state this peer starts from (its checkpoint's, or its first taken) holds
        ``landed``."""

    def pending(self) -> bool:
        """Whether ranges were read (before a restart) that have not landed."""

    def unsure(self) -> bool:
        """Whether the leases lapsed and nobody looked yet whether another took them (no
        round starts meanwhile)."""

    def lapsed(self) -> bool:
        """Whether another peer took shards this one read while its leases lapsed (the
        local work must be thrown away before any round)."""

    def forget_lapsed(self) -> int:
        """(After the local work was thrown away.) Forget what was read of those shards."""

    async def run(self, dht: Any, swarm_id: str, peer_id: str) -> None:
        """Keep the reader's leases (on the peer's loop) until closed."""

    async def close(self) -> None:
        """Stop keeping them (and release them)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerParts:
    config: PeerConfig
    spec: RunSpec
    peer_id: str
    loop: LoopThread
    """The peer's event loop, which every network call goes through."""
    network: SwarmNetwork
    diloco: DilocoState
    """The global state (``theta_g``, momentum, tokens) and the deltas of the fragments."""
    params: BoxParams
    """The model's parameters (in a box, every rank's), read and written through views."""
    snapshots: Snapshots
    """The committed global state this peer serves, and its digest."""
    progress: LocalProgress
    evidence: Evidence
    """What this peer observed itself (its partners, its outer steps): never replaced."""
    trial: Trial
    keeper: CheckpointKeeper
    sheet: StatusSheet
    """What the dashboard shows: also the peer's state ("training", ...) and last error."""
    box: Box | None
    emit: Callable[..., None]
    """``emit(event, **fields)``: one event for the user's sink (the daemon's log)."""
    ranges: RangeKeeper | None = None
    """On a pinned dataset with leases: the reader told what became of its ranges."""

    @property
    def h(self) -> float:
        """Inner steps between two rounds of one fragment: ``H / F``."""
        return self.spec.steps_per_round

    def now(self) -> float:
        """The swarm's time (this machine's clock corrected to the peers' it joined
        through): what progress reports and records are dated and judged by."""
        return self.network.node.dht.clock()

    def wake(self) -> None:
        """Have the network publish and read the records now (from any thread)."""
        self.loop.loop.call_soon_threadsafe(self.network.wake)
