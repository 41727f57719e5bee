import pytest
import torch

from swarmloco.core.outer import OuterConfig, OuterOptimizer


def _grads(n: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * 0.01 for _ in range(steps)]


@pytest.mark.parametrize(
    "lr,momentum,nesterov", [(0.7, 0.9, True), (1.0, 0.0, False), (0.5, 0.8, False)]
)
def test_matches_torch_sgd_over_many_steps(lr, momentum, nesterov):
    n, steps = 5000, 200
    theta0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
    ours = theta0.clone()
    opt = OuterOptimizer(n, OuterConfig(lr=lr, momentum=momentum, nesterov=nesterov))
    ref = torch.nn.Parameter(theta0.clone())
    sgd = torch.optim.SGD([ref], lr=lr, momentum=momentum, nesterov=nesterov)
    for grad in _grads(n, steps):
        opt.step(ours, grad)
        ref.grad = grad.clone()
        sgd.step()
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-5, atol=1e-6)
    if momentum:
        torch.testing.assert_close(
            opt.momentum_buffer, sgd.state[ref]["momentum_buffer"], rtol=1e-5, atol=1e-6
        )


def test_same_inputs_give_the_same_bytes():
    n = 10_000

    def run() -> bytes:
        theta = torch.linspace(-1, 1, n)
        opt = OuterOptimizer(n, OuterConfig())
        for grad in _grads(n, 50, seed=3):
            opt.step(theta, grad)
        return theta.numpy().tobytes() + opt.momentum_buffer.numpy().tobytes()

    assert run() == run()


def test_state_dict_round_trip_continues_identically():
    n = 1000
    grads = _grads(n, 20)
    a_theta = torch.zeros(n)
    a = OuterOptimizer(n, OuterConfig())
    for g in grads[:10]:
        a.step(a_theta, g)
    b = OuterOptimizer(n, OuterConfig())
    b.load_state_dict(
        {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.state_dict().items()}
    )
    b_theta = a_theta.clone()
    for g in grads[10:]:
        a.step(a_theta, g)
        b.step(b_theta, g)
    assert torch.equal(a_theta, b_theta)


def test_rejects_wrong_shapes_and_config():
    opt = OuterOptimizer(10, OuterConfig())
    with pytest.raises(ValueError, match="11 elements"):
        opt.step(torch.zeros(10), torch.zeros(11))
    with pytest.raises(ValueError, match="float32"):
        opt.step(torch.zeros(10, dtype=torch.float64), torch.zeros(10))
    with pytest.raises(ValueError, match="outer lr"):
        OuterConfig(lr=-1)
    with pytest.raises(ValueError, match="momentum"):
        OuterConfig(momentum=1.0)
