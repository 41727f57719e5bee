"""The reducer side of a round: the parts this member reduces, one
:class:`~.reduction.PartReduction` each, and what it has sent out of them.

A member reduces its own part from the start and, after a failure, the parts its view
moved to it (a backup reducer, at a later epoch). Its own contribution goes into each
reduction as the first sender's. Every message a reduction produced (a rerun notice, the
result chunks) is kept in the part's backlog: a member whose stream to us opens late is
sent the backlog first, so no member misses a result because it connected after it was
made. No I/O: the caller sends what :meth:`Reductions.finish_next` returns.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from swarmloco.errors import RoundAborted
from swarmloco.net.averaging import wire
from swarmloco.net.averaging.audit import (
    norms_match,
    root_of,
    segment_hashes,
    segment_norms,
    stated,
)
from swarmloco.net.averaging.contribution import Contribution
from swarmloco.net.averaging.faults import Phase
from swarmloco.net.averaging.group import Group
from swarmloco.net.averaging.output import decode_chunk
from swarmloco.net.averaging.reduction import PartReduction
from swarmloco.net.averaging.view import RoundView
from swarmloco.net.identity import verify
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

if TYPE_CHECKING:
    from swarmloco.net.averaging.allreduce import AveragingConfig

# The round's events are the all-reduce's: one logger for the whole round.
logger = logging.getLogger("swarmloco.net.averaging.allreduce")


@dataclasses.dataclass(frozen=True)
class Finished:
    """One averaged chunk of a part we reduce, as it goes out to every member."""

    part: int
    epoch: int
    index: int
    payload: torch.Tensor
    scales: torch.Tensor
    contributors: bytes
    message: bytes


class Reductions:
    """The reductions this member runs in one round, by part (see the module docstring)."""

    def __init__(
        self,
        *,
        group: Group,
        view: RoundView,
        me: int,
        config: AveragingConfig,
        contribution: Contribution,
        clock: Callable[[], float],
        take: Callable[[int], torch.Tensor],
        sign: Callable[[bytes, bytes], bytes],
    ) -> None:
        """``take(numel)`` lends a float32 scratch buffer for the round; ``sign(domain,
        payload)`` signs as this member (the statements of its own chunks)."""
        self._group = group
        self._sign = sign
        self._view = view
        self._me = me
        self._config = config
        self._contribution = contribution
        self._clock = clock
        self._take = take
        self.active: dict[int, PartReduction] = {}
        self._backlog: dict[int, list[tuple[Phase, bytes]]] = {}
        self._statements: dict[int, list[pb.Statement]] = {}
        """Per part we reduce: the statement of every chunk we counted, ours included."""

    def start(self, part: int, epoch: int, senders: Sequence[int]) -> bytes | None:
        """Reduce ``part`` at ``epoch`` from ``senders``, ours fed in at once; the rerun
        notice to send every member when we take it over from a failed one. Raises
        RoundAborted when our own update cannot be averaged."""
        cfg = self._config
        reduction = PartReduction(
            part=part,
            epoch=epoch,
            spans=self._view.spans[part],
            weights=self._group.weights,
            senders=senders,
            codec=cfg.codec,
            aggregator=cfg.aggregator,
            timeout=cfg.sender_timeout_s,
            now=self._clock(),
            norm_bound=self._contribution.norm_bound,
            take=self._take,
        )
        self.active[part] = reduction
        self._backlog[part] = []
        self._statements[part] = []
        notice = None
        if epoch > 0:
            logger.info(
                "round %d: reducing part %d (epoch %d) for failed member %s",
                self._group.round,
                part,
                epoch,
                self._group.members[part].peer_id[:12],
            )
            notice = wire.response(rerun=pb.Rerun(part=part, epoch=epoch))
            self._backlog[part].append(("rerun", notice))
        for index in range(reduction.chunks):
            payload, scales = self._contribution.slice_of(part, index)
            hashed = self._contribution.chunk_hashes(part, index)
            try:
                reduction.accept(
                    self._me,
                    index,
                    payload,
                    scales,
                    self._clock(),
                    remote=False,
                    norm_sq=hashed.norm_sq if math.isfinite(hashed.norm_sq) else None,
                )
            except Rejection as rejection:  # what the others would refuse from us
                raise RoundAborted(
                    f"round {self._group.round}: this peer's own update cannot be averaged: "
                    f"{rejection.reason}"
                ) from None
            signature = self._sign(
                wire.STATEMENT_DOMAIN,
                self._statement_payload(part, epoch, self._me, index, hashed.root, hashed.norms),
            )
            self._statements[part].append(
                pb.Statement(
                    sender=self._me,
                    index=index,
                    root=hashed.root,
                    norms=wire.packed_norms(hashed.norms),
                    signature=signature,
                )
            )
        return notice

    def _statement_payload(
        self, part: int, epoch: int, sender: int, index: int, root: bytes, norms: Sequence[float]
    ) -> bytes:
        return stated(
            self._group,
            self._me,
            part,
            epoch,
            sender=sender,
            index=index,
            root=root,
            norms=norms,
        )

    def accept(self, sender: int, chunk: wire.ChunkMessage) -> None:
        """A remote sender's chunk of a part we reduce; Rejection if it must be struck."""
        reduction = self.active[chunk.part]
        if chunk.index >= reduction.chunks:
            raise Rejection(
                "bad-index",
                f"part {chunk.part} has {reduction.chunks} chunks, not {chunk.index + 1}",
            )
        numel = reduction.spans[chunk.index].numel
        codec = self._config.codec
        payload, scales = decode_chunk(chunk.payload, chunk.scales, numel, codec)
        root = root_of(
            segment_hashes(
                chunk.payload,
                chunk.scales,
                block_size=codec.block_size,
                scale_bytes=codec.scale_bytes,
            )
        )
        signed_norms = wire.norms_of(chunk.norms)
        signed = self._statement_payload(
            chunk.part, chunk.epoch, sender, chunk.index, root, signed_norms
        )
        if not verify(
            self._group.members[sender].public_key, chunk.signature, wire.STATEMENT_DOMAIN, signed
        ):
            raise Rejection(
                "bad-statement",
                f"chunk {chunk.index} of part {chunk.part} is not the one its sender signed",
            )
        norms = segment_norms(payload, scales, codec.block_size)
        norm_sq = math.fsum(norms)
        if math.isfinite(norm_sq) and (
            len(signed_norms) != len(norms) or not all(map(norms_match, norms, signed_norms))
        ):
            raise Rejection(
                "bad-statement",
                f"chunk {chunk.index} of part {chunk.part} measures {norm_sq:.6g} squared, "
                f"its sender signed {math.fsum(signed_norms):.6g} over "
                f"{len(signed_norms)} segments (not each as measured)",
            )
        measured = norm_sq if math.isfinite(norm_sq) else None
        if reduction.accept(sender, chunk.index, payload, scales, self._clock(), norm_sq=measured):
            self._statements[chunk.part].append(
                pb.Statement(
                    sender=sender,
                    index=chunk.index,
                    root=root,
                    norms=chunk.norms,
                    signature=chunk.signature,
                )
            )

    def statements(self, part: int, epoch: int) -> pb.Statements | None:
        """Our answer to an audit of ``part`` at ``epoch``: every statement we counted
        (None: we do not reduce it at that epoch, or not yet to the end)."""
        reduction = self.active.get(part)
        if reduction is None or reduction.epoch != epoch or not reduction.done:
            return None
        return pb.Statements(part=part, epoch=epoch, statements=self._statements[part])

    def finish_next(self, part: int) -> Finished | None:
        """The next complete chunk of our reduction of ``part`` (None: none is). Raises
        RoundAborted when its mean is not finite: nothing of it may leave this member."""
        reduction = self.active.get(part)
        if reduction is None or not reduction.ready():
            return None
        index, payload, scales, contributors = reduction.finish()
        bits = wire.bitmap(contributors, self._group.size)
        message = wire.encode_result(
            part=part,
            epoch=reduction.epoch,
            index=index,
            payload=payload,
            scales=scales,
            contributors=bits,
        )
        self._backlog[part].append(("result", message))
        return Finished(part, reduction.epoch, index, payload, scales, bits, message)

    def sealed(self, part: int, message: bytes) -> None:
        """The seal of our reduction of ``part``, sent after its last result chunk."""
        self._backlog[part].append(("seal", message))

    def drop(self, part: int, claim_epoch: int, claim_reducer: int) -> None:
        """Our view moved ``part`` to another claim: forget a reduction that is not it."""
        old = self.active.get(part)
        if old is not None and (old.epoch, self._me) != (claim_epoch, claim_reducer):
            del self.active[part]
            self._backlog.pop(part, None)
            self._statements.pop(part, None)

    def expire(self, now: float) -> dict[int, str]:
        """Leave out of every reduction the senders whose chunk is overdue; who and why."""
        left: dict[int, str] = {}
        for reduction in self.active.values():
            for sender in reduction.expire(now):
                left.setdefault(sender, reduction.left[sender])
        return left

    def exclude(self, member: int, reason: str) -> None:
        for reduction in self.active.values():
            reduction.exclude(member, reason)

    def waiting_on(self, member: int) -> bool:
        """Whether a reduction still expects chunks from ``member``."""
        return any(member in r.live and not r.done for r in self.active.values())

    def backlog(self) -> Iterator[tuple[Phase, bytes]]:
        """Every message sent so far, in order per part: for a stream that opens late."""
        for part in self.active:
            yield from self._backlog.get(part, [])
