"""The inner loop: accumulation, mixed precision, compilation, NaN, and its saved state.

Fused AdamW runs only where a GPU is; the other CUDA code paths are exercised here on CPU:
bf16 and fp16 autocast (fp16 with its gradient scaler) and an explicit compile.
"""

import copy
import itertools

import pytest
import torch

from swarmloco.train.inner import InnerConfig, InnerLoop, resolve_precision
from swarmloco.train.model import GPT
from swarmloco.train.spec import GPTConfig

CPU = torch.device("cpu")
MODEL = GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16)


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(MODEL)


def tokens(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, MODEL.vocab_size, (batch, MODEL.seq_len + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def repeating(batch: int, seed: int = 1):
    """The same batch forever: a loss that must fall as the model memorizes it."""
    return itertools.repeat(tokens(batch, seed))


def config(**overrides) -> InnerConfig:
    base = dict(lr=3e-3, warmup_steps=0, total_steps=100, precision="fp32", compile="off")
    return InnerConfig(**(base | overrides))


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_two_accumulated_halves_equal_one_full_batch():
    x, y = tokens(8, seed=3)
    whole = InnerLoop(make_model(), config(batch_size=8), CPU)
    halves = InnerLoop(make_model(), config(batch_size=4, grad_accum=2), CPU)
    loss_whole = whole.train_step(iter([(x, y)]))
    loss_halves = halves.train_step(iter([(x[:4], y[:4]), (x[4:], y[4:])]))
    assert loss_halves == pytest.approx(loss_whole, rel=1e-5)
    torch.testing.assert_close(params(halves.model), params(whole.model), rtol=1e-4, atol=1e-6)


def grads_at_step(loop: InnerLoop) -> list[torch.Tensor]:
    """The gradients the optimizer steps on (kept at each step)."""
    seen: list[torch.Tensor] = []

    def keep(optimizer, args, kwargs):
        seen[:] = [p.grad.clone() for p in loop.model.parameters()]

    loop.optimizer.register_step_pre_hook(keep)
    return seen


def test_an_empty_micro_batch_trains_nothing():
    """The last sequences of a dataset ran out: an empty micro-batch adds no gradient (it
    runs on one row with weight 0, as a rank of a box must) and the loss is the others'."""
    x, y = tokens(4, seed=3)
    empty = (x[:0], y[:0])
    alone = InnerLoop(make_model(), config(batch_size=4, grad_clip=0.0), CPU)  # (unclipped)
    short = InnerLoop(make_model(), config(batch_size=4, grad_accum=2, grad_clip=0.0), CPU)
    g_alone, g_short = grads_at_step(alone), grads_at_step(short)
    loss_alone = alone.train_step(iter([(x, y)]))
    loss_short = short.train_step(iter([(x, y), empty]))
    assert loss_short == pytest.approx(loss_alone, rel=1e-6)
    for a, b in zip(g_alone, g_short, strict=True):
        torch.testing.assert_close(b, a / 2)  # one micro-batch of two, the other nothing
    nothing = InnerLoop(make_model(), config(batch_size=4), CPU)
    g_nothing = grads_at_step(nothing)
    assert nothing.train_step(iter([empty])) == 0.0
    assert all(not g.any() for g in g_nothing)


def test_warmup_then_cosine_sets_the_optimizer_lr():
    loop = InnerLoop(make_model(), config(warmup_steps=4, total_steps=20, min_lr_ratio=0.1), CPU)
    seen = []
    batches = repeating(2)
    for _ in range(24):
        loop.train_step(batches)
        seen.append(loop.optimizer.param_groups[0]["lr"])
    assert seen[0] < seen[1] < seen[2] < seen[3] == pytest.approx(3e-3)
    assert all(a >= b for a, b in itertools.pairwise(seen[3:20]))
    assert seen[-1] == pytest.approx(3e-4)  # the floor after total_steps


def test_bf16_autocast_trains_on_cpu():
    loop = InnerLoop(make_model(), config(precision="bf16"), CPU)
    assert loop.amp_dtype is torch.bfloat16
    batches = repeating(4)
    first = loop.train_step(batches)
    for _ in range(30):
        last = loop.train_step(batches)
    assert last < 0.8 * first
    assert all(p.dtype is torch.float32 for p in loop.model.parameters())  # masters stay fp32


def test_fp16_trains_on_cpu_with_a_working_gradient_scaler():
    loop = InnerLoop(make_model(), config(precision="fp16"), CPU)
    assert loop.amp_dtype is torch.float16
    assert loop.scaler.is_enabled()
    batches = repeating(4)
    first = loop.train_step(batches)
    for _ in range(30):
        last = loop.train_step(batches)
    assert last < 0.8 * first
    assert all(p.dtype is torch.float32 for p in loop.model.parameters())


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    loop = InnerLoop(make_model(), config(precision="fp16"), CPU)
    batches = repeating(4)
    loop.train_step(batches)
    before = params(loop.model).clone()
    moments = copy.deepcopy(loop.optimizer.state_dict()["state"])
    loop.scaler.update(new_scale=2.0**100)  # scaled fp16 gradients overflow to inf
    loop.train_step(batches)
    assert loop.scaler.get_scale() < 2.0**100
    torch.testing.assert_close(params(loop.model), before, rtol=0, atol=0)
    after = loop.optimizer.state_dict()["state"]
    for key, state in moments.items():
        torch.testing.assert_close(after[key]["exp_avg"], state["exp_avg"], rtol=0, atol=0)
    loop.scaler.update(new_scale=1024.0)  # a scale that fits: the next step is taken
    loop.train_step(batches)
    assert not torch.equal(params(loop.model), before)


def test_precision_resolution():
    assert resolve_precision("auto", CPU) is None
    assert resolve_precision("fp32", CPU) is None
    assert resolve_precision("bf16", CPU) is torch.bfloat16
    assert resolve_precision("fp16", CPU) is torch.float16


def test_compiled_model_follows_the_eager_one():
    eager = InnerLoop(make_model(), config(), CPU)
    compiled = InnerLoop(make_model(), config(compile="on"), CPU)
    assert compiled._forward is not compiled.model
    batches_a, batches_b = repeating(4), repeating(4)
    for _ in range(3):
        a = eager.train_step(batches_a)
        b = compiled.train_step(batches_b)
        assert b == pytest.approx(a, rel=1e-3)
    torch.testing.assert_close(params(compiled.model), params(eager.model), rtol=1e-3, atol=1e-4)


def test_a_nan_loss_raises_instead_of_reaching_the_pseudo_gradient():
    model = make_model()
    with torch.no_grad():
        model.wte.weight[0, 0] = float("nan")
    loop = InnerLoop(model, config(), CPU)
    x, y = tokens(2, seed=0)
    x[0, 0] = 0  # the poisoned embedding row is used
    with pytest.raises(FloatingPointError, match="NaN"):
        loop.train_step(iter([(x, y)]))


def test_saved_state_resumes_to_the_same_next_step():
    batches = repeating(4)
    loop = InnerLoop(make_model(), config(), CPU)
    for _ in range(5):
        loop.train_step(batches)
    saved_model = copy.deepcopy(loop.model.state_dict())
    saved = copy.deepcopy(loop.state_dict())
    expected = loop.train_step(batches)

    resumed_model = make_model(seed=42)
    resumed_model.load_state_dict(saved_model)
    resumed = InnerLoop(resumed_model, config(), CPU)
    resumed.load_state_dict(saved)
    assert resumed.step == 5
    assert resumed.train_step(batches) == expected
    torch.testing.assert_close(params(resumed.model), params(loop.model), rtol=0, atol=0)


@pytest.mark.parametrize(("saved", "resumed"), [("fp32", "fp16"), ("fp16", "fp32")])
def test_a_state_saved_under_one_precision_resumes_under_another(saved, resumed):
    first = InnerLoop(make_model(), config(precision=saved), CPU)
    batches = repeating(4)
    first.train_step(batches)
    second = InnerLoop(copy.deepcopy(first.model), config(precision=resumed), CPU)
    second.load_state_dict(first.state_dict())
    assert second.step == 1
    assert second.scaler.is_enabled() == (resumed == "fp16")
    second.train_step(batches)
