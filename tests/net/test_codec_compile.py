"""A peer compiles the codec's kernels before it serves, and never again in a round.

A compile takes seconds on this machine and a minute on a fresh GPU box (45-52 s at a
peer's start on the H200 of 2026-11-26): one made during a round stalls the member that
makes it past its peers' patience, one made during a pipeline call misses the caller's
deadline. A compiled kernel is built again whenever its guards fail (the grad mode, the
layout of its inputs' bases), so this checks that what the warm-up built is what a round,
an outer round's encoding and a pipeline's packing run, by counting dynamo's graphs.
"""

import dataclasses

import pytest
import torch
from avgutil import assert_identical, averaging_peers, random_vectors, run_round
from torch._dynamo.utils import counters

from swarmloco.core import codec as codec_module
from swarmloco.core.aggregate import AggregatorConfig
from swarmloco.core.codec import CodecConfig, warm_up
from swarmloco.core.flat import FlatLayout
from swarmloco.core.outer import OuterConfig
from swarmloco.net.averaging import AveragingConfig
from swarmloco.pipeline.wire import Boundary, pack, prepare, wire_codec
from swarmloco.train.diloco import DilocoState

BLOCK = 1024


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def fresh_warm_up(config: CodecConfig, *, trimmed: bool) -> int:
    """The graphs a warm-up compiles from nothing (what an earlier test compiled would
    hide a compile here)."""
    torch._dynamo.reset()
    before = graphs()
    warm_up(config, trimmed=trimmed)
    if codec_module.compile_failure() is not None:
        pytest.skip(f"torch.compile is unavailable here: {codec_module.compile_failure()}")
    return graphs() - before


async def encode_and_average(config: CodecConfig, aggregator: AggregatorConfig) -> list:
    """An outer round's encoding (slabs of the pseudo-gradient into slices of the message,
    under no_grad), then an all-reduce of four members on loopback: the messages' bytes,
    then the round's mean."""
    shapes = [("a", (700, 1000)), ("b", (90_000,)), ("c", (3000, 1024))]
    layout = FlatLayout(shapes, [0] * len(shapes), BLOCK)
    state = DilocoState(layout, OuterConfig(), config)
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=g) for _, shape in shapes]
    state.set_global(params)
    for p in params:
        p.add_(torch.randn(p.shape, generator=g) * 0.01)
    assert all(state.encode(f, params) for f in range(state.fragments))
    averaging = AveragingConfig(codec=config, aggregator=aggregator)
    async with averaging_peers(4, config=averaging) as peers:
        vectors = random_vectors(4, BLOCK * 40, seed=1, block=BLOCK)
        results = await run_round(peers, 1, vectors, [1.0] * 4, timeout=120)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert_identical(results)
    return [m.payload.clone() for m in state.messages] + [results[0].mean]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("feedback", "method"), [(True, "trimmed_mean"), (False, "mean")], ids=["public", "private"]
)
async def test_a_warmed_up_codec_compiles_nothing_in_a_round(feedback, method):
    """A public run's (error feedback, the trimmed mean) and a private run's (neither):
    the warm-up compiles what their rounds run, and only that."""
    config = CodecConfig(block_size=BLOCK, backend="auto", error_feedback=feedback)
    trimmed = method == "trimmed_mean"
    built = fresh_warm_up(config, trimmed=trimmed)
    assert built > 0
    if not trimmed:  # the trimmed mean's and error feedback's kernels left out
        everything = CodecConfig(block_size=BLOCK, backend="auto", error_feedback=True)
        assert built < fresh_warm_up(everything, trimmed=True)
        torch._dynamo.reset()
        warm_up(config, trimmed=False)
    before = graphs()
    aggregator = AggregatorConfig(method=method, trim=1)
    compiled = await encode_and_average(config, aggregator)
    assert graphs() == before
    eager = await encode_and_average(dataclasses.replace(config, backend="eager"), aggregator)
    *messages, mean = compiled
    *eager_messages, eager_mean = eager
    assert all(torch.equal(a, b) for a, b in zip(messages, eager_messages, strict=True))
    # (The streamed mean adds the chunks as they arrive: the last bits follow that order.)
    torch.testing.assert_close(mean, eager_mean, rtol=0, atol=1e-6)


def test_a_stage_compiles_its_encoder_before_it_serves():
    torch._dynamo.reset()
    before = graphs()
    boundary = Boundary(width=2048, max_batch=2, max_tokens=2048)
    assert wire_codec(boundary.max_numel).backend == "auto"  # compiled at this size
    prepare(boundary, "int8")
    if codec_module.compile_failure() is not None:
        pytest.skip(f"torch.compile is unavailable here: {codec_module.compile_failure()}")
    built = graphs()
    assert built > before
    for batch, tokens in ((1, 2048), (2, 2048), (1, 1000)):  # a batch of one, a padded one
        pack(torch.randn(batch, tokens, 2048), "int8")
    assert graphs() == built


def test_a_stage_of_small_activations_compiles_nothing():
    """The tiny models of the tests and a laptop's: the eager kernel packs them (a compile
    would cost more than it saves), so nothing is compiled at start or on a call."""
    small = Boundary(width=128, max_batch=4, max_tokens=64)
    assert small.max_numel == 4 * 64 * 128
    assert wire_codec(small.max_numel).backend == "eager"
    assert wire_codec(codec_module.COMPILE_FROM).backend == "auto"
    ids = Boundary(width=0, max_batch=64, max_tokens=2048, vocab=256)
    large = Boundary(width=4096, max_batch=8, max_tokens=2048)
    built = graphs()
    assert prepare(small, "int8") == 0.0
    assert prepare(ids, "int8") == 0.0  # token ids travel raw
    assert prepare(large, "f32") == prepare(large, "bf16") == 0.0
    pack(torch.randn(4, 64, 128), "int8")
    assert graphs() == built
