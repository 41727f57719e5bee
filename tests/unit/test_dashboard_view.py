"""The dashboard's view as a pure function of the records read and the time."""

import dataclasses
import json
import subprocess
import sys
import unicodedata
from typing import Any

import pytest

from swarmloco.core.agreement import DIGEST_BYTES
from swarmloco.core.manifest import SwarmManifest
from swarmloco.dashboard import text
from swarmloco.dashboard.view import (
    MAX_ROUND_LEAD,
    History,
    Reading,
    build_view,
    clean_text,
    current_round,
)
from swarmloco.net.records import encode_value, progress_key, status_key

NOW = 1_700_000_000.0
A, B, C, D = ("a" * 40, "b" * 40, "c" * 40, "d" * 40)
MANIFEST = SwarmManifest(
    task="gpt-bytes",
    model={"preset": "tiny", "params": 812_544, "n_layer": 2},
    data={"source": "stdlib"},
    hparams={"sync_every": 50},
    name="nightly run",
    created_at="2024-01-02T03:04:05+00:00",
)
SWARM = MANIFEST.swarm_id


def summary(round: int, *, ok: bool = True, **fields: Any) -> dict[str, Any]:
    value = {
        "round": round,
        "group": 3 if ok else 0,
        "seconds": 2.0,
        "bytes_sent": 1000,
        "bytes_received": 1000,
        "payload_bytes": 4000,
        "ok": ok,
        "at": NOW - 10.0,
    }
    value.update(fields)
    return value


def status(**fields: Any) -> dict[str, Any]:
    """A status value as runtime/peer.py publishes it, checked against the record schema, so
    that every hostile value below is one the DHT layer would let through."""
    value: dict[str, Any] = {
        "name": "box",
        "state": "training",
        "round": 7,
        "step": 350,
        "tokens": 358_400,
        "tokens_per_s": 1000.0,
        "loss": 2.5,
        "eval_loss": 2.6,
        "device": "cpu (2 threads)",
        "version": "0.1.0",
        "started_at": NOW - 3600.0,
        "rounds_applied": 7,
        "rounds_aborted": 0,
        "downloads": 0,
        "last_error": "",
        "rounds": [],
        "at": NOW - 1.0,
    }
    value.update(fields)
    for key in [k for k, v in value.items() if v is None]:
        del value[key]
    encode_value(status_key(SWARM), value)  # raises if a peer could not publish it
    return value


def progress(**fields: Any) -> dict[str, Any]:
    value = {"round": 8, "tokens": 5000, "tokens_per_s": 1000.0, "at": NOW - 1.0}
    value.update(fields)
    encode_value(progress_key(SWARM), value)
    return value


def reading(**fields: Any) -> Reading:
    fields.setdefault("manifest", MANIFEST)
    return Reading(swarm_id=SWARM, at=NOW, **fields)


def view_of(*, trust: tuple[str, ...] = (), **fields: Any) -> dict[str, Any]:
    view = build_view(reading(**fields), now=NOW, trust=trust)
    json.dumps(view, allow_nan=False)  # always valid JSON
    return view


def row(view: dict[str, Any], peer: str) -> dict[str, Any]:
    return next(p for p in view["peers"] if p["id"] == peer)


def test_the_swarm_comes_from_the_manifest():
    swarm = view_of()["swarm"]
    assert swarm == {
        "id": SWARM,
        "known": True,
        "name": "nightly run",
        "task": "gpt-bytes",
        "preset": "tiny",
        "params": 812_544,
        "created_at": "2024-01-02T03:04:05+00:00",
        "rounds_total": None,  # the manifest names no end
    }
    assert view_of(manifest=None)["swarm"] == {"id": SWARM, "known": False}


def test_where_the_run_is_round_r_of_r_the_pace_and_the_end():
    run = {"run": {"sync_every": 50, "fragments": 2, "total_steps": 1000}}  # a round / 25
    manifest = SwarmManifest(task="gpt-bytes", model={}, data={}, hparams=run)
    # Rounds 1-4 reported 20 s apart, each averaged in 2 s; the swarm is at round 4.
    rounds = [summary(r, seconds=2.0, at=NOW - 80.0 + 20.0 * r) for r in range(1, 5)]
    fields = {
        "manifest": manifest,
        "status": {A: status(round=4, rounds=rounds)},
    }
    view = build_view(Reading(swarm_id=manifest.swarm_id, at=NOW, **fields), now=NOW, trust=(A,))
    assert view["swarm"]["rounds_total"] == 40
    assert view["progress"] == {
        "round": 4,
        "of": 40,
        "round_every_s": 20.0,
        "averaging_s": 2.0,
        "eta_s": 720.0,  # 36 rounds to go
    }
    line = text.progress_line(view["progress"])
    assert line == (
        "round 4 of 40; a round every 20.0 s (averaging 2.00 s of it); ends in about 12m00s"
    )
    assert line in text.render(view)
    # No end in the manifest: no "of", no end; nothing known yet: nothing said.
    assert text.progress_line({**view["progress"], "of": None, "eta_s": None}) == (
        "round 4 of 40; a round every 20.0 s (averaging 2.00 s of it)".replace(" of 40", "")
    )
    assert text.progress_line({"round": None}) == ""


def test_only_peers_with_a_fresh_status_are_online_and_count():
    view = view_of(
        status={
            A: status(name="alpha", round=7, tokens_per_s=1500.0, at=NOW - 2.0),
            B: status(name="beta", round=7, tokens_per_s=500.0, at=NOW - 29.0),
            C: status(name="gone", round=9, tokens_per_s=9000.0, at=NOW - 31.0),
        }
    )
    assert view["peers_online"] == 2 and view["peers_known"] == 3
    assert view["tokens_per_s"] == 2000.0
    assert view["round"] == 7  # the stale peer's round 9 does not count
    assert [p["name"] for p in view["peers"]] == ["alpha", "beta", "gone"]  # online first
    gone = row(view, C)
    assert gone["online"] is False and gone["tokens_per_s"] == 0.0 and gone["age_s"] == 31.0
    assert row(view, A)["uptime_s"] == 3600.0 and row(view, A)["short_id"] == A[:12]
    assert view_of(status={})["round"] is None and view_of()["peers_online"] == 0


def test_a_peer_that_said_goodbye_is_offline_and_the_round_it_ended_at_stays():
    view = view_of(
        status={
            A: status(name="alpha", round=7, tokens_per_s=1500.0, at=NOW - 2.0),
            B: status(name="beta", state="left", round=8, tokens_per_s=500.0, at=NOW - 1.0),
        }
    )
    assert view["peers_online"] == 1 and view["tokens_per_s"] == 1500.0
    beta = row(view, B)
    assert beta["online"] is False and beta["state"] == "left"
    assert view["round"] == 8  # a run whose peers all left still shows where it ended
    assert "left" in text.render(view)


def test_each_peer_gets_its_share_of_the_tokens_of_all_known_peers():
    view = view_of(
        status={
            A: status(tokens=300_000),
            B: status(tokens=100_000),
            C: status(tokens=0, at=NOW - 500.0),
        }
    )
    assert view["tokens"] == 400_000
    assert (row(view, A)["share"], row(view, B)["share"], row(view, C)["share"]) == (
        0.75,
        0.25,
        0.0,
    )
    assert view_of(status={A: status(tokens=0)})["peers"][0]["share"] == 0.0


def test_progress_towards_the_next_round_and_the_peer_list():
    view = view_of(
        status={A: status(round=7), B: status(round=7)},
        progress={
            A: progress(round=8, tokens=5000, tokens_per_s=100.0),
            B: progress(round=8, tokens=3000, tokens_per_s=50.0),
            C: progress(round=8, tokens=999, at=NOW - 100.0),  # stale
            D: progress(round=3, tokens=777),  # catching up
        },
        peers={
            A: {"endpoint": "10.0.0.1:4000", "role": "trainer", "version": "0.1", "public": True},
            B: {"endpoint": "", "role": "trainer", "version": "0.1", "public": False},
            D: {
                "endpoint": "10.0.0.9:31337",
                "role": "bootstrap",
                "version": "0.1",
                "public": True,
            },
        },
    )
    assert view["next_round"] == {"round": 8, "peers": 2, "tokens": 8000, "tokens_per_s": 150.0}
    assert view["peers_listed"] == {"bootstrap": 1, "trainer": 2}
    assert row(view, A)["endpoint"] == "10.0.0.1:4000" and row(view, A)["public"] is True
    assert row(view, A)["tokens_since_round"] == 5000
    assert view_of(status={C: status()})["peers"][0]["tokens_since_round"] is None


def test_the_timeline_merges_the_peers_rounds_with_medians_and_counts_failures():
    view = view_of(
        status={
            A: status(
                rounds=[
                    summary(5, seconds=2.0, bytes_sent=1000, payload_bytes=4000),
                    summary(6, ok=False, seconds=30.0, bytes_sent=0, bytes_received=0),
                ]
            ),
            B: status(
                rounds=[
                    summary(5, seconds=4.0, bytes_sent=1100, payload_bytes=4000),
                    summary(6, seconds=3.0, bytes_sent=1000, payload_bytes=4000, group=2),
                ]
            ),
            C: status(
                rounds=[
                    summary(5, seconds=3.0, bytes_sent=900, payload_bytes=4000, matchmaking_s=0.5)
                ]
            ),
        }
    )
    five, six = view["rounds"]
    # Only C said how long matchmaking took; peers of older versions leave it out.
    assert five["matchmaking_s"] == 0.5 and six["matchmaking_s"] is None
    assert five["round"] == 5 and five["reported"] == 3 and five["failures"] == 0
    assert five["group"] == 3 and five["seconds"] == 3.0
    assert five["bytes_sent"] == 1000 and five["bytes_sent_total"] == 3000
    assert five["compression"] == 4.0
    # A round one peer aborted: its figures come from the peer that completed it.
    assert six["ok"] == 1 and six["failures"] == 1 and six["group"] == 2
    assert six["seconds"] == 3.0 and six["compression"] == 4.0


def test_a_round_every_peer_aborted_has_no_compression_ratio():
    view = view_of(status={A: status(rounds=[summary(4, ok=False, bytes_sent=0)])})
    (only,) = view["rounds"]
    assert only["failures"] == 1 and only["ok"] == 0 and only["group"] == 0
    assert only["compression"] is None and only["bytes_sent_total"] == 0


def test_missing_optional_fields():
    view = view_of(status={A: status(loss=None, eval_loss=None)}, trust=(A,))
    assert view["loss"] is None and view["eval_loss"] is None
    assert row(view, A)["loss"] is None and row(view, A)["eval_loss"] is None
    assert view["history"]["swarm_loss"] == [] and view["history"]["peer_loss"] == []
    assert view["agreement"] is None and view["rounds"] == [] and view["warnings"] == []
    assert view_of(status={A: status()})["loss"] == 2.5


def test_how_a_peer_fits_its_device_and_its_mfu_are_shown():
    fitted = status(device="cuda:0 (NVIDIA H200)", fit="micro-batch 8 x 2, 61 of 141 GB", mfu=0.412)
    view = view_of(status={A: fitted, B: status(at=NOW - 31.0, mfu=0.5)}, trust=(A, B))
    assert row(view, A)["fit"] == "micro-batch 8 x 2, 61 of 141 GB"
    assert row(view, A)["mfu"] == 0.412
    assert row(view, B)["mfu"] is None and row(view, B)["fit"] == ""  # offline: not now
    rendered = text.render(view)
    assert "cuda:0 (NVIDIA H200) (micro-batch 8 x 2, 61 of 141 GB)" in rendered
    assert "MFU" in rendered and "41.2%" in rendered
    with pytest.raises(ValueError):
        status(mfu=1.5)  # no peer can publish a utilisation above 1


def test_a_pinned_datasets_epoch_is_what_the_best_informed_reader_knows():
    def data(epoch: int, landed: int, leased: int, done: int) -> dict[str, int]:
        return {"epoch": epoch, "landed": landed, "sequences": 462, "leased": leased,
                "done": done, "shards": 11}  # fmt: skip

    readers = {
        A: status(data=data(0, 300, 2, 6)),
        B: status(data=data(0, 312, 1, 7)),
        C: status(data=data(0, 999, 4, 11), at=NOW - 31.0),  # offline: not counted
    }
    view = view_of(status=readers, trust=(A, B, C))
    assert view["dataset"] == {"epoch": 0, "sequences": 462, "landed": 312, "shards": 11,
                               "done": 7, "leased": 3, "readers": 2}  # fmt: skip
    assert ("dataset: epoch 0, 312 of 462 sequences landed (68%); of 11 shards 7 done, 3 "
            "leased by 2 reader(s), 1 free") in text.render(view)  # fmt: skip
    # A reader in the next epoch: that epoch is shown.
    readers[B] = status(data=data(1, 20, 1, 0))
    assert view_of(status=readers, trust=(A, B))["dataset"]["epoch"] == 1
    assert view_of()["dataset"] is None  # no pinned dataset
    with pytest.raises(ValueError):
        status(data={**data(0, 1, 1, 1), "leased": 5})  # more than a peer may lease


def test_a_pipelined_runs_epoch_is_what_its_vouched_stage_0_readers_say():
    """The stage-0 peers of a pipelined run read its pinned dataset and say its epoch in
    their stage's status records, which the run's view reads; those of peers whose
    ``stage-load`` servers did not vouch for them are not counted."""
    data = {"epoch": 0, "landed": 100, "sequences": 462, "leased": 2, "done": 3, "shards": 11}
    stage0 = {A: status(data=data), B: status(data={**data, "landed": 400, "done": 10})}
    loads = {A: stage_load(0), B: stage_load(0)}
    reading = Reading(swarm_id=PIPELINED.swarm_id, at=NOW, manifest=PIPELINED,
                      stage_loads=loads, stage_status=stage0)  # fmt: skip
    view = build_view(reading, now=NOW)
    assert view["dataset"]["landed"] == 400 and view["dataset"]["readers"] == 2
    only_a = dataclasses.replace(reading, vouched=frozenset({A}))
    assert build_view(only_a, now=NOW)["dataset"]["landed"] == 100  # B's word is not counted
    unvouched = dataclasses.replace(reading, vouched=frozenset())
    assert build_view(unvouched, now=NOW)["dataset"] is None


def test_the_swarm_loss_is_the_median_of_the_online_peers():
    view = view_of(
        status={
            A: status(loss=2.0, eval_loss=2.2),
            B: status(loss=3.0, eval_loss=None),
            C: status(loss=100.0, eval_loss=2.4),
            D: status(loss=0.1, at=NOW - 600.0),  # offline
        }
    )
    assert view["loss"] == 3.0 and view["eval_loss"] == 2.3
    assert view["history"]["swarm_loss"] == [[NOW, 3.0]]


def test_agreement_on_the_current_round():
    one, two = b"\x01" * DIGEST_BYTES, b"\x02" * DIGEST_BYTES
    view = view_of(
        status={A: status(round=7)},
        digest_round=7,
        digests={A: one, B: one, C: two},
    )
    assert view["agreement"] == {
        "round": 7,
        "current": True,
        "published": 3,
        "holders": 2,
        "share": 0.6667,
        "digest": one.hex()[:16],
    }


def test_hostile_but_schema_valid_values_do_not_crash_or_poison_the_view():
    evil_name = "\x1b[2J\x1b[31mroot\u202eevil\nname\x07"
    view = view_of(
        status={
            A: status(name="honest", round=10, tokens_per_s=1000.0, loss=2.0),
            B: status(name="honest2", round=10, tokens_per_s=1000.0, loss=2.2),
            C: status(
                name=evil_name,
                round=2**62,
                tokens=2**63 - 1,
                tokens_per_s=1e300,
                loss=-1e300,
                eval_loss=1e300,
                device="\x1b]0;owned\x07",
                last_error="x" * 240,
                started_at=NOW + 10**9,
                at=NOW + 3600.0,  # a clock an hour ahead
                rounds=[
                    summary(10, seconds=1e300, bytes_sent=0, payload_bytes=2**63 - 1),
                    summary(2**62, seconds=1.0),
                ],
            ),
        },
        progress={C: progress(round=11, tokens=2**63 - 1, tokens_per_s=1e300)},
    )
    text_of_view = json.dumps(view, allow_nan=False)
    assert "\x1b" not in text_of_view and "\u202e" not in text_of_view
    assert view["tokens_per_s"] == 2000.0  # the absurd rate is not counted
    assert view["round"] == 10  # nor the absurd round
    assert view["loss"] == 2.1  # the median of 2.0 and 2.2: the absurd loss is dropped
    evil = row(view, C)
    assert evil["name"] == "[2J[31mrootevil name" and evil["device"] == "]0;owned"
    assert evil["online"] is True and evil["uptime_s"] == 0.0 and evil["loss"] is None
    assert evil["share"] > 0.99  # what it claims is shown as its claim, bounded to [0, 1]
    assert [r["round"] for r in view["rounds"]] == [10]  # no far-future round
    assert view["rounds"][0]["reported"] == 1 and view["rounds"][0]["compression"] is None
    assert view["next_round"]["tokens_per_s"] == 0.0
    assert any("ahead of ours" in w for w in view["warnings"])
    assert any("tokens/s" in w for w in view["warnings"])
    assert any("far ahead" in w for w in view["warnings"])
    rendered = text.render(view)
    assert not any(unicodedata.category(ch) == "Cc" for ch in rendered.replace("\n", ""))


def test_a_round_far_ahead_of_the_median_does_not_set_the_current_round():
    status_of = {A: status(round=5), B: status(round=6), C: status(round=6 + MAX_ROUND_LEAD + 1)}
    assert current_round(status_of, now=NOW) == 6
    status_of[C] = status(round=6 + MAX_ROUND_LEAD)
    assert current_round(status_of, now=NOW) == 6 + MAX_ROUND_LEAD


def test_clean_text():
    assert clean_text("a\tb\r\nc  d") == "a b c d"
    assert clean_text("\u200bzero\u2066width") == "zerowidth"
    assert clean_text("日本語 ✓") == "日本語 ✓"
    assert clean_text(None) == "" and clean_text(5) == ""
    assert clean_text("x" * 1000, 10) == "x" * 10


def test_history_adds_points_only_for_new_records_on_our_clock():
    history = History()
    first = reading(status={A: status(at=NOW + 500.0, loss=3.0), B: status(loss=None)})
    history.add(first)
    history.add(first)  # the same records again: nothing new
    later = Reading(
        swarm_id=SWARM,
        at=NOW + 2.0,
        status={A: status(at=NOW + 502.0, loss=2.5), B: status(loss=None)},
    )
    history.add(later)
    history.add(Reading(swarm_id=SWARM, at=NOW + 4.0, error="no DHT node answered"))
    curves = build_view(later, now=NOW + 2.0, history=history)["history"]
    assert curves["peer_loss"] == [{"id": A, "name": "box", "points": [[NOW, 3.0], [NOW + 2, 2.5]]}]
    assert curves["swarm_loss"] == [[NOW, 3.0], [NOW + 2.0, 2.5]]
    assert curves["swarm_tokens_per_s"] == [[NOW, 2000.0], [NOW + 2.0, 2000.0]]


def test_history_is_bounded():
    history = History(points=5, peers=3, rounds=4)
    for i in range(50):
        peers = {f"{i % 10:040x}": status(at=NOW + i, round=i, loss=float(i), rounds=[summary(i)])}
        history.add(Reading(swarm_id=SWARM, at=NOW + i, status=peers))
    assert len(history.peer_loss) == 3
    assert all(len(c.points) <= 5 for c in history.peer_loss.values())
    assert len(history.swarm_loss) == 5 and sorted(history.rounds) == [46, 47, 48, 49]
    with pytest.raises(ValueError):
        History(points=0)


def test_text_rendering_shows_the_swarm_the_peers_and_the_rounds():
    view = view_of(
        status={
            A: status(name="alpha", rounds=[summary(7)]),
            B: status(name="beta", at=NOW - 100.0, last_error="round 6 aborted: timeout"),
        },
        digest_round=7,
        digests={A: b"\x01" * DIGEST_BYTES},
    )
    rendered = text.render(view)
    assert f"swarm {SWARM}" in rendered and "'nightly run'" in rendered
    assert "peers online 1 (of 2 known)" in rendered and "1/1 agree on round 7" in rendered
    assert "alpha" in rendered and "offline (1m40s)" in rendered and "round 6 aborted" in rendered
    assert "4.00x" in rendered
    error_view = build_view(reading(error="no DHT node answered"), now=NOW)
    assert "error: no DHT node answered" in text.render(error_view)


def test_the_dashboard_modules_do_not_import_torch():
    probe = (
        "import sys; import swarmloco.dashboard.view, swarmloco.dashboard.collector, "
        "swarmloco.dashboard.app, swarmloco.dashboard.metrics, swarmloco.dashboard.service, "
        "swarmloco.dashboard.text; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


PIPELINED = SwarmManifest(
    task="gpt-bytes",
    model={"preset": "tiny", "pipeline": {"stages": [{}, {}, {}], "encoding": "int8"}},
    data={},
    hparams={},
)


def stage_load(stage: int, endpoint: str = "127.0.0.1:5000", rate: float = 50.0):
    return {"stage": stage, "endpoint": endpoint, "rate": rate, "queue": 1, "free": 3, "at": NOW}


def test_a_pipelined_run_shows_its_stages_as_pools_the_one_that_limits_and_the_moves():
    E, F, G = ("e" * 40, "f" * 40, "0" * 40)
    loads = {
        A: {**stage_load(0, rate=100.0), "round": 7, "distrusted": 1},
        B: {**stage_load(0, rate=120.0), "round": 6, "distrusted": 2},  # a round behind
        C: {**stage_load(1, rate=40.0), "refused": 3, "skipped": 1},  # (says no round)
        D: stage_load(1, endpoint=""),  # moving in: counted apart, its rate not yet
        E: stage_load(2, rate=1e30),  # an absurd claim counts as nothing
        F: {**stage_load(2, rate=30.0), "at": NOW - 3600},  # stale
        G: stage_load(9),  # no such stage
    }
    history = History()
    reading = Reading(swarm_id=PIPELINED.swarm_id, at=NOW, manifest=PIPELINED, stage_loads=loads)
    history.add(reading)
    view = build_view(reading, now=NOW, history=history)
    pipeline = view["pipeline"]
    assert [(r["peers"], r["moving_in"], r["throughput"]) for r in pipeline["stages"]] == [
        (2, 0, 220.0),
        (1, 1, 40.0),
        (1, 0, 0.0),
    ]
    assert pipeline["stages"][0]["queue"] == 2 and pipeline["stages"][0]["free"] == 6
    assert [r["round"] for r in pipeline["stages"]] == [7, None, None]
    # Bad input refused and NaN steps skipped, as stage 1's replica says; older peers say none.
    assert [(r["refused"], r["skipped"]) for r in pipeline["stages"]] == [(0, 0), (3, 1), (0, 0)]
    # The most replicas one of stage 0's drivers distrusts (each judges by its own audits).
    assert [r["distrusted"] for r in pipeline["stages"]] == [2, 0, 0]
    assert pipeline["limiting"] == 2 and pipeline["throughput"] == 0.0
    # The run's peers are its stages' (its own swarm has no progress records): 4 serve.
    assert pipeline["peers"] == 4 and view["peers_online"] == 0
    assert "peers online 4 in 3 stages  0 sequences/s through the pipeline" in text.render(view)
    # One reading sees no move (`swarmloco status`): it says so instead of counting none.
    assert pipeline["moves"] is None and pipeline["recent_moves"] == []
    assert "moves between stages: not seen in one reading" in text.render(view)
    # Peer B moves to stage 2: the next reading sees it there, once.
    moved = {**loads, B: {**stage_load(2, endpoint=""), "at": NOW + 2}}
    later = Reading(swarm_id=PIPELINED.swarm_id, at=NOW + 2, manifest=PIPELINED, stage_loads=moved)
    for _ in range(2):
        history.add(later)
    view = build_view(later, now=NOW + 2, history=history)
    pipeline = view["pipeline"]
    assert pipeline["moves"] == 1
    assert pipeline["recent_moves"] == [{"peer": B[:12], "from": 0, "to": 2, "at": NOW + 2}]
    assert pipeline["stages"][2]["moving_in"] == 1 and pipeline["limiting"] == 2
    said = text.render(view)
    assert "limits the pipeline" in said and "moves between stages: 1" in said, said
    # Stage 0's peers say rounds 7 and 6 (B moved away since): the stage is at round 7.
    lines = [line.split() for line in said.splitlines()]
    row = "0 1 100 1 3 7 0 0 its audits distrust 1 replica(s)"
    assert row.split(" ") in lines, said
    assert ["1", "1", "(+1", "moving", "in)", "40", "1", "3", "-", "3", "1"] in lines, said
    assert "+1 moving in" in said
    # A stage nobody serves stalls the pipeline, and the view says so.
    alone = {A: stage_load(0), C: stage_load(1)}
    view = build_view(
        Reading(swarm_id=PIPELINED.swarm_id, at=NOW, manifest=PIPELINED, stage_loads=alone),
        now=NOW,
    )
    assert view["pipeline"]["limiting"] == 2 and view["pipeline"]["throughput"] is None
    assert any("stage 2 has no peer" in w for w in view["warnings"]), view["warnings"]
    json.dumps(view, allow_nan=False)
    # Forty keys on one network claim stage 1: four are counted, as a driver draws four.
    sybils = {
        f"{i:040x}": stage_load(1, endpoint=f"93.184.216.9:{4000 + i}", rate=1000.0)
        for i in range(1, 41)
    }
    crowded = {A: stage_load(0), C: stage_load(1, endpoint="151.101.1.7:31337"), **sybils}
    view = build_view(
        Reading(swarm_id=PIPELINED.swarm_id, at=NOW, manifest=PIPELINED, stage_loads=crowded),
        now=NOW,
    )
    stage1 = view["pipeline"]["stages"][1]
    assert stage1["peers"] == 5 and stage1["throughput"] == 4050.0, stage1
    assert stage1["moving_in"] == 0, stage1  # the 36 left out are not peers moving in
    assert any("36 stage-load record(s) not counted" in w for w in view["warnings"])
    # Read with vouching, a record whose server did not answer as its key is left out of
    # the pools, moving in or serving, and the view says how many.
    vouched = Reading(
        swarm_id=PIPELINED.swarm_id,
        at=NOW,
        manifest=PIPELINED,
        stage_loads={**crowded, D: stage_load(1, endpoint="")},
        vouched=frozenset({A, C}),
    )
    view = build_view(vouched, now=NOW)
    assert [(r["peers"], r["moving_in"]) for r in view["pipeline"]["stages"]][:2] == [
        (1, 0),
        (1, 0),
    ]
    assert view["pipeline"]["stages"][1]["throughput"] == 50.0
    assert any("41 stage-load record(s) not counted: no server" in w for w in view["warnings"])
    assert not any("of one network" in w for w in view["warnings"]), view["warnings"]
    # ... and a key that says it moved counts as a move only once vouched for.
    history = History()
    for e_at, a_at in ((1, 0), (0, 2)):  # E (not vouched for) and A (vouched for) move
        said = {**vouched.stage_loads, E: stage_load(e_at), A: stage_load(a_at)}
        history.add(
            Reading(
                swarm_id=PIPELINED.swarm_id,
                at=NOW,
                manifest=PIPELINED,
                stage_loads=said,
                vouched=vouched.vouched,
            )
        )
    assert [m["peer"] for m in history.moves] == [A[:12]], history.moves
    # A run that is not pipelined has no stages.
    plain = build_view(Reading(swarm_id=SWARM, at=NOW, manifest=MANIFEST), now=NOW)
    assert plain["pipeline"] is None
