"""The ``stage-load`` records of a pipelined run and what a driver makes of them: a record
that is not what its kind says is refused, a claimed rate counts at most as the best a
driver measured itself, the queue a replica declares lowers its draw, and the fresh
records become the replicas a driver draws from (pipeline/load.py, pipeline/driver.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time

import msgpack
import pytest
import torch

from swarmloco.net.identity import Identity
from swarmloco.net.records import Record, make_record, sign, stage_load_key, validate
from swarmloco.net.rejections import Rejection
from swarmloco.pipeline.driver import Driver, DriverConfig, HopStats
from swarmloco.pipeline.load import StageLoad, fresh, stage_load
from swarmloco.pipeline.replica import RATE_SETTLE, RATE_WARMUP, ReplicaConfig, StageReplica
from swarmloco.pipeline.wire import Boundary

SWARM = "cd" * 20
NOW = 1_800_000_000.0


def value(**changes: object) -> dict[str, object]:
    return {
        "stage": 1,
        "endpoint": "127.0.0.1:4000",
        "rate": 50.0,
        "queue": 2,
        "free": 62,
        "at": NOW,
    } | changes


def load(endpoint: str, stage: int = 1, **changes: object) -> StageLoad:
    fields = value(stage=stage, endpoint=endpoint, **changes)
    return stage_load(hashlib.sha1(endpoint.encode()).hexdigest(), fields)  # a peer per endpoint


def test_a_replicas_record_is_checked_against_its_kind_and_signature():
    owner = Identity.generate()
    key = stage_load_key(SWARM)
    good = make_record(key, value(), expiration=time.time() + 60, owner=owner)
    decoded = validate(good, now=time.time())
    assert stage_load(good.subkey, decoded).rate == 50.0
    assert stage_load(good.subkey, decoded).round is None  # a peer that said none
    rounded = make_record(key, value(round=7), expiration=time.time() + 60, owner=owner)
    assert stage_load(rounded.subkey, validate(rounded, now=time.time())).round == 7
    counted = make_record(key, value(refused=3, skipped=1, distrusted=2),
                          expiration=time.time() + 60, owner=owner)  # fmt: skip
    said = stage_load(counted.subkey, validate(counted, now=time.time()))
    assert (said.refused, said.skipped, said.distrusted) == (3, 1, 2)
    assert stage_load(good.subkey, decoded).distrusted == 0
    served = make_record(key, value(drivers=3, orphaned=4), expiration=time.time() + 60,
                         owner=owner)  # fmt: skip
    said = stage_load(served.subkey, validate(served, now=time.time()))
    assert (said.drivers, said.orphaned) == (3, 4)
    assert (
        stage_load(good.subkey, decoded).drivers,
        stage_load(good.subkey, decoded).orphaned,
    ) == (
        0,
        0,
    )
    assert (stage_load(good.subkey, decoded).refused, stage_load(good.subkey, decoded).skipped) == (
        0,
        0,
    )
    for bad in (
        value(round=-1),
        value(refused=-1),
        value(skipped=1.5),
        value(distrusted=-1),
        value(drivers=-1),
        value(orphaned=0.5),
        value(stage=256),
        value(rate=math.nan),
        value(rate=-1.0),
        value(queue=-1),
        value(rate=5),  # an int where a float belongs
        value(endpoint="no port"),
        value(extra=1),
    ):
        raw = Record(key, owner.peer_id_hex, msgpack.packb(bad), time.time() + 60)
        with pytest.raises(Rejection):
            validate(sign(raw, owner), now=time.time())
    forged = dataclasses.replace(good, subkey=Identity.generate().peer_id_hex)
    with pytest.raises(Rejection):
        validate(forged, now=time.time())


def test_a_claimed_rate_counts_at_most_as_the_best_measured_and_a_queue_lowers_a_draw():
    stats = HopStats()
    assert stats.weight("new") == 1.0  # nothing known: tried like any other
    stats.claims["liar"] = load("liar", rate=1e9)
    assert stats.weight("liar") == pytest.approx(1e9 / 3)  # nothing measured to cap it yet
    stats.measured("honest", 8, 1.0)  # 8 sequences a second, measured by a call
    assert stats.weight("honest") == 8.0
    assert stats.weight("liar") == pytest.approx(8.0 / 3)  # capped, over 1 + its queue of 2
    stats.claims["slow"] = load("slow", rate=2.0, queue=0)
    assert stats.weight("slow") == 2.0  # a lower claim counts as said
    stats.measured("liar", 1, 1.0)
    assert stats.weight("liar") == pytest.approx(1.0 / 3)  # measured: the claim is moot
    stats.busy["honest"] += 1
    assert stats.weight("honest") == 4.0


def driver_of(replicas: list[list[str]]) -> Driver:
    """A driver that makes no call (what it draws from is all that is tested)."""
    acts = Boundary(width=4, max_batch=2, max_tokens=4)
    first = StageReplica(torch.nn.Linear(4, 4), first=True, last=False)
    return Driver(
        None,  # type: ignore[arg-type]
        first,
        swarm_id=SWARM,
        replicas=replicas,
        boundaries=[acts] * len(replicas),
        ids=acts,
    )


def test_fresh_records_become_the_replicas_a_driver_draws_from():
    driver = driver_of([["old:1"], ["old:2"]])
    loads = [
        load("a:1", stage=1),
        load("b:1", stage=1),
        load("a:1", stage=1),  # said twice: drawn once
        load("zero:1", stage=0),  # stage 0 is the drivers': never a hop
        load("far:1", stage=7),  # no such stage
        load("", stage=2),  # serves nothing
        load("stale:1", stage=2, at=NOW - 3600),
    ]
    driver.update(fresh(loads, NOW))
    assert driver.replicas == [["a:1", "b:1"], ["old:2"]]  # stage 2: none fresh, kept
    assert set(driver.stats.claims) == {"a:1", "b:1"}
    assert fresh([load("future:1", at=NOW + 60)], NOW) == []


def test_many_keys_on_one_network_cannot_crowd_out_a_stages_other_replicas():
    """Forty records of one /24 (one machine's many keys and ports) and two honest
    replicas elsewhere: the driver draws from at most four of that network, the ones it
    measured first, and from every honest one; loopback addresses count one by one."""
    driver = driver_of([[]])
    sybils = [f"93.184.216.{i % 250}:{4000 + i}" for i in range(40)]
    honest = ["151.101.1.7:31337", "[2a00:1450::1]:31337"]
    driver.stats.measured(sybils[30], 8, 1.0)  # the driver called this one: it is kept
    driver.update(fresh([load(e) for e in [*sybils, *honest]], NOW))
    (drawn,) = driver.replicas
    assert [e for e in drawn if e.startswith("93.184.216.")] == [*sybils[:3], sybils[30]]
    assert drawn[-2:] == honest
    assert set(driver.stats.claims) == set(drawn)  # the rest are not kept at all
    local = [f"127.0.0.{i}:5000" for i in range(1, 9)]
    driver.update(fresh([load(e) for e in local], NOW))
    assert driver.replicas == [local] and set(driver.stats.claims) == set(local)
    with pytest.raises(ValueError, match="replicas_per_network"):
        DriverConfig(replicas_per_network=0)


def test_a_replica_measures_its_own_rate_and_says_what_it_holds():
    replica = StageReplica(
        torch.nn.Linear(4, 4), first=False, last=False, config=ReplicaConfig(max_inflight=3)
    )
    assert replica.load() == {"rate": 0.0, "queue": 0, "free": 3}
    replica.forward(b"a" * 16, torch.randn(2, 4))
    replica.forward(b"b" * 16, torch.randn(2, 4))
    assert replica.load()["queue"] == 2 and replica.load()["free"] == 1
    replica.backward(b"a" * 16, torch.ones(2, 4))
    said = replica.load()
    assert said["rate"] == 0.0 and said["queue"] == 1 and said["free"] == 2
    # Its warm-up is not in its rate, and it says none until it measured enough.
    replica.backward(b"b" * 16, torch.ones(2, 4))
    for k in range(RATE_WARMUP + RATE_SETTLE - 3):
        key = bytes([k]) * 16
        replica.forward(key, torch.randn(2, 4))
        replica.backward(key, torch.ones(2, 4))
        assert replica.load()["rate"] == 0.0
    replica.forward(b"c" * 16, torch.randn(2, 4))
    replica.backward(b"c" * 16, torch.ones(2, 4))
    assert replica.load()["rate"] > 0 and replica.rate.steps == RATE_WARMUP + RATE_SETTLE


def test_a_joining_peer_takes_the_stage_with_the_fewest_peers_the_later_on_a_tie():
    from swarmloco.pipeline.rebalance import choose_stage

    assert choose_stage([], 3) == 2  # nobody yet: the last stage (drivers need the rest)
    served = [load("a:1", stage=2), load("b:1", stage=1)]
    assert choose_stage(served, 3) == 0
    one = stage_load("cd" * 20, value(stage=0, endpoint="c:1"))
    assert choose_stage([*served, one], 3) == 2
    # A peer counts once however often it said so; records of no such stage count nowhere.
    again = [load("b:1", stage=1), load("b:1", stage=1), load("x:1", stage=9)]
    assert choose_stage(again, 3) == 2 and choose_stage(again, 2) == 0


def test_a_draining_replica_refuses_new_micro_batches_and_finishes_those_in_flight():
    import threading

    replica = StageReplica(
        torch.nn.Linear(4, 4), first=False, last=False, config=ReplicaConfig(max_inflight=3)
    )
    replica.forward(b"a" * 16, torch.randn(2, 4))
    replica.forward(b"b" * 16, torch.randn(2, 4))
    assert replica.drain(timeout=0.0) == 2  # no wait: both still in flight
    with pytest.raises(Rejection, match="moving to another stage"):
        replica.forward(b"c" * 16, torch.randn(2, 4))
    assert replica.load()["free"] == 0  # its record tells drivers to draw others
    left: list[int] = []
    waiting = threading.Thread(target=lambda: left.append(replica.drain(timeout=120.0)))
    waiting.start()
    replica.backward(b"a" * 16, torch.ones(2, 4))  # backwards still go on
    replica.backward(b"b" * 16, torch.ones(2, 4))
    waiting.join(timeout=120.0)
    assert left == [0] and replica.served == 2


def test_a_replica_measured_slow_once_is_still_drawn_to_be_measured_again():
    # Its first forward waited for its round (2 s), the other's took 20 ms: by the rates
    # alone it would be drawn 1% of the time, take no steps and miss its stage's rounds.
    import random

    from swarmloco.pipeline.driver import EXPLORE, Driver
    from swarmloco.pipeline.wire import Boundary

    ids = Boundary(width=0, max_batch=4, max_tokens=8, vocab=16)
    driver = Driver(
        None,  # type: ignore[arg-type]  # drawing calls nobody
        None,  # type: ignore[arg-type]
        swarm_id="ab" * 20,
        replicas=[["fast:1", "slow:1"]],
        boundaries=[Boundary(width=8, max_batch=4, max_tokens=8)],
        ids=ids,
        rng=random.Random(0),
    )
    driver.stats.measured("fast:1", 4, 0.02)
    driver.stats.measured("slow:1", 4, 2.0)
    draws = [driver._draw(1, set()) for _ in range(4000)]
    share = draws.count("slow:1") / len(draws)
    assert abs(share - EXPLORE / (1 + EXPLORE)) < 0.02, share  # not 1%
    driver.stats.measured("slow:1", 4, 0.02)  # measured again: back to its share
    driver.stats.measured("slow:1", 4, 0.02)
    assert driver.stats.weight("slow:1") > 0.3 * driver.stats.weight("fast:1")
