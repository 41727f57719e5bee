"""Fitting the run's batch to a peer's memory (train/fit.py): the micro-batch chosen for a
budget, and that its accumulation makes the update of the whole batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarmloco.errors import SwarmlocoError
from swarmloco.runtime.daemon import fit_batch
from swarmloco.train.fit import MARGIN, MemoryProfile, choose_fit, estimate_profile
from swarmloco.train.inner import InnerConfig, InnerLoop
from swarmloco.train.llama import Llama
from swarmloco.train.spec import LlamaConfig

CPU = torch.device("cpu")
SHAPE = LlamaConfig(vocab_size=300, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn=48)
GB = 10**9


def test_the_largest_micro_batch_that_fits_divides_the_step():
    profile = MemoryProfile(fixed_bytes=10 * GB, per_sequence_bytes=1 * GB)
    # 12 sequences a step; 24 GB less 10% leaves 21.6: 11 would fit, but 6 is the largest
    # divisor of 12 that does.
    fit = choose_fit(12, profile, 24 * GB)
    assert (fit.micro_batch, fit.grad_accum, fit.checkpointing) == (6, 2, False)
    assert fit.need_bytes == 16 * GB
    assert choose_fit(12, profile, 100 * GB).micro_batch == 12  # the whole step at once
    assert choose_fit(7, profile, 14 * GB).micro_batch == 1  # a prime: 1 or 7


def test_checkpointing_only_when_no_micro_batch_fits_without():
    profile = MemoryProfile(10 * GB, 8 * GB, checkpointed_per_sequence_bytes=1 * GB)
    fit = choose_fit(8, profile, 20 * GB)  # 18 usable: one plain sequence is 18 exactly
    assert (fit.micro_batch, fit.checkpointing) == (1, False)
    fit = choose_fit(8, profile, 19 * GB)  # 17.1 usable: checkpointed, 4 fit
    assert (fit.micro_batch, fit.grad_accum, fit.checkpointing) == (4, 2, True)
    with pytest.raises(SwarmlocoError, match=r"does not fit: one sequence needs about 11\.0 GB"):
        choose_fit(8, profile, 12 * GB)
    with pytest.raises(SwarmlocoError, match="larger --memory-budget"):
        choose_fit(8, MemoryProfile(10 * GB, 8 * GB), 19 * GB)


def build(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(SHAPE)


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_budget_given_as_a_number_splits_the_step_and_the_update_is_the_whole_batchs():
    config = InnerConfig(lr=1e-2, warmup_steps=0, batch_size=8, grad_accum=1)
    whole = InnerLoop(build(), config, CPU)
    fitted = InnerLoop(build(), config, CPU)
    profile = estimate_profile(
        SHAPE.parameters, n_layer=2, n_embd=32, seq_len=16, vocab_size=300, activation_bytes=4
    )
    budget = profile.need(2) / (1 - MARGIN) + 1  # two sequences fit, four do not
    fit = fit_batch(fitted, dataclasses.asdict(SHAPE), CPU, budget / 1e9)
    assert (fit.micro_batch, fit.grad_accum, fit.checkpointing) == (2, 4, False)
    assert (fitted.config.batch_size, fitted.config.grad_accum) == (2, 4)
    g = torch.Generator().manual_seed(1)
    steps = [
        torch.randint(0, SHAPE.vocab_size, (8, SHAPE.seq_len + 1), generator=g) for _ in range(3)
    ]

    def whole_batches():
        for rows in steps:
            yield rows[:, :-1], rows[:, 1:]

    def micro_batches():
        for rows in steps:
            for part in rows.split(2):
                yield part[:, :-1], part[:, 1:]

    a, b = whole_batches(), micro_batches()
    for _ in steps:
        assert fitted.train_step(b) == pytest.approx(whole.train_step(a), rel=1e-5)
    # Adam divides by sqrt(v): where a gradient is near zero, float32's summation order
    # (four micro-batches against one batch) shows up to ~1e-6 (seen: 1.1e-6). A wrong
    # accumulation would be off by a step's size, lr = 1e-2: 1,000 times this atol.
    torch.testing.assert_close(params(fitted.model), params(whole.model), rtol=1e-5, atol=1e-5)
    assert not torch.equal(params(whole.model), params(build()))  # it did train


def test_activation_checkpointing_gives_the_same_gradients():
    plain, recomputed = build(), build()
    recomputed.checkpointing = True
    x = torch.randint(0, SHAPE.vocab_size, (3, SHAPE.seq_len))
    plain(x, x).backward()
    recomputed(x, x).backward()
    for p, q in zip(plain.parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)


def test_a_budget_too_small_for_one_checkpointed_sequence_is_a_clear_error():
    loop = InnerLoop(build(), InnerConfig(batch_size=4), CPU)
    with pytest.raises(SwarmlocoError, match="does not fit"):
        fit_batch(loop, dataclasses.asdict(SHAPE), CPU, 1e-6)
    assert loop.config.batch_size == 4  # nothing changed
