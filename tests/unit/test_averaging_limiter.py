"""The token-bucket limiter keeps its rate, lets bursts through and serves in order."""

import asyncio

import pytest

from swarmloco.net.averaging.limiter import MBIT, BandwidthConfig, BandwidthLimiter, TokenBucket


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


async def test_the_rate_holds_within_one_burst():
    t = FakeTime()
    bucket = TokenBucket(1000.0, 100.0, clock=t.clock, sleep=t.sleep)
    for _ in range(50):
        await bucket.take(200)  # larger than the burst: runs into debt, paid off later
    # 10,000 bytes at 1,000 B/s, less the initial burst of 100.
    assert t.now == pytest.approx(9.9)
    assert bucket.waited_s == pytest.approx(9.9)


async def test_waiters_are_served_first_come_first_served():
    t = FakeTime()
    bucket = TokenBucket(100.0, 10.0, clock=t.clock, sleep=t.sleep)
    order = []

    async def take(name: str, amount: int) -> None:
        await bucket.take(amount)
        order.append(name)

    await asyncio.gather(take("a", 100), take("b", 1), take("c", 100))
    assert order == ["a", "b", "c"]


async def test_no_limit_means_no_wait():
    limiter = BandwidthLimiter(BandwidthConfig())
    await limiter.upload(10**12)
    await limiter.download(10**12)


def test_config_in_megabits():
    config = BandwidthConfig.mbit(100)
    assert config.upload_bytes_per_s == config.download_bytes_per_s == 100 * MBIT == 12.5e6
    with pytest.raises(ValueError):
        BandwidthConfig(upload_bytes_per_s=-1)
