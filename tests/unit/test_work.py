"""Proofs of work on keys (net/work.py): what they cost to make, to check, and to fake."""

import time

import pytest

from swarmloco.core.manifest import SwarmManifest, identity_work_for
from swarmloco.errors import ManifestError
from swarmloco.net import work
from swarmloco.net.admission import Admission, gate_of
from swarmloco.net.identity import Identity
from swarmloco.net.rejections import Rejection
from swarmloco.net.work import (
    NONCE_BYTES,
    CheckBudget,
    IdentityWork,
    load_or_solve,
    solve,
    work_bits,
)

SWARM = "9c" * 20


def test_a_solved_nonce_proves_its_bits_for_its_key_and_swarm_only():
    key = Identity.generate()
    nonce = solve(SWARM, key.peer_id, 4)
    assert len(nonce) == NONCE_BYTES and work_bits(SWARM, key.peer_id, nonce) >= 4
    gate = IdentityWork(swarm_id=SWARM, bits=4)
    gate.check(key.peer_id_hex, nonce)
    # Another key, or the same key in another swarm, proves nothing with it (most of the
    # time: a nonce proves 4 bits for a random key one time in 16, so take 64 of them).
    others = [Identity.generate() for _ in range(64)]
    assert sum(gate.admits(o.peer_id_hex, nonce) for o in others) < 16
    elsewhere = IdentityWork(swarm_id="7d" * 20, bits=4)
    tries = [solve(SWARM, k.peer_id, 4) for k in others[:16]]
    assert sum(elsewhere.admits(k.peer_id_hex, n) for k, n in zip(others, tries)) < 8


def test_a_proof_is_checked_once_and_garbage_is_refused_without_a_crash():
    key = Identity.generate()
    nonce = solve(SWARM, key.peer_id, 6)
    gate = IdentityWork(swarm_id=SWARM, bits=6)
    for _ in range(10):
        gate.check(key.peer_id_hex, nonce)
    assert gate.checked == 1
    # A made-up 8-byte nonce proves 6 bits one time in 64: take one that does not.
    wrong = next(n for i in range(256) if work_bits(SWARM, key.peer_id, n := bytes([i]) * 8) < 6)
    for credential in (b"", b"x" * 7, b"x" * 9, wrong):
        with pytest.raises(Rejection) as refused:
            gate.check(key.peer_id_hex, credential)
        assert refused.value.code == "unproven"
    with pytest.raises(Rejection):
        gate.check("not hex", nonce)


def test_a_flood_of_made_up_proofs_costs_a_bounded_number_of_checks():
    now = [0.0]
    gate = IdentityWork(swarm_id=SWARM, bits=8, clock=lambda: now[0])
    keys = [Identity.generate().peer_id_hex for _ in range(400)]
    refused_unchecked = 0
    for k in keys:
        try:
            gate.check(k, b"\x01" * 8)  # one key in 256 is lucky: proven by chance
        except Rejection as refused:
            refused_unchecked += "busy" in refused.reason
    # One network's burst is spent, the rest refused unchecked; a second later, 40 more
    # are checked (a network alone has the whole rate).
    assert gate.checked == 50 and refused_unchecked == 350
    now[0] += 1.0
    for k in keys:
        gate.admits(k, b"\x02" * 8)
    assert gate.checked == 90


def flood(budget: CheckBudget, now: list[float], *, floods: list[str], seconds: float):
    """Each network of ``floods`` asks 400 checks a second; a newcomer network (a new one
    every time, or one that asks nothing else) shows one proof every half second. The
    checks each network got, and how many of the newcomers' were refused."""
    got = dict.fromkeys(floods, 0)
    refused = 0
    for step in range(int(400 * seconds)):
        now[0] += 1 / 400
        for network in floods:
            got[network] += budget.spend(network)
        if step % 200 == 0:
            refused += not budget.spend(f"203.0.{step // 200}.0/24")
    return got, refused


@pytest.mark.parametrize("attackers", [1, 3, 8])
def test_floods_from_a_few_networks_leave_every_newcomers_proof_checked_at_once(attackers):
    now = [0.0]
    budget = CheckBudget(clock=lambda: now[0])
    floods = [f"198.51.{i}.0/24" for i in range(attackers)]
    got, refused = flood(budget, now, floods=floods, seconds=20.0)
    assert refused == 0
    # Within the cap in all (burst and 40/s), each flood its share and no more.
    assert sum(got.values()) + 40 <= 200 + 40 * 20
    assert max(got.values()) <= 50 + 40 * 20 / attackers + 1


def test_a_network_alone_has_the_whole_rate_and_shares_it_once_another_asks():
    now = [0.0]
    budget = CheckBudget(clock=lambda: now[0])
    assert sum(budget.spend("198.51.0.0/24") for _ in range(100)) == 50
    now[0] += 1.0
    assert sum(budget.spend("198.51.0.0/24") for _ in range(100)) == 40
    now[0] += 1.0  # two networks asking: 20 a second each
    assert sum(budget.spend("198.51.1.0/24") for _ in range(100)) == 50
    assert sum(budget.spend("198.51.0.0/24") for _ in range(100)) == 20
    now[0] += 1.0
    assert sum(budget.spend(n) for n in ("198.51.0.0/24", "198.51.1.0/24") * 50) == 40


def test_the_networks_a_budget_tracks_are_bounded_and_forgotten_once_full_again():
    now = [0.0]
    budget = CheckBudget(networks=8, clock=lambda: now[0])
    for i in range(100):
        budget.spend(f"198.51.{i}.0/24")
    assert budget.networks == 8
    now[0] += 60.0
    budget.spend("198.51.0.0/24")
    assert budget.networks == 1


def test_made_up_proofs_never_push_a_proven_key_out(monkeypatch):
    monkeypatch.setattr(work, "_REFUTED", 4)
    key = Identity.generate()
    nonce = solve(SWARM, key.peer_id, 4)
    gate = IdentityWork(swarm_id=SWARM, bits=4)
    gate.check(key.peer_id_hex, nonce)
    strangers = [Identity.generate().peer_id_hex for _ in range(20)]
    for i, stranger in enumerate(strangers):
        gate.admits(stranger, i.to_bytes(8, "big"), network=f"198.51.{i}.0/24")
    checked = gate.checked
    gate.check(key.peer_id_hex, nonce)  # still known: not checked again
    assert gate.checked == checked
    assert len(gate._refuted) == 4


def test_the_proof_is_kept_and_made_once(tmp_path):
    key = Identity.generate()
    path = tmp_path / "swarms" / SWARM / "work"
    started = time.process_time()
    first = load_or_solve(path, SWARM, key.peer_id, 6)
    assert path.read_text().strip() == first.hex()
    again = load_or_solve(path, SWARM, key.peer_id, 6)
    assert again == first
    # A kept proof for fewer bits (the run asks more now) or garbage is made again.
    path.write_text("zz\n")
    assert work_bits(SWARM, key.peer_id, load_or_solve(path, SWARM, key.peer_id, 6)) >= 6
    assert time.process_time() - started < 60


def test_a_public_run_asks_for_work_by_default_and_a_private_one_for_certificates():
    assert identity_work_for(None, private=False) == 8
    assert identity_work_for(None, private=True) == 0
    assert identity_work_for(0, private=False) == 0
    creator = Identity.generate()
    public = SwarmManifest(task="t", model={}, data={}, hparams={}, identity_work=4)
    assert SwarmManifest.from_bytes(public.to_bytes()) == public
    open_run = SwarmManifest(task="t", model={}, data={}, hparams={})
    assert "identity_work" not in open_run.to_dict()  # ids of earlier runs unchanged
    with pytest.raises(ManifestError, match="public runs"):
        SwarmManifest(
            task="t",
            model={},
            data={},
            hparams={},
            creator=creator.public_key.hex(),
            admission="certificate",
            identity_work=8,
        )
    with pytest.raises(ManifestError, match="0 to 24"):
        SwarmManifest(task="t", model={}, data={}, hparams={}, identity_work=25)
    key = Identity.generate()
    gate = gate_of(public, key)
    assert isinstance(gate, IdentityWork) and gate.bits == 4
    gate.check(key.peer_id_hex, gate.own_bytes)
    assert gate_of(open_run, key) is None
    private = SwarmManifest(
        task="t",
        model={},
        data={},
        hparams={},
        creator=creator.public_key.hex(),
        admission="certificate",
    )
    assert isinstance(gate_of(private, creator), Admission)
