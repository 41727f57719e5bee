"""The private swarms a DHT node guards: which records it may use and store, and the
membership its own records carry.

A node that admits a swarm's :class:`~swarmloco.net.admission.Gate` drops, and does not
store, owned records of that swarm whose owner shows no valid credential in the value's
``member`` field; a node that admits none (a bootstrap node) stores every valid record in
good faith. The decisions are plain functions of the record and the gates: no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swarmloco.net.records import MEMBER_FIELD, Record, kind_of
from swarmloco.net.rejections import Rejection

if TYPE_CHECKING:
    from swarmloco.net.admission import Gate


class SwarmGates:
    """The gates of the swarms a node guards, by swarm id."""

    def __init__(self) -> None:
        self._gates: dict[str, Gate] = {}

    def __bool__(self) -> bool:
        return bool(self._gates)

    def admit(self, admission: Gate) -> None:
        """Guard ``admission``'s swarm from now on (a later gate of it replaces this one)."""
        self._gates[admission.swarm_id] = admission

    def guards(self, swarm_id: str) -> bool:
        return swarm_id in self._gates

    def refusal(self, record: Record, value: Any, *, network: str = "") -> Rejection | None:
        """Why a valid record must be ignored here (None: it may be used); ``network`` is
        the source network it came from ("": not known), whose share of the checks a proof
        of work not seen before costs. Call it on a record whose signature checked."""
        if not self._gates:
            return None
        kind, swarm_id, _ = kind_of(record.key)
        admission = self._gates.get(swarm_id)
        if admission is None or not kind.owned:
            return None
        try:
            admission.check(record.subkey, value.get(MEMBER_FIELD, b""), network=network)
        except Rejection as rejection:
            return Rejection(rejection.code, f"{kind.name} record: {rejection.reason}")
        return None

    def with_membership(self, key: str, value: Any) -> Any:
        """``value`` with our own credential for ``key``'s swarm, where its records need one."""
        if not self._gates or not isinstance(value, dict):
            return value
        try:
            kind, swarm_id, _ = kind_of(key)
        except Rejection:
            return value  # make_record says what is wrong with the key
        admission = self._gates.get(swarm_id)
        if admission is None or not kind.owned or not admission.own_bytes:
            return value
        return {**value, MEMBER_FIELD: admission.own_bytes}
