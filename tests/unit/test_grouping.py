import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swarmloco.core.aggregate import (
    AggregatorConfig,
    TrimmedAccumulator,
    aggregate,
    centered_clip,
    trimmed_mean,
)
from swarmloco.core.codec import CodecConfig, CodecError, dequantize, dequantize_trim_one_, quantize
from swarmloco.core.grouping import capped_weights, part_blocks, weight_cap, weight_violations


@given(
    total=st.integers(0, 10_000),
    bandwidths=st.lists(st.sampled_from([0.0, 1.0, 2.5, 10.0, 100.0]), min_size=1, max_size=9),
)
def test_parts_cover_every_block_once_in_proportion(total, bandwidths):
    if sum(bandwidths) == 0:
        with pytest.raises(ValueError, match="at least one member"):
            part_blocks(total, bandwidths)
        return
    parts = part_blocks(total, bandwidths)
    assert len(parts) == len(bandwidths)
    first = 0
    for (start, size), bw in zip(parts, bandwidths):
        assert start == first
        first += size
        if bw == 0:
            assert size == 0  # client mode serves nothing
        assert abs(size - total * bw / sum(bandwidths)) < 1.0
    assert first == total


def test_uneven_parts():
    # Largest remainder, ties to the earlier member.
    assert part_blocks(10, [1, 1, 2]) == [(0, 3), (3, 2), (5, 5)]
    assert part_blocks(7, [1, 0, 1]) == [(0, 4), (4, 0), (4, 3)]


def test_weights_are_capped_at_a_multiple_of_the_lower_median_and_garbage_refused():
    assert weight_violations([100, 120, 90, 110]) == {}
    bad = weight_violations([100, 120, 1e9, 110, float("nan"), -1, 0])
    assert set(bad) == {4, 5, 6} and "not a finite positive" in bad[4]
    assert capped_weights([100, 120, 90, 110], 10) == [100, 120, 90, 110]
    assert capped_weights([100, 120, 1e9, 110], 10) == [100, 120, 1100, 110]
    # A group of two: the heavier member cannot lift the cap with its own claim.
    assert weight_cap([128, 1728], 10) == 1280
    assert capped_weights([128, 1728], 10) == [128, 1280]
    assert capped_weights([128, 1e12], 0) == [128, 1e12]  # 0: no cap
    assert weight_cap([float("nan")], 10) == float("inf")


def test_trimmed_mean_ignores_two_hostile_of_eight():
    g = torch.Generator().manual_seed(0)
    honest = [torch.randn(1000, generator=g) * 0.01 + 1.0 for _ in range(6)]
    hostile = [h * -1000 for h in honest[:2]]
    out = trimmed_mean(honest + hostile, trim=2)
    lo = torch.stack(honest).amin(0)
    hi = torch.stack(honest).amax(0)
    assert bool(((out >= lo) & (out <= hi)).all())


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 40, 100])
def test_order_statistics_match_a_full_sort(n):
    # Selection networks for small groups, torch's sort beyond: the same values either way,
    # ties included (integers drawn from a small range repeat often).
    g = torch.Generator().manual_seed(n)
    chunks = [torch.randint(-3, 4, (2000,), generator=g).float() for _ in range(n)]
    chunks[0][:10] = 1e30  # large values and exact ties with each other
    originals = [c.clone() for c in chunks]
    ordered = torch.stack(chunks).sort(dim=0).values
    for trim in (0, 1, 2, 3):
        t = min(trim, (n - 1) // 2)
        want = ordered[t : n - t].mean(dim=0)
        assert torch.allclose(trimmed_mean(chunks, trim), want, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(c, o) for c, o in zip(chunks, originals))  # inputs untouched


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 9, 17])
@pytest.mark.parametrize("trim", [0, 1, 2, 3])
def test_the_streamed_trimmed_mean_equals_the_buffered_one(n, trim):
    # Rows arrive one at a time, ties and a far-off row included; fewer rows than
    # 2 * trim + 1 trim fewer. Only the order of the additions may differ.
    g = torch.Generator().manual_seed(100 * n + trim)
    rows = [torch.randint(-3, 4, (2000,), generator=g).float() for _ in range(n)]
    rows[n // 2][:10] = 1e30
    rows[0] += torch.randn(2000, generator=g)
    acc = TrimmedAccumulator(trim)
    for row in rows:
        buffer = acc.buffer(row.numel())
        buffer.copy_(row)
        acc.add(buffer)
    assert acc.count == n
    want = trimmed_mean(rows, trim)
    assert torch.allclose(acc.result(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "auto"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_the_fused_trim_of_one_equals_the_trimmed_mean_of_the_decoded_rows(backend, n):
    # One pass per quantized row (what a reducer of a public run does), compiled or not.
    codec = CodecConfig(backend=backend)
    g = torch.Generator().manual_seed(n)
    rows = [torch.randn(codec.block_size * 8, generator=g) for _ in range(n)]
    rows[0][: codec.block_size] *= 1e20  # one block far off
    rows[-1][-5:] = 0.0  # ties
    encoded = [quantize(row, codec) for row in rows]
    decoded = [dequantize(q, s, codec.block_size, "eager") for q, s in encoded]
    acc = TrimmedAccumulator(1)
    for q, s in encoded:
        acc.add_quantized(q, s, codec)
    assert acc.count == n
    assert torch.allclose(acc.result(), trimmed_mean(decoded, 1), rtol=1e-6, atol=1e-6)


def test_the_fused_trim_refuses_bad_scales_and_mismatched_buffers():
    codec = CodecConfig()
    q, s = quantize(torch.randn(codec.block_size * 4), codec)
    n = q.numel()
    hi, lo, middle = torch.empty(n), torch.empty(n), torch.empty(n)
    with pytest.raises(CodecError, match="scales must be finite"):
        dequantize_trim_one_(hi, lo, middle, q, torch.full_like(s, math.nan), codec, taken=0)
    with pytest.raises(CodecError, match="smallest values has"):
        dequantize_trim_one_(hi, lo[: n - codec.block_size], middle, q, s, codec, taken=1)
    with pytest.raises(CodecError, match="largest values must be float32"):
        dequantize_trim_one_(hi.double(), lo, middle, q, s, codec, taken=2)
    with pytest.raises(ValueError, match="taken"):
        dequantize_trim_one_(hi, lo, middle, q, s, codec, taken=-1)
    dequantize_trim_one_(hi, lo, middle, q, s, codec, taken=0)
    assert torch.equal(hi, dequantize(q, s, codec.block_size, "eager"))  # one row: the largest


def test_a_huge_value_cannot_cancel_the_streamed_trimmed_mean():
    # Kept out of the sum, not subtracted from it: 1e30 + 1 - 1e30 would be 0 in float32.
    acc = TrimmedAccumulator(1)
    for value in (1.0, 1e30, 2.0, 3.0, -1e30):
        acc.add(torch.full((4,), value))
    assert torch.equal(acc.result(), torch.full((4,), 2.0))


def _centered_clip_reference(chunks, weights, iterations):
    """The algorithm as written (Alg. 2), in float64, forming every difference: from the
    weighted medoid, tau the median distance of the others to it."""
    x = torch.stack(chunks).double()
    w = torch.tensor(weights, dtype=torch.float64)
    w = w / w.sum()
    distances = torch.cdist(x, x)
    c = int(torch.argmin(distances @ w))
    v = x[c]
    tau = float(torch.cat([distances[c, :c], distances[c, c + 1 :]]).median())
    for _ in range(iterations):
        diff = x - v
        scale = torch.clamp(tau / torch.linalg.vector_norm(diff, dim=1), max=1.0)
        v = v + (w * scale) @ diff
    return v


@pytest.mark.parametrize("case", ["honest", "one-far", "near-float32-max", "nearly-equal"])
def test_centered_clip_matches_the_algorithm_as_written(case):
    g = torch.Generator().manual_seed(7)
    chunks = [torch.randn(5000, generator=g) for _ in range(5)]
    weights = [1.0, 2.0, 1.0, 1.0, 3.0]
    if case == "one-far":
        chunks[4] = chunks[4] * -1000
    elif case == "near-float32-max":  # squares overflow float32: the float64 path
        chunks = [c.clamp(-1, 1) * 6e37 for c in chunks]
    elif case == "nearly-equal":
        chunks = [chunks[0] + 1e-4 * c for c in chunks]
    want = _centered_clip_reference(chunks, weights, iterations=50)
    for rows in (chunks, torch.stack(chunks)):  # a list of rows, or a reducer's 2-D rows
        got = centered_clip(rows, weights, iterations=50).double()
        assert torch.isfinite(got).all()
        error = torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)
        assert float(error) < 1e-5
    # Few iterations from the start: the same steps as the algorithm as written.
    few = _centered_clip_reference(chunks, weights, iterations=2)
    got = centered_clip(chunks, weights, iterations=2).double()
    assert float(torch.linalg.vector_norm(got - few) / torch.linalg.vector_norm(few)) < 1e-5


def test_centered_clip_bounds_hostile_influence():
    g = torch.Generator().manual_seed(1)
    honest = [torch.randn(1000, generator=g) * 0.01 + 1.0 for _ in range(6)]
    hostile = [h * -1000 for h in honest[:2]]
    out = centered_clip(honest + hostile, [1.0] * 8, iterations=20)
    honest_mean = torch.stack(honest).mean(0)
    spread = float(torch.linalg.vector_norm(torch.stack(honest) - honest_mean, dim=1).max())
    assert float(torch.linalg.vector_norm(out - honest_mean)) <= spread
    plain = aggregate(honest + hostile, [1.0] * 8, AggregatorConfig())
    assert float(torch.linalg.vector_norm(plain - honest_mean)) > 100 * spread


def test_config_validation():
    with pytest.raises(ValueError, match="aggregator"):
        AggregatorConfig(method="median")  # type: ignore[arg-type]
