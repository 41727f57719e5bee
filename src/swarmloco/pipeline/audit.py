"""Judging a stage's answers by computing them again (``docs/DESIGN.md`` section 10,
"Audits"): how far apart two answers to one micro-batch are, and which of three answers,
if any, a driver finds out as wrong.

A driver compares what the replica on a micro-batch's path answered with what a second
replica of the stage answers to the same call (:meth:`Driver._audit` in ``driver.py``).
Honest replicas do not answer alike (each took its own AdamW steps since the stage's last
round), so answers within ``tolerance`` of each other agree; two that do not are judged
with a third: the one far from both others, while those two are close, is found out.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from swarmloco.proto.v1 import stage_pb2 as pb


@dataclasses.dataclass(frozen=True)
class Answer:
    """A stage's answer to one micro-batch: its output (the loss, at the last stage) and
    the gradient with respect to its input."""

    output: torch.Tensor | float
    grad_input: torch.Tensor


@dataclasses.dataclass
class Used:
    """An answer a driver used on a micro-batch's path, with the calls that gave it (what
    an auditor is sent)."""

    stage: int
    endpoint: str
    forward: pb.ForwardRequest
    output: torch.Tensor | float | None = None
    grad_output: pb.StageTensor | None = None
    grad_input: torch.Tensor | None = None

    def answer(self) -> Answer:
        assert self.output is not None and self.grad_input is not None
        return Answer(self.output, self.grad_input)


def distance(a: Answer, b: Answer) -> float:
    """The larger relative distance ``|a - b| / max(|a|, |b|)`` of the two answers' outputs
    (or losses) and of their input gradients (0 for two zeros; inf when they do not even
    have one shape)."""
    return max(_relative(a.output, b.output), _relative(a.grad_input, b.grad_input))


def _relative(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    x = torch.as_tensor(a, dtype=torch.float64)
    y = torch.as_tensor(b, dtype=torch.float64)
    if x.shape != y.shape:
        return float("inf")
    scale = max(float(x.norm()), float(y.norm()))
    if scale == 0.0:
        return 0.0
    gap = float((x - y).norm()) / scale
    return float("inf") if math.isnan(gap) else gap  # NaN: nothing alike


def judge(distances: dict[tuple[int, int], float], tolerance: float) -> int | None:
    """Of three answers (0, 1, 2) and their pairwise ``distances`` (keys ``(i, j)``,
    ``i < j``), the one found out: over ``tolerance`` from both others while those two
    are within ``tolerance / 2`` of each other; None when no one is."""
    for suspect in range(3):
        i, j = (k for k in range(3) if k != suspect)
        apart = [distances[min(suspect, k), max(suspect, k)] for k in (i, j)]
        if min(apart) > tolerance and distances[(i, j)] <= tolerance / 2:
            return suspect
    return None
