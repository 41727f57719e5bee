import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swarmloco.core.aggregate import AggregatorConfig, aggregate, centered_clip, trimmed_mean
from swarmloco.core.grouping import part_blocks, weight_violations


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


def test_weight_cap_and_garbage_weights():
    assert weight_violations([100, 120, 90, 110], 10) == {}
    bad = weight_violations([100, 120, 1e9, 110, float("nan"), -1, 0], 10)
    assert set(bad) == {2, 4, 5, 6}
    assert "exceeds 10 x the group median" in bad[2]
    assert "not a finite positive" in bad[4]


def test_trimmed_mean_ignores_two_hostile_of_eight():
    g = torch.Generator().manual_seed(0)
    honest = [torch.randn(1000, generator=g) * 0.01 + 1.0 for _ in range(6)]
    hostile = [h * -1000 for h in honest[:2]]
    out = trimmed_mean(honest + hostile, trim=2)
    lo = torch.stack(honest).amin(0)
    hi = torch.stack(honest).amax(0)
    assert bool(((out >= lo) & (out <= hi)).all())


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
