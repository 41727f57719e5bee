"""What a peer's DiLoCo state holds, and that holding less changed no arithmetic (DESIGN
section 6, "Host memory"): the pseudo-gradient is encoded slab by slab as the whole vector
would be, the outer step runs slab by slab on an encoded mean as on the decoded one, and a
round's state file is written with the state held still."""

from __future__ import annotations

import threading

import pytest
import torch

from swarmloco.core.codec import (
    CodecConfig,
    Encoded,
    dequantize,
    encoded_norm,
    encoded_zeros,
    quantize,
)
from swarmloco.core.flat import FlatLayout
from swarmloco.core.outer import SLAB_VALUES, OuterConfig, OuterOptimizer
from swarmloco.core.state import state_digest
from swarmloco.net.state.files import FileSource
from swarmloco.runtime import snapshots as snapshots_module
from swarmloco.runtime.snapshots import Snapshots
from swarmloco.train.diloco import DilocoState

SWARM = "5a" * 20
CODEC = CodecConfig(block_size=1024, backend="eager")
# Parameters that straddle the slabs' edges (a slab is 2^20 values), and a fragment's
# padding after the last.
SHAPES = [("a", (700, 1000)), ("b", (900_000,)), ("c", (600, 1001)), ("d", (5,))]


def state_and_params(seed: int = 0) -> tuple[DilocoState, list[torch.Tensor]]:
    layout = FlatLayout(SHAPES, [0] * len(SHAPES), CODEC.block_size)
    state = DilocoState(layout, OuterConfig(), CODEC)
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=g) for _, shape in SHAPES]
    state.set_global(params)
    for p in params:
        p.add_(torch.randn(p.shape, generator=g) * 0.01)  # some local training
    return state, params


def tensors_of(obj: object, seen: set[int] | None = None) -> dict[int, torch.Tensor]:
    """Every tensor reachable from ``obj``'s attributes, by storage."""
    seen = set() if seen is None else seen
    found: dict[int, torch.Tensor] = {}
    if id(obj) in seen:
        return found
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found[obj.untyped_storage().data_ptr()] = obj
        return found
    if isinstance(obj, Encoded):
        children: list[object] = [obj.payload, obj.scales]
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif isinstance(obj, dict):
        children = list(obj.values())
    elif hasattr(obj, "__dict__"):
        children = list(vars(obj).values())
    else:
        return found
    for child in children:
        found |= tensors_of(child, seen)
    return found


def test_the_diloco_state_holds_ten_bytes_a_parameter():
    """theta_g and the momentum (8), the message and the mean as encoded (1.004 each):
    nothing else of the model's size, neither an fp32 delta nor an outer step's scratch."""
    state, params = state_and_params()
    state.encode(0, params)
    state.apply(0, 1, state.messages[0])  # a round's step, with its slabs of scratch
    held = sum(t.untyped_storage().nbytes() for t in tensors_of(state).values())
    assert held / state.layout.numel < 10.01, held / state.layout.numel


def test_the_pseudo_gradient_is_encoded_as_the_whole_vector_would_be():
    state, params = state_and_params()
    assert state.encode(0, params)
    whole = state.delta(0, params, out=torch.empty(state.layout.numel))
    q, scales = quantize(whole, CODEC)
    message = state.messages[0]
    assert torch.equal(message.payload, q) and torch.equal(message.scales, scales)
    assert abs(encoded_norm(message) - float(dequantize(q, scales, 1024).norm())) < 1e-3
    theta = torch.cat([p.reshape(-1) for p in params])
    assert torch.equal(whole[: theta.numel()], state.theta_g[: theta.numel()] - theta)
    assert not whole[theta.numel() :].any()  # the padding


@pytest.mark.parametrize("feedback", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_pseudo_gradient_with_nan_is_not_encoded_and_leaves_the_residual_as_it_was(bad, feedback):
    layout = FlatLayout(SHAPES, [0] * len(SHAPES), CODEC.block_size)
    codec = CodecConfig(block_size=1024, backend="eager", error_feedback=feedback)
    state = DilocoState(layout, OuterConfig(), codec)
    _, params = state_and_params()
    assert state.encode(0, params)
    residual = state.feedback[0].residual.clone() if state.feedback else None
    assert residual is None or residual.any()  # what the first message left out
    params[2][3, 4] = bad  # in the second slab: the first was encoded already
    assert not state.encode(0, params)
    if state.feedback is not None:
        assert torch.equal(state.feedback[0].residual, residual)
    params[2][3, 4] = 0.0
    assert state.encode(0, params)  # finite again: encoded


def test_the_outer_step_on_an_encoded_mean_is_the_step_on_the_decoded_one_bit_for_bit():
    n = 2 * SLAB_VALUES + 3 * 1024  # three slabs, the last short
    g = torch.Generator().manual_seed(1)
    theta0 = torch.randn(n, generator=g)
    means = [encoded_zeros(n, CODEC) for _ in range(3)]
    for mean in means:
        quantize(torch.randn(n, generator=g) * 0.01, CODEC, out=(mean.payload, mean.scales))
    encoded, decoded = theta0.clone(), theta0.clone()
    a, b = OuterOptimizer(n, OuterConfig()), OuterOptimizer(n, OuterConfig())
    for mean in means:
        a.step(encoded, mean)
        b.step(decoded, dequantize(mean.payload, mean.scales, 1024))
    assert torch.equal(encoded, decoded) and torch.equal(a.momentum_buffer, b.momentum_buffer)
    assert a.last_norm == b.last_norm > 0


def test_a_rounds_state_file_is_written_with_the_state_held_still(tmp_path, monkeypatch):
    """hash_later takes the state's lock before it returns and the writer lets it go once
    the file holds the round: an outer step waits for the file, never changes the state
    under it."""
    state, _ = state_and_params()
    release = threading.Event()
    real = snapshots_module.write_state

    def held_back(*args, **kwargs):
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(snapshots_module, "write_state", held_back)
    digests: list[bytes] = []
    with Snapshots(SWARM, tmp_path) as snapshots:
        want = state_digest(state.committed())
        snapshots.hash_later(state, digests.append)
        assert state.lock.locked()  # the writer holds it: an outer step would wait
        release.set()
        snapshots.finish(wait=True)
        assert not state.lock.locked() and digests == [want]
        served = snapshots.current
        assert served is not None and isinstance(served.source, FileSource)
        assert served.digest == want and served.round == state.round
        state.apply(0, 1, state.messages[0])  # the next round changes theta_g ...
        assert state_digest(dict(served.tensors)) == want  # ... not what is served
    assert list(tmp_path.iterdir()) == []
