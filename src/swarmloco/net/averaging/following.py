"""The follower's side of matchmaking: the calls a peer makes to the leaders it may follow,
and the checks of their answers.

Candidates are reached in parallel before anyone is asked to lead: a listener that never
answers its TLS handshake costs ``first_contact_s`` once, not a call timeout each. A
leader answers a ``Join`` once its gathering window closes; twice that window is as long as
an honest leader can take, whatever the round deadline. An answer longer than any honest
one is refused before it is used.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from swarmloco.net.averaging.candidates import Candidate
from swarmloco.net.averaging.faults import FaultCut, FaultPlan
from swarmloco.net.averaging.wire import SERVICE_NAME
from swarmloco.net.client import Method, RpcClient, RpcError
from swarmloco.net.deadline import Deadline
from swarmloco.net.endpoints import MAX_ENDPOINT_CHARS, parse_endpoint
from swarmloco.net.rejections import MAX_CODE_CHARS, MAX_REASON_CHARS, Rejection, RejectionLog
from swarmloco.proto.v1 import averaging_pb2 as pb

if TYPE_CHECKING:
    from swarmloco.net.averaging.matchmaking import MatchmakingConfig

# Matchmaking's events: one logger for all of it.
logger = logging.getLogger("swarmloco.net.averaging.matchmaking")

JOIN = Method(f"/{SERVICE_NAME}/Join", pb.JoinRequest, pb.JoinResponse)
PROBED = 8  # leader candidates whose TLS handshake is tried at once


class Leaders:
    """The calls of one peer to the leaders it may follow."""

    def __init__(
        self,
        *,
        client: RpcClient,
        rejections: RejectionLog,
        faults: FaultPlan | None,
        config: MatchmakingConfig,
    ) -> None:
        self._client = client
        self._rejections = rejections
        self._faults = faults
        self._first_contact_s = config.first_contact_s
        self._gather_s = config.gather_s

    async def unreachable(self, candidates: Sequence[Candidate], deadline: Deadline) -> set[str]:
        """The endpoints among the first few ``candidates`` that do not answer a TLS
        handshake within ``first_contact_s``, all tried at once. (Endpoints reached before
        answer at once.)"""
        batch = candidates[:PROBED]
        if not batch:
            return set()
        wait = Deadline.after(min(self._first_contact_s, max(deadline.remaining(), 0.0)))

        async def reach(endpoint: str) -> str | None:
            try:
                await self._client.open(endpoint, wait)
            except RpcError as exc:
                logger.info("leader candidate %s is out of reach: %s", endpoint, exc)
                return endpoint
            return None

        gone = await asyncio.gather(*(reach(c.endpoint) for c in batch))
        return {endpoint for endpoint in gone if endpoint is not None}

    async def join(
        self, endpoint: str, me: pb.MemberDeclaration, deadline: Deadline
    ) -> pb.JoinResponse | None:
        """Ask the leader at ``endpoint`` for the group; None if it cannot be reached or
        its answer is refused."""
        request = pb.JoinRequest(member=me)
        wait = Deadline.after(min(deadline.remaining(), 2 * self._gather_s))
        try:
            if self._faults is not None:
                data = await self._faults.outgoing(
                    "join", peer=endpoint, round=me.round, message=request.SerializeToString()
                )
                if data is None:  # dropped: the leader never hears of us, we never hear back
                    await asyncio.sleep(wait.remaining())
                    return None
            response = await self._client.call(endpoint, JOIN, request, timeout=wait, attempts=2)
        except (RpcError, FaultCut) as exc:
            logger.info("round %d: leader %s did not answer: %s", me.round, endpoint, exc)
            return None
        try:
            check_answer(response)
        except Rejection as rejection:
            self._rejections.record(rejection, endpoint)
            return None
        return response


def check_answer(response: pb.JoinResponse) -> None:
    """Refuse a leader's answer whose strings are longer than any honest one: a redirect
    is followed and handed to others, a refusal's reason ends up in our logs and errors.
    (A group's declarations are checked by ``check_group``.)"""
    outcome = response.WhichOneof("outcome")
    if outcome == "redirect":
        # Sizes before contents: reading a string field copies it, however long.
        if response.ByteSize() > 4 * MAX_ENDPOINT_CHARS + 8:
            raise Rejection("malformed", "the leader redirects to more than an endpoint")
        try:
            parse_endpoint(response.redirect)
        except ValueError:
            raise Rejection(
                "malformed", f"the leader redirects to {response.redirect[:80]!r}, not HOST:PORT"
            ) from None
    elif outcome == "refused" and (
        response.refused.ByteSize() > 4 * (MAX_CODE_CHARS + MAX_REASON_CHARS) + 16
        or len(response.refused.code) > MAX_CODE_CHARS
        or len(response.refused.reason) > MAX_REASON_CHARS
    ):
        raise Rejection(
            "malformed",
            f"the leader's refusal ({response.refused.ByteSize()} bytes) is longer than a "
            f"code of {MAX_CODE_CHARS} and a reason of {MAX_REASON_CHARS} characters",
        )
