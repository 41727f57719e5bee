"""The DiLoCo state of one peer: global parameters, outer momentum and fragments.

:class:`DilocoState` owns ``theta_g`` (the committed global parameters, flat fp32 on the
CPU in the layout of the model signature) and the outer Nesterov momentum, one outer
optimizer per Streaming DiLoCo fragment, and the buffers of a round: the pseudo-gradient
``delta = theta_g - theta`` of a fragment and the group's mean of it. It does no I/O: the
peer (``runtime/swarm.py``) averages the delta with its group and hands the mean back;
the simulation (``train/simulate.py``) computes the mean in-process. Both therefore run
the same arithmetic and the same fragment schedule: round r syncs fragment ``(r - 1) % F``
(DESIGN section 3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from swarmloco.core.codec import CodecConfig, ErrorFeedback
from swarmloco.core.flat import FlatLayout
from swarmloco.core.outer import OuterConfig, OuterOptimizer
from swarmloco.core.state import MOMENTUM, THETA_G, TOKENS, StateSchema, StateSnapshot


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
        self.deltas = [torch.zeros(n) for n in sizes]
        self.means = [torch.zeros(n) for n in sizes]
        self.feedback = [ErrorFeedback(n, codec) for n in sizes] if codec.error_feedback else None
        self.round = 0
        """Outer steps applied to ``theta_g``: the state's round."""
        self.fragment_tokens = [0] * self.fragments
        """Tokens each fragment's local copy trained on since that fragment last synced."""
        self.tokens = 0
        """Tokens the swarm trained on: the summed weights of every round's group (part of
        the state, so that every member of a group holds the same count)."""
        self.schema = StateSchema.diloco(layout.numel)

    # -- local progress ---------------------------------------------------------------------

    def set_global(self, params: Sequence[torch.Tensor]) -> None:
        """``theta_g <- theta`` (a fresh run: the initial weights are round 0's state)."""
        with torch.no_grad():
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

    def delta(
        self, fragment: int, params: Sequence[torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The pseudo-gradient ``theta_g - theta`` of ``fragment`` (into ``out``, by default
        the fragment's own buffer, which the round sends)."""
        out = self.deltas[fragment] if out is None else out
        start, _ = self.layout.fragment_ranges[fragment]
        filled = 0  # a fragment's parameters lie end to end from its start, padding after
        with torch.no_grad():
            for slot, p in zip(self.layout.slots, params, strict=True):
                if slot.fragment != fragment:
                    continue
                # Each parameter into its place, then theta_g minus it there: no full-size
                # copy of the model besides the delta itself.
                here = out[slot.start - start : slot.start - start + slot.numel]
                here.copy_(p.detach().reshape(-1))
                theta = self.theta_g[slot.start : slot.start + slot.numel]
                torch.sub(theta, here, out=here)
                filled = max(filled, slot.start - start + slot.numel)
            out[filled:].zero_()
        return out

    def apply(
        self,
        fragment: int,
        round: int,
        mean: torch.Tensor | None = None,
        *,
        weight: float = 0.0,
        group_tokens: float = 0.0,
    ) -> float:
        """The outer step of ``round`` on ``fragment`` with the group's ``mean`` (by default
        the fragment's mean buffer); this peer's tokens counted in ``weight`` are spent and
        the group's (``group_tokens``, the sum of its weights) added to the swarm's count.
        Returns the norm of the step (what the round moved ``theta_g``)."""
        outer = self.outers[fragment]
        outer.step(
            self.layout.fragment(self.theta_g, fragment),
            self.means[fragment] if mean is None else mean,
        )
        self.round = round
        self.tokens += int(group_tokens)
        self.fragment_tokens[fragment] = max(0, self.fragment_tokens[fragment] - int(weight))
        return float(torch.linalg.vector_norm(outer.last_update))

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
        """A copy of the committed global state (a donor serves it while the original
        changes); the momentum only once a round was applied."""
        tensors = {THETA_G: self.theta_g.clone()}
        if self.round > 0:
            tensors[MOMENTUM] = self.momentum.clone()
            tensors[TOKENS] = torch.tensor([self.tokens], dtype=torch.int64)
        return tensors

    @staticmethod
    def snapshot_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors a donor would serve of a :meth:`state_dict` (a checkpoint's)."""
        tensors = {THETA_G: state["theta_g"]}
        if int(state["round"]) > 0:
            tensors[MOMENTUM] = state["momentum"]
            tensors[TOKENS] = torch.tensor([int(state.get("tokens", 0))], dtype=torch.int64)
        return tensors

    def adopt(self, snapshot: StateSnapshot) -> None:
        """Take a downloaded global state: ``theta_g``, the momentum, the round, and each
        fragment's outer step count as if this peer had applied rounds 1..r itself."""
        self.theta_g.copy_(snapshot.tensors[THETA_G])
        momentum = snapshot.tensors.get(MOMENTUM)
        if momentum is None:
            self.momentum.zero_()
        else:
            self.momentum.copy_(momentum)
        for f, outer in enumerate(self.outers):
            outer.steps = rounds_of_fragment(snapshot.round, f, self.fragments)
        self.round = snapshot.round
        tokens = snapshot.tensors.get(TOKENS)
        self.tokens = int(tokens[0]) if tokens is not None else 0

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "theta_g": self.theta_g,
            "momentum": self.momentum,
            "outer_steps": [outer.steps for outer in self.outers],
            "fragment_tokens": list(self.fragment_tokens),
            "round": self.round,
            "tokens": self.tokens,
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
        if round_ < 0 or tokens < 0 or min(steps + fragment_tokens) < 0:
            raise ValueError("a negative round, step or token count")
        self.theta_g.copy_(tensors["theta_g"])
        self.momentum.copy_(tensors["momentum"])
        for outer, n in zip(self.outers, steps, strict=True):
            outer.steps = n
        self.fragment_tokens = fragment_tokens
        self.round = round_
        self.tokens = tokens
