import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swarmloco.core import codec
from swarmloco.core.codec import CodecConfig
from swarmloco.errors import CodecError

EAGER = CodecConfig(backend="eager")


def _vector(seed: int, numel: int, scale_exp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * (10.0**scale_exp)
    # Heavy tails and exact zeros: blocks where one element dominates.
    x[:: max(numel // 7, 1)] *= 50
    x[1 :: max(numel // 5, 1)] = 0
    return x


@given(
    seed=st.integers(0, 2**31 - 1),
    blocks=st.integers(1, 9),
    block_size=st.sampled_from([16, 64, 1024]),
    scale_exp=st.integers(-30, 30),
)
def test_error_within_half_a_step_per_block(seed, blocks, block_size, scale_exp):
    cfg = CodecConfig(block_size=block_size, backend="eager")
    x = _vector(seed, blocks * block_size, scale_exp)
    q, s = codec.quantize(x, cfg)
    y = codec.dequantize(q, s, block_size, "eager")
    err = (x - y).abs().view(blocks, block_size).amax(1)
    absmax = x.abs().view(blocks, block_size).amax(1)
    # |x - q s| <= s / 2 = absmax / 254, up to fp32 rounding of s and of the product.
    bound = absmax / 254 * (1 + 1e-5) + absmax * 2**-23
    assert bool((err <= bound).all()), (err / absmax.clamp_min(1e-38)).max()


@given(
    # Up to about 500k values: three dimensions of up to 700 made tensors of 1.4 GB.
    shape=st.one_of(
        st.lists(st.integers(1, 700), min_size=1, max_size=2),
        st.lists(st.integers(1, 60), min_size=3, max_size=3),
    ),
    block_size=st.sampled_from([16, 100, 1024]),
    seed=st.integers(0, 1000),
)
def test_round_trip_any_shape(shape, block_size, seed):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    enc = codec.encode(x, CodecConfig(block_size=block_size, backend="eager"))
    assert enc.payload.numel() == codec.padded_numel(x.numel(), block_size)
    assert enc.scales.numel() == math.ceil(x.numel() / block_size)
    y = codec.decode(enc, "eager")
    assert y.shape == x.shape
    assert float((x - y).abs().max()) <= float(x.abs().max()) / 254 * (1 + 1e-5)


def test_chunks_decode_on_their_own():
    cfg = CodecConfig(block_size=64, chunk_bytes=64 * 5 + 40, backend="eager")
    numel = 64 * 23 - 17
    x = torch.zeros(codec.padded_numel(numel, 64))
    x[:numel] = torch.randn(numel)
    q, s = codec.quantize(x, cfg)
    whole = codec.dequantize(q, s, 64, "eager")
    spans = codec.chunk_spans(numel, cfg)
    assert [sp.blocks for sp in spans] == [5, 5, 5, 5, 3]
    assert spans[-1].stop == x.numel()
    for sp in spans:
        part_q = q[sp.start : sp.stop].clone()
        part_s = s[sp.first_block : sp.first_block + sp.blocks].clone()
        assert torch.equal(codec.dequantize(part_q, part_s, 64, "eager"), whole[sp.start : sp.stop])
        # Encoding the chunk alone gives the same bytes as the slice of the whole encoding.
        alone_q, alone_s = codec.quantize(x[sp.start : sp.stop].clone(), cfg)
        assert torch.equal(alone_q, part_q) and torch.equal(alone_s, part_s)


def test_chunk_size_is_about_one_mebibyte():
    cfg = CodecConfig()
    spans = codec.chunk_spans(25_000_000, cfg)
    sizes = {sp.blocks * (cfg.block_size + cfg.scale_bytes) for sp in spans[:-1]}
    assert all(0.99 * 2**20 <= b <= 2**20 for b in sizes)
    assert sum(sp.numel for sp in spans) == codec.padded_numel(25_000_000, cfg.block_size)


@pytest.mark.parametrize("backend", ["eager", "auto"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_rejected(bad, backend):
    # A reducer relies on this to refuse a mean that is not finite, compiled or not.
    cfg = CodecConfig(backend=backend)
    x = torch.randn(4096)
    x[3000] = bad
    x[3001] = 1e30  # a larger finite value in the same block does not hide it
    with pytest.raises(CodecError, match=r"NaN or Inf.*block 2"):
        codec.quantize(x, cfg)
    with pytest.raises(CodecError, match=r"NaN or Inf.*block 2"):
        codec.quantize(x, cfg, out=(torch.empty(4096, dtype=torch.int8), torch.empty(4)))
    with pytest.raises(CodecError, match="NaN or Inf"):
        codec.encode(x.view(64, 64), cfg)


def test_decode_rejects_bad_scales_and_sizes():
    q, s = codec.quantize(torch.randn(2048), EAGER)
    bad = s.clone()
    bad[1] = float("nan")
    with pytest.raises(CodecError, match="finite"):
        codec.dequantize(q, bad, 1024, "eager")
    with pytest.raises(CodecError, match="finite"):
        codec.dequantize(q, -s, 1024, "eager")
    # Finite, but 127 times it is not: decoding valid input never yields Inf.
    with pytest.raises(CodecError, match="at most"):
        codec.dequantize(q, torch.full_like(s, 3e38), 1024, "eager")
    assert torch.isfinite(
        codec.dequantize(q.fill_(-128), torch.full_like(s, codec.MAX_SCALE), 1024, "eager")
    ).all()
    with pytest.raises(CodecError, match="expected 2 scales"):
        codec.dequantize(q, s[:1], 1024, "eager")
    with pytest.raises(CodecError, match="multiple of the block size"):
        codec.dequantize(q[:1000], s, 1024, "eager")
    with pytest.raises(CodecError, match="int8"):
        codec.dequantize(q.to(torch.int16), s, 1024, "eager")
    acc = torch.zeros(2048)
    with pytest.raises(CodecError, match="weight must be finite"):
        codec.dequantize_accumulate_(acc, q, s, float("inf"), EAGER)
    with pytest.raises(CodecError, match="elements"):
        codec.dequantize_accumulate_(torch.zeros(1024), q, s, 1.0, EAGER)


def test_accumulate_is_a_weighted_sum_of_decodes():
    xs = [torch.randn(3072) for _ in range(3)]
    weights = [0.5, 0.25, 0.25]
    acc = torch.zeros(3072)
    expected = torch.zeros(3072)
    for x, w in zip(xs, weights):
        q, s = codec.quantize(x, EAGER)
        codec.dequantize_accumulate_(acc, q, s, w, EAGER)
        expected += w * codec.dequantize(q, s, 1024, "eager")
    torch.testing.assert_close(acc, expected, rtol=1e-6, atol=1e-7)


def test_fp16_scales_keep_the_bound_and_cost_less():
    cfg = CodecConfig(scale_dtype="float16", backend="eager")
    x = torch.randn(8192) * 3
    q, s = codec.quantize(x, cfg)
    assert s.dtype == torch.float16
    y = codec.dequantize(q, s, 1024, "eager")
    absmax = x.abs().view(8, 1024).amax(1)
    err = (x - y).abs().view(8, 1024).amax(1)
    assert bool((err <= absmax * (1 / 254 + 2**-10)).all())
    assert cfg.wire_bytes(1024 * 1024) < CodecConfig().wire_bytes(1024 * 1024)


def test_wire_cost_per_element():
    assert CodecConfig().wire_bytes(1024 * 1000) / (1024 * 1000) == pytest.approx(1.0039, abs=1e-4)
    assert CodecConfig(scale_dtype="float16").wire_bytes(1024) / 1024 == pytest.approx(
        1.00195, abs=1e-5
    )


def test_error_feedback_carries_the_residual_and_rolls_back():
    numel = 4096
    ef = codec.ErrorFeedback(numel, EAGER)
    g = torch.Generator().manual_seed(0)
    sent = torch.zeros(numel)
    total = torch.zeros(numel)
    for _ in range(20):
        x = torch.randn(numel, generator=g) * 1e-3
        total += x
        q, s = ef.encode(x)
        ef.commit()
        sent += codec.dequantize(q, s, 1024, "eager")
    # What was sent plus what is still owed is exactly what was asked to be sent.
    torch.testing.assert_close(sent + ef.residual, total, rtol=0, atol=1e-8)
    before = ef.residual.clone()
    ef.encode(torch.randn(numel, generator=g))
    assert not torch.equal(ef.residual, before)
    ef.rollback()
    assert torch.equal(ef.residual, before)


def test_error_feedback_rejects_nan_without_touching_the_residual():
    ef = codec.ErrorFeedback(2048, EAGER)
    ef.encode(torch.randn(2048))
    before = ef.residual.clone()
    bad = torch.randn(2048)
    bad[7] = float("nan")
    with pytest.raises(CodecError):
        ef.encode(bad)
    assert torch.equal(ef.residual, before)


def test_config_validation():
    with pytest.raises(ValueError, match="block_size"):
        CodecConfig(block_size=3)
    with pytest.raises(ValueError, match="scale_dtype"):
        CodecConfig(scale_dtype="bfloat16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend"):
        CodecConfig(backend="fast")  # type: ignore[arg-type]


def test_compiled_and_eager_give_the_same_bits():
    compiled = CodecConfig(backend="auto")
    x = _vector(7, 1024 * 37, -3)
    q1, s1 = codec.quantize(x, EAGER)
    q2, s2 = codec.quantize(x, compiled)
    assert torch.equal(q1, q2) and torch.equal(s1, s2)
    assert torch.equal(
        codec.dequantize(q1, s1, 1024, "eager"), codec.dequantize(q2, s2, 1024, "auto")
    )
    acc1, acc2 = torch.ones(x.numel()), torch.ones(x.numel())
    codec.dequantize_accumulate_(acc1, q1, s1, 0.3, EAGER)
    codec.dequantize_accumulate_(acc2, q2, s2, 0.3, compiled)
    torch.testing.assert_close(acc1, acc2, rtol=0, atol=1e-6)
    out1, out2 = torch.full((x.numel(),), 5.0), torch.empty(x.numel())
    codec.dequantize_into_(out1, q1, s1, EAGER)
    codec.dequantize_into_(out2, q2, s2, compiled)
    assert torch.equal(out1, codec.dequantize(q1, s1, 1024, "eager"))
    assert torch.equal(out1, out2)
    bad = x.clone()
    bad[5] = float("nan")
    with pytest.raises(CodecError):
        codec.quantize(bad, compiled)


def test_decode_into_overwrites_with_weight_and_checks_like_decode():
    x = _vector(3, 1024 * 4, 1)
    q, s = codec.quantize(x, EAGER)
    out = torch.full((x.numel(),), float("nan"))
    codec.dequantize_into_(out, q, s, EAGER, weight=0.25)
    assert torch.equal(out, codec.dequantize(q, s, 1024, "eager") * 0.25)
    with pytest.raises(CodecError):
        codec.dequantize_into_(torch.empty(1024), q, s, EAGER)
    with pytest.raises(CodecError):
        codec.dequantize_into_(out, q, torch.full_like(s, float("inf")), EAGER)
    with pytest.raises(CodecError):
        codec.dequantize_into_(out, q, s, EAGER, weight=float("nan"))


def test_auto_runs_eager_kernels_for_a_vector_too_small_to_repay_the_compile():
    small, large = codec.COMPILE_FROM - 1, codec.COMPILE_FROM
    assert codec.settle_backend(CodecConfig(), small).backend == "eager"
    assert codec.settle_backend(CodecConfig(), large).backend == "auto"
    for explicit in ("compiled", "eager"):  # a peer's own choice is kept at any size
        config = CodecConfig(backend=explicit)
        assert codec.settle_backend(config, small).backend == explicit
        assert codec.settle_backend(config, large).backend == explicit
    settled = codec.settle_backend(CodecConfig(block_size=128), small)
    assert settled == CodecConfig(block_size=128, backend="eager")  # nothing else changes
