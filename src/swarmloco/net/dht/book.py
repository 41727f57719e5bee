"""Who a DHT node knows: contact cards checked on arrival, the routing table kept up to date
by every answer and every failure, and the contacts lookups skip for a while after a call
to them failed.

Every call to a known contact goes through :meth:`ContactBook.call`, so that its outcome
always reaches the table: an answer from the node the card names refreshes it, a failure
or an answer from someone else drops it. The book sends nothing by itself; the caller
hands it the transport's method to use.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from google.protobuf.message import Message

from swarmloco.errors import NetworkError
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.config import DhtConfig
from swarmloco.net.dht.contact import Contact, contact_from_proto
from swarmloco.net.dht.routing import Added, RoutingTable
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.proto.v1 import dht_pb2 as pb

logger = logging.getLogger(__name__)

Resp = TypeVar("Resp", bound=Message)
ContactCallback = Callable[[Contact], None]
MAX_UNREACHABLE = 4096  # contacts remembered as unreachable (beyond: not remembered)
OWN_STALL_S = 1.0  # a failed call this late past its deadline: our own stall, not theirs


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContactHooks:
    """Who hears about contacts: ``added`` and ``removed`` follow the routing table,
    ``card`` sees every verified card but ours (e.g. to learn the TLS keys of addresses),
    ``newcomer`` each contact new to the table that proved itself by answering or calling."""

    added: ContactCallback | None = None
    removed: ContactCallback | None = None
    card: ContactCallback | None = None
    newcomer: ContactCallback | None = None


class ContactBook:
    """The contacts of one node and what their calls taught it."""

    def __init__(
        self,
        *,
        routing: RoutingTable,
        config: DhtConfig,
        rejections: RejectionLog,
        stats: Counter[str],
        hooks: ContactHooks,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.routing = routing
        self._config = config
        self._rejections = rejections
        self._stats = stats
        self._hooks = hooks
        self._monotonic = monotonic
        self._unreachable: dict[bytes, float] = {}  # peer id -> until when lookups skip it

    def unreachable(self, peer_id: bytes) -> bool:
        """Whether a call to this contact failed within ``unreachable_s`` (and it has not
        been heard from since)."""
        until = self._unreachable.get(peer_id)
        if until is None:
            return False
        if until > self._monotonic():
            return True
        del self._unreachable[peer_id]
        return False

    def card_from(self, info: pb.PeerInfo, *, source: Contact | None) -> Contact | None:
        """The checked card in ``info`` (None, the refusal logged, when it is not valid)."""
        try:
            contact = contact_from_proto(info)
        except Rejection as rejection:
            self._rejections.record(rejection, str(source) if source else "a peer")
            return None
        self.card_seen(contact)
        return contact

    def card_seen(self, contact: Contact) -> None:
        if self._hooks.card is not None and contact.peer_id != self.routing.local_id:
            self._hooks.card(contact)

    def seen(self, contact: Contact) -> None:
        """``contact`` answered or called us from where its card says: it is alive."""
        self._unreachable.pop(contact.peer_id, None)
        added = self.routing.add(contact, now=self._monotonic())
        if added is not Added.NEW:
            return
        if self._hooks.added is not None:
            self._hooks.added(contact)
        if self._hooks.newcomer is not None:
            self._hooks.newcomer(contact)

    def failed(self, contact: Contact, why: str, *, blame: bool = True) -> None:
        """Drop a contact whose call failed; with ``blame``, lookups also skip it for
        ``unreachable_s`` when other nodes name it."""
        self._stats["failed_calls"] += 1
        now = self._monotonic()
        if blame:
            if len(self._unreachable) >= MAX_UNREACHABLE:
                self._unreachable = {i: t for i, t in self._unreachable.items() if t > now}
            if len(self._unreachable) < MAX_UNREACHABLE:
                self._unreachable[contact.peer_id] = now + self._config.unreachable_s
        removed, promoted = self.routing.remove(contact.peer_id, now=now)
        if removed is not None:
            logger.debug("dropped contact %s: %s", removed, why)
            if self._hooks.removed is not None:
                self._hooks.removed(removed)
        if promoted is not None and self._hooks.added is not None:
            self._hooks.added(promoted)

    async def call(
        self,
        contact: Contact,
        send: Callable[[str, Any, Deadline], Awaitable[Resp]],
        request: Message,
        deadline: Deadline,
    ) -> Resp | None:
        """One call to a known contact; None (and the contact dropped) when it fails."""
        call_deadline = Deadline.after(deadline.timeout(self._config.rpc_timeout_s))
        self._stats["calls"] += 1
        try:
            response = await send(contact.endpoint, request, call_deadline)
        except NetworkError as exc:
            # A call that ends well past its deadline did not wait for the contact: this
            # process was stalled or frozen, and the contact may be fine.
            ours = time.monotonic() - call_deadline.at > OWN_STALL_S
            self.failed(contact, str(exc), blame=not ours)
            return None
        answered_as = self.card_from(response.peer, source=contact)  # type: ignore[attr-defined]
        if answered_as is None or answered_as.peer_id != contact.peer_id:
            self.failed(contact, "another node answers at its endpoint")
            return None
        self.seen(answered_as)
        return response
