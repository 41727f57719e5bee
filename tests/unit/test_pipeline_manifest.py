"""The manifest of a pipelined run: its id covers the cut, every peer derives the same
manifest for each stage's swarm from it, a key's credential names the run and every stage
takes it, and a declaration that cannot be read is refused with a reason
(pipeline/manifest.py)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from swarmloco.core.manifest import SwarmManifest
from swarmloco.core.runspec import RunSpec
from swarmloco.core.signature import params_of, signature_of
from swarmloco.errors import SwarmlocoError
from swarmloco.net.admission import AdmissionError, Membership, gate_of, reader_gate
from swarmloco.net.identity import Identity
from swarmloco.net.work import solve, work_bits
from swarmloco.pipeline.manifest import pipeline_manifest, pipeline_of, stage_manifest
from swarmloco.pipeline.stages import gpt_stages
from swarmloco.runtime.api import run_manifest
from swarmloco.train.spec import GPTConfig

GPT = GPTConfig(vocab_size=64, seq_len=8, n_layer=3, n_head=2, n_embd=16)
SPEC = RunSpec(sync_every=4, delay=1)
CREATOR = "ab" * 32


def manifest(stages: int = 2, seed: int = 0, **kw: object) -> SwarmManifest:
    made = pipeline_manifest(
        SPEC, gpt_stages(GPT, stages, seed=seed), creator=CREATOR, task="gpt-bytes", **kw
    )
    return dataclasses.replace(made, nonce="00", created_at="2026-11-27T00:00:00Z")


def test_the_run_id_covers_the_cut_and_the_initial_weights():
    ids = {manifest().swarm_id, manifest(stages=3).swarm_id, manifest(seed=1).swarm_id}
    assert len(ids) == 3
    assert manifest(encoding="f32").swarm_id != manifest().swarm_id
    declared = pipeline_of(manifest(stages=3))
    assert declared is not None and declared.stages == 3 and declared.encoding == "int8"


def test_every_peer_derives_the_same_manifest_for_each_stage():
    run = manifest(stages=3)
    again = SwarmManifest.from_bytes(run.to_bytes())  # as a joining peer gets it
    stages = gpt_stages(GPT, 3, seed=0)
    ids = set()
    for k, stage in enumerate(stages):
        ours, theirs = stage_manifest(run, k), stage_manifest(again, k)
        assert ours.to_bytes() == theirs.to_bytes()
        ids.add(ours.swarm_id)
        assert ours.model["stage"] == {"index": k, "of": 3, "run": run.swarm_id}
        assert ours.creator == run.creator and ours.hparams == run.hparams
        signature = pipeline_of(run).signatures[k]  # type: ignore[union-attr]
        assert signature.differences(params_of(stage)) == []
        own = signature_of(stage, fragments=SPEC.fragments, block_size=SPEC.codec.block_size)
        assert own.init_digest == signature.init_digest  # built as every peer builds it
    assert len(ids | {run.swarm_id}) == 4
    wrong = pipeline_of(run).signatures[1].differences(params_of(stages[2]))  # type: ignore[union-attr]
    assert wrong  # a peer that built another stage is told how it differs


def test_what_cannot_be_read_is_refused_with_a_reason():
    plain = run_manifest(
        SPEC,
        signature_of(gpt_stages(GPT, 2)[0], fragments=1, block_size=SPEC.codec.block_size),
        creator=CREATOR,
    )
    assert pipeline_of(plain) is None
    with pytest.raises(SwarmlocoError, match="not a pipelined run"):
        stage_manifest(plain, 0)
    with pytest.raises(SwarmlocoError, match="stages 0 to 1, not 2"):
        stage_manifest(manifest(), 2)
    run = manifest()
    declared = dict(run.model["pipeline"])  # type: ignore[arg-type]
    for broken, reason in (
        ({**declared, "stages": declared["stages"][:1]}, "2 to 256 stages"),
        ({**declared, "encoding": "f64"}, "travel as one of"),
        ({**declared, "stages": [declared["stages"][0], {"params": 3}]}, "stage 1's signature"),
        ({**declared, "stages": [declared["stages"][0], 7]}, "stage 1's signature"),
        ("stages", "not a mapping"),
    ):
        bad = dataclasses.replace(run, model={**run.model, "pipeline": broken})
        with pytest.raises(SwarmlocoError, match=reason):
            pipeline_of(bad)
    with pytest.raises(ValueError, match="2 to 256 stages"):
        pipeline_manifest(SPEC, gpt_stages(GPT, 1), creator=CREATOR, task="gpt-bytes")
    with pytest.raises(ValueError, match="travel as one of"):
        manifest(encoding="fp8")
    with pytest.raises(ValueError, match="overlap its steps"):
        pipeline_manifest(
            RunSpec(sync_every=4), gpt_stages(GPT, 2), creator=CREATOR, task="gpt-bytes"
        )


def test_a_restarted_peer_takes_back_the_stage_whose_checkpoints_it_holds(tmp_path):
    from swarmloco.pipeline.daemon import served_before

    run = manifest(stages=3)
    assert served_before(run, 3, tmp_path) is None  # a fresh data directory
    other = tmp_path / "swarms" / manifest(stages=3, seed=1).swarm_id / "checkpoints"
    other.mkdir(parents=True)
    (other / "ckpt-0000000001").write_bytes(b"")  # another run's: not this one's stages
    assert served_before(run, 3, tmp_path) is None
    for k, when in ((2, 1_000), (0, 2_000)):  # stage 2 served first, then stage 0
        folder = tmp_path / "swarms" / stage_manifest(run, k).swarm_id / "checkpoints"
        folder.mkdir(parents=True)
        newest = folder / "ckpt-0000000003"
        newest.write_bytes(b"")
        os.utime(newest, (when, when))
    assert served_before(run, 3, tmp_path) == 0  # the stage it served last


@pytest.mark.parametrize("private", [False, True])
def test_a_keys_one_credential_names_the_run_and_every_stage_takes_it(private):
    """A public run's proof of work and a private run's certificate name the run's id: the
    swarm of every stage takes the same credential, as does a reader of the run's records;
    one made for a stage's own id is taken nowhere."""
    creator, peer = Identity.generate(), Identity.generate()
    kw = {"admission": "certificate"} if private else {"identity_work": 2}
    run = dataclasses.replace(manifest(**kw), creator=creator.public_key.hex())
    stages = [stage_manifest(run, k) for k in range(2)]
    assert [s.run_id for s in stages] == [run.swarm_id] * 2 and run.run_id == run.swarm_id
    cert = Membership.issue(creator, run.swarm_id, peer.peer_id_hex).to_text() if private else None
    gates = [gate_of(s, peer, cert) for s in stages]
    readers = [reader_gate(run), reader_gate(stages[1])]
    own = gates[1].own_bytes  # type: ignore[union-attr]  # (stage 1's peer's)
    for gate in [*gates, *readers, gates[0].guarding(run.swarm_id)]:  # type: ignore[union-attr]
        assert gate is not None and gate.admits(peer.peer_id_hex, own)
    assert gates[0].guarding(run.swarm_id).swarm_id == run.swarm_id  # type: ignore[union-attr]
    if private:
        wrong = Membership.issue(creator, stages[1].swarm_id, peer.peer_id_hex).to_bytes()
        with pytest.raises(AdmissionError):
            gate_of(stages[1], peer, Membership.from_bytes(wrong))
    else:
        wrong = solve(stages[1].swarm_id, peer.peer_id, 2)
        while work_bits(run.swarm_id, peer.peer_id, wrong) >= 2:  # (proves both by chance)
            wrong = solve(stages[1].swarm_id, peer.peer_id, 2)
    assert not any(g.admits(peer.peer_id_hex, wrong) for g in [*gates, *readers])  # type: ignore[union-attr]
