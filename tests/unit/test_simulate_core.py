import dataclasses

import pytest
import torch

from swarmloco.core import codec
from swarmloco.core.codec import CodecConfig
from swarmloco.train.simulate import SimulationConfig, exchange_mean, run_diloco
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
