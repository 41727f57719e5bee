"""The DiLoCo state of one peer: global parameters, outer momentum and fragments.

:class:`DilocoState` owns ``theta_g`` (the committed global parameters, flat fp32 on the
CPU in the layout of the model signature) and the outer Nesterov momentum, one outer
optimizer per Streaming DiLoCo fragment, and the buffers of a round: the pseudo-gradient
``delta = theta_g - theta`` of a fragment, encoded as the wire carries it, and the group's
mean of it, as received (about 1 byte a value each). It does no I/O: the peer
(``runtime/rounds.py``) averages the delta with its group and hands the mean back;
the simulation (``train/simulate.py``) computes the mean in-process. Both therefore run
the same arithmetic and the same fragment schedule: round r syncs fragment ``(r - 1) % F``
(DESIGN section 3).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from swarmloco.core.codec import (
    CodecConfig,
    Encoded,
    ErrorFeedback,
    encoded_slice,
    encoded_zeros,
    quantize,
)
from swarmloco.core.flat import FlatLayout
from swarmloco.core.outer import SLAB_VALUES, OuterConfig, OuterOptimizer
from swarmloco.core.state import LANDED, MOMENTUM, THETA_G, TOKENS, StateSchema, StateSnapshot
from swarmloco.dataset.ledger import Landed, Range
from swarmloco.errors import CodecError


def fragment_of_round(round: int, fragments: int) -> int:
    """The fragment round ``round`` (from 1) syncs."""
    return (round - 1) % fragments


def rounds_of_fragment(round: int, fragment: int, fragments: int) -> int:
    """How many of rounds 1..``round`` synced ``fragment`` (round r syncs (r - 1) % F)."""
    return 0 if round <= fragment else (round - 1 - fragment) // fragments + 1


class DilocoState:
    """``theta_g``, the outer momentum and the per-fragment buffers of one peer."""

    def __init__(self, layout: FlatLayout, outer: OuterConfig, codec: CodecConfig) -> None:
        self.layout = layout
        self.fragments = layout.num_fragments
        self.theta_g = layout.zeros()
        # One flat momentum vector for the state; each fragment's optimizer owns its slice.
        self.momentum = layout.zeros()
        self.outers = [
            OuterOptimizer(b - a, outer, buffer=self.momentum[a:b])
            for a, b in layout.fragment_ranges
        ]
        sizes = [b - a for a, b in layout.fragment_ranges]
        self.codec = codec
        # The round's two buffers stay as the wire has them, about 1 byte a value each
        # (DESIGN section 6, "Host memory"): what this peer sends, what the group sent back.
        self.messages = [encoded_zeros(n, codec) for n in sizes]
        """Each fragment's pseudo-gradient, encoded (:meth:`encode`), as its round sends it."""
        self.means = [encoded_zeros(n, codec) for n in sizes]
        """Each fragment's group mean, as the round received it (:meth:`apply` decodes it)."""
        self.feedback = [ErrorFeedback(n, codec) for n in sizes] if codec.error_feedback else None
        self.round = 0
        """Outer steps applied to ``theta_g``: the state's round."""
        self.fragment_tokens = [0] * self.fragments
        """Tokens each fragment's local copy trained on since that fragment last synced."""
        self.tokens = 0
        """Tokens the swarm trained on: the summed weights of every round's group (part of
        the state, so that every member of a group holds the same count)."""
        self.landed = Landed()
        """The sequences of a pinned dataset that landed in ``theta_g`` (part of the state:
        every member of a group adds the same landings; a state taken brings its own)."""
        self.schema = StateSchema.diloco(layout.numel)
        self.lock = threading.Lock()
        """Held while another thread reads the committed state in place (the state file
        of a round being written: ``runtime/snapshots.py``); whatever changes ``theta_g`` or
        the momentum takes it first, so that no reader sees half a change."""

    # -- local progress ---------------------------------------------------------------------

    def set_global(self, params: Sequence[torch.Tensor]) -> None:
        """``theta_g <- theta`` (a fresh run: the initial weights are round 0's state)."""
        with torch.no_grad(), self.lock:
            self.layout.gather(params, self.theta_g)

    def trained(self, tokens: int) -> None:
        """Every fragment's local copy trained on ``tokens`` more tokens."""
        for f in range(self.fragments):
            self.fragment_tokens[f] += tokens

    def take_global(self, params: Sequence[torch.Tensor]) -> None:
        """``theta <- theta_g``; the local progress since the last round restarts from it."""
        with torch.no_grad():
            self.layout.scatter(self.theta_g, params)
        self.fragment_tokens = [0] * self.fragments

    # -- one round --------------------------------------------------------------------------

    def _delta_slabs(
        self, fragment: int, params: Sequence[torch.Tensor]
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """``theta_g - theta`` of ``fragment`` a slab at a time: (its offset in the
        fragment, the slab; one buffer, overwritten by the next slab). A slab is whole codec
        blocks, so each one quantizes on its own; nothing of the fragment's size is made."""
        first, stop = self.layout.fragment_ranges[fragment]
        numel = stop - first
        # The fragment's parameters, in flat order: they lie end to end, padding after.
        pieces = sorted(
            (
                (slot.start - first, slot.numel, p)
                for slot, p in zip(self.layout.slots, params, strict=True)
                if slot.fragment == fragment
            ),
            key=lambda piece: piece[0],
        )
        block = self.layout.block_size
        size = max(1, SLAB_VALUES // block) * block
        buffer = torch.empty(min(size, numel))
        with torch.no_grad():
            for start in range(0, numel, size):
                end = min(start + size, numel)
                out = buffer[: end - start]
                filled = start
                for at, n, p in pieces:
                    lo, hi = max(at, start), min(at + n, end)
                    if lo < hi:
                        flat = p.detach().reshape(-1)
                        out[lo - start : hi - start].copy_(flat[lo - at : hi - at])
                        filled = max(filled, hi)
                out[filled - start :].zero_()
                torch.sub(self.theta_g[first + start : first + end], out, out=out)
                yield start, out

    def delta(
        self, fragment: int, params: Sequence[torch.Tensor], out: torch.Tensor
    ) -> torch.Tensor:
        """The pseudo-gradient ``theta_g - theta`` of ``fragment``, in fp32 into ``out``
        (the simulation's exchange takes it whole; a peer sends :meth:`encode`'s)."""
        for start, slab in self._delta_slabs(fragment, params):
            out[start : start + slab.numel()].copy_(slab)
        return out

    def encode(self, fragment: int, params: Sequence[torch.Tensor]) -> bool:
        """The pseudo-gradient ``theta_g - theta`` of ``fragment``, quantized a slab at a
        time into the fragment's message (with error feedback, plus the residual the last
        messages left out). False when it holds NaN or Inf: nothing is to be sent, and
        the residual is as it was."""
        message = self.messages[fragment]
        feedback = self.feedback[fragment] if self.feedback else None
        if feedback is not None:
            feedback.begin()
        for start, slab in self._delta_slabs(fragment, params):
            q, scales = encoded_slice(message, start, start + slab.numel())
            try:
                # The encoder refuses a slab holding NaN or Inf by its scales (one a block),
                # so the slab is not read once more to look for them first.
                if feedback is not None:
                    feedback.encode_slab(start, slab, out=(q, scales))
                else:
                    quantize(slab, self.codec, out=(q, scales))
            except CodecError:
                if bool(torch.isfinite(slab).all()):
                    raise
                if feedback is not None:
                    feedback.rollback()
                return False
        return True

    def apply(
        self,
        fragment: int,
        round: int,
        mean: torch.Tensor | Encoded | None = None,
        *,
        weight: float = 0.0,
        group_tokens: float = 0.0,
        landed: Sequence[Range] = (),
    ) -> float:
        """The outer step of ``round`` on ``fragment`` with the group's ``mean`` (fp32, or
        encoded; by default the fragment's mean as received); this peer's tokens counted in
        ``weight`` are spent and the group's (``group_tokens``, the sum of its weights)
        added to the swarm's count, and the ranges of a pinned dataset the round landed
        (``landed``: every included member's declared ranges) to :attr:`landed`. Returns
        the norm of the step (what the round moved ``theta_g``)."""
        outer = self.outers[fragment]
        with self.lock:
            outer.step(
                self.layout.fragment(self.theta_g, fragment),
                self.means[fragment] if mean is None else mean,
            )
            self.round = round
            self.tokens += int(group_tokens)
            self.landed.add(landed)
        self.fragment_tokens[fragment] = max(0, self.fragment_tokens[fragment] - int(weight))
        return outer.last_norm

    def land(self, fragment: int, params: Sequence[torch.Tensor], alpha: float) -> None:
        """The fragment's local copy after its round: ``lerp(theta_g, theta, alpha)``."""
        with torch.no_grad():
            if alpha == 0.0:
                self.layout.scatter(self.theta_g, params, fragment)
            else:
                self.layout.lerp_into(self.theta_g, params, alpha, fragment)

    # -- the state others download ------------------------------------------------------------

    def global_by_name(self) -> dict[str, torch.Tensor]:
        """The global parameters (``theta_g``) by name, as views of the fp32 vector: no
        copy (read them, never write them; they change when a round lands)."""
        theta = self.theta_g
        return {
            slot.name: theta[slot.start : slot.start + slot.numel].view(slot.shape)
            for slot in self.layout.slots
        }

    def committed(self) -> dict[str, torch.Tensor]:
        """The committed global state as a snapshot holds it: ``theta_g`` and, once a round
        was applied, the momentum (views, no copy: read them under :attr:`lock`, or on the
        training thread), the token count and what landed of a pinned dataset."""
        tensors = {THETA_G: self.theta_g}
        if self.round > 0:
            tensors[MOMENTUM] = self.momentum
            tensors[TOKENS] = torch.tensor([self.tokens], dtype=torch.int64)
        if self.landed:
            tensors[LANDED] = self.landed.to_tensor()
        return tensors

    @staticmethod
    def snapshot_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors a donor would serve of a :meth:`state_dict` (a checkpoint's)."""
        tensors = {THETA_G: state["theta_g"]}
        if int(state["round"]) > 0:
            tensors[MOMENTUM] = state["momentum"]
            tensors[TOKENS] = torch.tensor([int(state.get("tokens", 0))], dtype=torch.int64)
        landed = state.get("landed")
        if isinstance(landed, torch.Tensor) and int(landed[0]) > 0:
            tensors[LANDED] = landed
        return tensors

    def adopt(self, snapshot: StateSnapshot) -> None:
        """Take a downloaded global state: ``theta_g``, the momentum, the round, what landed
        in it, and each fragment's outer step count as if this peer had applied rounds
        1..r itself. Read straight into place (a snapshot in a file is never held whole
        besides). ValueError, before anything changes, when what landed is malformed."""
        landed = Landed.from_tensor(snapshot.tensor(LANDED)) if snapshot.spec(LANDED) else Landed()
        with self.lock:
            snapshot.read_into(THETA_G, self.theta_g)
            if snapshot.spec(MOMENTUM) is None:
                self.momentum.zero_()
            else:
                snapshot.read_into(MOMENTUM, self.momentum)
            for f, outer in enumerate(self.outers):
                outer.steps = rounds_of_fragment(snapshot.round, f, self.fragments)
            self.round = snapshot.round
            self.tokens = int(snapshot.tensor(TOKENS)[0]) if snapshot.spec(TOKENS) else 0
            self.landed = landed

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "theta_g": self.theta_g,
            "momentum": self.momentum,
            "outer_steps": [outer.steps for outer in self.outers],
            "fragment_tokens": list(self.fragment_tokens),
            "round": self.round,
            "tokens": self.tokens,
            "landed": self.landed.to_tensor(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load a :meth:`state_dict`; ValueError (or KeyError, TypeError) before anything
        changes when it does not fit this layout (``copy_`` alone would broadcast a
        tensor of the wrong shape)."""
        tensors = {name: state[name] for name in ("theta_g", "momentum")}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"{name} is a {type(t).__name__}, not a float tensor")
            if t.shape != self.theta_g.shape:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, the swarm's state "
                    f"{tuple(self.theta_g.shape)}"
                )
        steps = [int(n) for n in state["outer_steps"]]
        fragment_tokens = [int(n) for n in state["fragment_tokens"]]
        if len(steps) != self.fragments or len(fragment_tokens) != self.fragments:
            raise ValueError(
                f"{len(steps)} fragments' outer steps and {len(fragment_tokens)} fragments' "
                f"tokens, the swarm has {self.fragments} fragments"
            )
        round_, tokens = int(state["round"]), int(state.get("tokens", 0))
        landed = state.get("landed")  # (absent from a checkpoint of before it was kept)
        landed = Landed() if landed is None else Landed.from_tensor(landed)
        if round_ < 0 or tokens < 0 or min(steps + fragment_tokens) < 0:
            raise ValueError("a negative round, step or token count")
        with self.lock:
            self.theta_g.copy_(tensors["theta_g"])
            self.momentum.copy_(tensors["momentum"])
            for outer, n in zip(self.outers, steps, strict=True):
                outer.steps = n
            self.fragment_tokens = fragment_tokens
            self.round = round_
            self.tokens = tokens
            self.landed = landed
