import copy
import dataclasses

import pytest
import torch

from swarmloco.core import codec
from swarmloco.core.aggregate import AggregatorConfig
from swarmloco.core.codec import CodecConfig
from swarmloco.core.runspec import RunSpec
from swarmloco.train.simulate import (
    SimulationConfig,
    exchange_mean,
    lie,
    run_diloco,
    simulate,
)
from swarmloco.train.spec import DataSpec, GPTConfig
from swarmloco.train.tasks import get_task


@pytest.fixture(scope="module")
def small():
    task = get_task("gpt-bytes")
    model = dataclasses.asdict(GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=32))
    data = task.load_data(model, DataSpec())
    run = task.default_run("tiny")
    inner = dataclasses.replace(run.inner, batch_size=4, warmup_steps=5, total_steps=40)
    return task, model, data, dataclasses.replace(run, inner=inner)


def test_one_worker_with_plain_averaging_is_plain_training(small):
    """Outer lr 1 without momentum sets theta_g to the worker's theta: syncing every 10
    steps or only at the end must give the same model (up to fp32 rounding of g - (g - t))."""
    task, model, data, run = small
    run = dataclasses.replace(
        run, spec=dataclasses.replace(run.spec, outer_lr=1.0, outer_momentum=0.0)
    )
    sim = SimulationConfig(workers=1, steps=40, exchange="fp32", eval_every=40)
    often = run_diloco(
        task,
        model,
        data,
        dataclasses.replace(run, spec=dataclasses.replace(run.spec, sync_every=10)),
        sim,
        progress=False,
    )
    once = run_diloco(
        task,
        model,
        data,
        dataclasses.replace(run, spec=dataclasses.replace(run.spec, sync_every=40)),
        sim,
        progress=False,
    )
    assert often.outer_rounds == 4 and once.outer_rounds == 1
    assert often.final_eval_loss == pytest.approx(once.final_eval_loss, rel=1e-5)


def test_int8_exchange_is_what_the_all_reduce_delivers():
    cfg = CodecConfig(backend="eager")
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(4096, generator=g) * 1e-2 for _ in range(3)]
    weights = [1.0, 2.0, 1.0]
    got = exchange_mean(deltas, weights, "int8", cfg)
    acc = torch.zeros(4096)
    for d, w in zip(deltas, weights):
        q, s = codec.quantize(d, cfg)
        acc += codec.dequantize(q, s, 1024, "eager") * (w / 4)
    exact = sum(d * w for d, w in zip(deltas, weights)) / 4
    # Two quantizations: each sender's, then the reducer's of the mean.
    bound = max(float(d.abs().max()) for d in deltas) / 254 + float(acc.abs().max()) / 254
    assert float((got - exact).abs().max()) <= bound * 1.01
    fp32 = exchange_mean(deltas, weights, "fp32", cfg)
    torch.testing.assert_close(fp32, exact)


def _regression_task(seed_offset: int = 0):
    """A small MLP regression: what simulate() needs, nothing of ours inside."""
    target = torch.nn.Linear(6, 1)
    with torch.no_grad():
        target.weight.copy_(torch.linspace(-1, 1, 6))
        target.bias.fill_(0.3)

    def model():
        return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))

    def batches(i):
        g = torch.Generator().manual_seed(1000 + i + seed_offset)
        while True:
            x = torch.randn(16, 6, generator=g)
            with torch.no_grad():
                y = target(x) + 0.05 * torch.randn(16, 1, generator=g)
            yield x, y

    def loss(net, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(net(x), y)

    g = torch.Generator().manual_seed(7)
    x_eval = torch.randn(256, 6, generator=g)
    with torch.no_grad():
        y_eval = target(x_eval)

    def evaluate(net):
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(net(x_eval), y_eval))

    return model, batches, loss, evaluate


def _reference_diloco(model, batches, loss, *, workers, steps, h, lr, outer_lr, momentum, seed):
    """DiLoCo written out with torch alone: workers with their own AdamW, and the global
    model stepped by torch.optim.SGD(nesterov=True) on the mean of (global - local)."""
    torch.manual_seed(seed)
    global_model = model()
    outer = torch.optim.SGD(
        global_model.parameters(), lr=outer_lr, momentum=momentum, nesterov=momentum > 0
    )
    nets = [copy.deepcopy(global_model) for _ in range(workers)]
    opts = [torch.optim.AdamW(n.parameters(), lr=lr) for n in nets]
    streams = [iter(batches(i)) for i in range(workers)]
    for step in range(1, steps + 1):
        for net, opt, stream in zip(nets, opts, streams):
            opt.zero_grad(set_to_none=True)
            loss(net, next(stream)).backward()
            opt.step()
        if step % h == 0 or step == steps:
            outer.zero_grad()
            for gp, *local in zip(global_model.parameters(), *(n.parameters() for n in nets)):
                gp.grad = torch.stack([gp.detach() - lp.detach() for lp in local]).mean(0)
            outer.step()
            for net in nets:
                net.load_state_dict(global_model.state_dict())
    return global_model


@pytest.mark.parametrize("outer_lr,momentum", [(0.7, 0.9), (1.0, 0.0)])
def test_diloco_equals_an_independent_reference_loop(outer_lr, momentum):
    model, batches, loss, evaluate = _regression_task()
    spec = RunSpec(sync_every=5, outer_lr=outer_lr, outer_momentum=momentum, seed=3)
    got = simulate(
        spec,
        model=model,
        optimizer=lambda net: torch.optim.AdamW(net.parameters(), lr=1e-2),
        loss=loss,
        batches=batches,
        evaluate=evaluate,
        workers=3,
        steps=23,  # the last round is a partial one, as at the end of a run
        exchange="fp32",
        eval_every=5,
        baseline=False,
    )
    want = _reference_diloco(
        model,
        batches,
        loss,
        workers=3,
        steps=23,
        h=5,
        lr=1e-2,
        outer_lr=outer_lr,
        momentum=momentum,
        seed=3,
    )
    assert got.diloco.outer_rounds == 5
    assert got.diloco.final_eval_loss == pytest.approx(evaluate(want), rel=1e-5)
    # Not a trivial agreement: the run learned.
    assert got.diloco.final_eval_loss < 0.7 * got.diloco.eval_curve[0][1]


def test_one_worker_averaging_every_step_with_outer_lr_1_is_plain_training():
    """H = 1, outer lr 1, no momentum: the outer step sets the global model to the worker's,
    so DiLoCo is the worker's own loop, step for step."""
    model, batches, loss, evaluate = _regression_task()
    spec = RunSpec(sync_every=1, outer_lr=1.0, outer_momentum=0.0, seed=5)
    got = simulate(
        spec,
        model=model,
        optimizer=lambda net: torch.optim.AdamW(net.parameters(), lr=1e-2),
        loss=loss,
        batches=batches,
        evaluate=evaluate,
        workers=1,
        steps=30,
        exchange="fp32",
        eval_every=10,
        baseline=False,
    )
    torch.manual_seed(5)
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    stream = iter(batches(0))
    for _ in range(30):
        opt.zero_grad(set_to_none=True)
        loss(net, next(stream)).backward()
        opt.step()
    assert got.diloco.final_eval_loss == pytest.approx(evaluate(net), rel=1e-5)


def test_a_simulated_round_bounds_and_strikes_as_a_real_one():
    g = torch.Generator().manual_seed(3)
    deltas = [torch.randn(1024, generator=g) for _ in range(4)]
    deltas[0] = deltas[0] * 10  # an honest update far above the others: scaled down
    norms = [float(d.norm()) for d in deltas]
    for attack in ("huge", "flipped"):
        declared = [*norms[:3], norms[3] * (1000 if attack == "flipped" else 1)]
        bound = 4.0 * sorted(declared)[1]  # the lower median of four declared norms
        sent, weights = lie(deltas, 1, attack, 4.0)
        assert weights == [1.0, 1.0, 1.0, 0.0], attack  # the liar is struck
        assert float(sent[0].norm()) == pytest.approx(bound, rel=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(sent[1:3], deltas[1:3], strict=True))
    bound = 4.0 * sorted(norms)[1]
    sent, weights = lie(deltas, 2, "steady", 4.0)  # one direction, just inside the bound
    assert weights == [1.0] * 4
    assert torch.equal(sent[2], sent[3])
    assert float(sent[3].norm()) == pytest.approx(0.999 * bound, rel=1e-4)
    assert float(sent[3].min()) == float(sent[3].max())
    mean = exchange_mean(sent, weights, "fp32", CodecConfig())
    assert float((mean - sum(sent[:2]) / 4).norm()) > 0.4 * bound  # the mean follows them
    sent, weights = lie(deltas, 1, "reversed", 4.0)  # its own update, turned around
    assert weights == [1.0] * 4
    assert float(sent[3].norm()) == pytest.approx(0.999 * bound, rel=1e-4)
    cosine = torch.nn.functional.cosine_similarity(sent[3], deltas[3], dim=0)
    assert float(cosine) == pytest.approx(-1.0, abs=1e-5)


def test_steady_liars_move_the_mean_of_a_short_run_and_not_its_trimmed_mean(small):
    """One of three workers sends one fixed direction at the bound every round: the plain
    mean ends far from the clean run, the trimmed mean close to it."""
    task, model, data, run = small
    sim = SimulationConfig(workers=3, steps=20, eval_every=20, eval_windows=32)
    losses = {}
    for method in ("mean", "trimmed_mean"):
        spec = dataclasses.replace(
            run.spec, sync_every=5, aggregator=AggregatorConfig(method=method, trim=1)
        )
        arm = dataclasses.replace(run, spec=spec)
        for liars in (0, 1):
            result = run_diloco(
                task, model, data, arm, dataclasses.replace(sim, liars=liars), progress=False
            )
            losses[method, liars] = result.final_eval_loss
    assert losses["mean", 1] > 1.04 * losses["mean", 0], losses
    assert losses["trimmed_mean", 1] < 1.02 * losses["trimmed_mean", 0], losses
