"""A peer compiles the codec's kernels before it serves, and never again in a round.

A compile takes seconds on this machine and a minute on a fresh GPU box (45-52 s at a
peer's start on the H200 of 2026-11-26): one made during a round stalls the member that
makes it past its peers' patience, one made during a pipeline call misses the caller's
deadline. A compiled kernel is built again whenever its guards fail (the grad mode, the
layout of its inputs' bases), so this checks that what the warm-up built is what a round,
an outer round's encoding and a pipeline's packing run, by counting dynamo's graphs.
"""

import pytest
import torch
from avgutil import averaging_peers, random_vectors, run_round
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


@pytest.fixture
def compiled() -> CodecConfig:
    torch._dynamo.reset()  # what an earlier test compiled would hide a compile here
    config = CodecConfig(block_size=BLOCK, backend="auto", error_feedback=True)
    warm_up(config)
    warm_up(CodecConfig(block_size=BLOCK, backend="auto"))
    if codec_module.compile_failure() is not None:
        pytest.skip(f"torch.compile is unavailable here: {codec_module.compile_failure()}")
    return config


@pytest.mark.timeout(300)
async def test_a_warmed_up_codec_compiles_nothing_in_a_round(compiled):
    built = graphs()
    assert built > 0  # the warm-up compiled
    # An outer round's encoding: slabs of the pseudo-gradient into slices of the message,
    # under no_grad, with error feedback and without.
    shapes = [("a", (700, 1000)), ("b", (90_000,)), ("c", (3000, 1024))]
    for config in (compiled, CodecConfig(block_size=BLOCK, backend="auto")):
        layout = FlatLayout(shapes, [0] * len(shapes), BLOCK)
        state = DilocoState(layout, OuterConfig(), config)
        params = [torch.randn(shape) for _, shape in shapes]
        state.set_global(params)
        for p in params:
            p.add_(0.01)
        assert all(state.encode(f, params) for f in range(state.fragments))
    # A round of four members reducing by the trimmed mean (a public run's).
    averaging = AveragingConfig(
        codec=CodecConfig(block_size=BLOCK, backend="auto"),
        aggregator=AggregatorConfig(method="trimmed_mean", trim=1),
    )
    async with averaging_peers(4, config=averaging) as peers:
        vectors = random_vectors(4, BLOCK * 40, seed=1, block=BLOCK)
        results = await run_round(peers, 1, vectors, [1.0] * 4, timeout=120)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert graphs() == built


def test_a_stage_compiles_its_encoder_before_it_serves(compiled):
    boundary = Boundary(width=2048, max_batch=2, max_tokens=2048)
    assert wire_codec(boundary.max_numel).backend == "auto"  # compiled at this size
    prepare(boundary, "int8")
    built = graphs()
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
