"""How a driver compares a stage's answers and judges three of them (pipeline/audit.py)."""

from __future__ import annotations

import math

import pytest
import torch

from swarmloco.pipeline.audit import Answer, distance, judge


def test_the_distance_is_relative_symmetric_and_the_larger_of_the_two_parts():
    g = torch.randn(4, 8, 16)
    out = torch.randn(4, 8, 16)
    a = Answer(out, g)
    assert distance(a, a) == 0.0
    assert distance(a, Answer(out, -g)) == pytest.approx(2.0)
    assert distance(a, Answer(out, 10 * g)) == pytest.approx(0.9)
    assert distance(a, Answer(out, torch.zeros_like(g))) == pytest.approx(1.0)
    assert distance(Answer(out, 2 * g), a) == distance(a, Answer(out, 2 * g)) == pytest.approx(0.5)
    assert distance(a, Answer(-out, g)) == pytest.approx(2.0)  # the output counts too
    zero = Answer(torch.zeros(3), torch.zeros(3))
    assert distance(zero, zero) == 0.0
    assert distance(Answer(2.5, g), Answer(2.0, g)) == pytest.approx(0.2)  # a loss
    assert distance(a, Answer(out, g[:2])) == math.inf
    nan = g.clone()
    nan[0, 0, 0] = float("nan")
    assert distance(a, Answer(out, nan)) == math.inf


def test_one_of_three_is_judged_wrong_only_when_the_other_two_agree_closely():
    tolerance = 0.8
    # 0 is far from both, 1 and 2 close: 0 is judged wrong, whichever order.
    assert judge({(0, 1): 1.1, (0, 2): 1.05, (1, 2): 0.3}, tolerance) == 0
    assert judge({(0, 1): 1.1, (0, 2): 0.2, (1, 2): 1.0}, tolerance) == 1
    assert judge({(0, 1): 0.1, (0, 2): 2.0, (1, 2): 2.0}, tolerance) == 2
    # The two others not close enough (within half the tolerance): nobody.
    assert judge({(0, 1): 1.1, (0, 2): 1.05, (1, 2): 0.5}, tolerance) is None
    # Far from only one of the others: nobody.
    assert judge({(0, 1): 1.1, (0, 2): 0.7, (1, 2): 0.3}, tolerance) is None
    # All far apart: nobody.
    assert judge({(0, 1): 1.5, (0, 2): 1.5, (1, 2): 1.5}, tolerance) is None
