import dataclasses
import json
import subprocess
import sys

import pytest

from swarmloco.core.manifest import SwarmManifest, canonical_json, check_swarm_id
from swarmloco.errors import ManifestError

BASE = dict(
    task="gpt-bytes",
    model={"n_layer": 4, "n_embd": 128, "dropout": 0.0},
    data={"source": "stdlib", "paths": []},
    hparams={"inner": {"lr": 0.001}, "outer": {"lr": 0.7}},
    creator="ab" * 32,
    name="demo",
    created_at="2026-01-01T00:00:00+00:00",
    nonce="00112233",
)


def test_same_manifest_same_id_in_another_process():
    manifest = SwarmManifest(**BASE)
    code = (
        "import json,sys\n"
        "from swarmloco.core.manifest import SwarmManifest\n"
        "print(SwarmManifest(**json.loads(sys.argv[1])).swarm_id)\n"
    )
    # Another process, another dict insertion order, another hash seed.
    shuffled = dict(reversed(list(BASE.items())))
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(shuffled)],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip() == manifest.swarm_id
    assert len(manifest.swarm_id) == 40


@pytest.mark.parametrize(
    "change",
    [
        {"task": "gpt-other"},
        {"model": {**BASE["model"], "n_layer": 5}},
        {"model": {**BASE["model"], "dropout": 1e-9}},
        {"data": {"source": "text", "paths": ["a"]}},
        {"hparams": {"inner": {"lr": 0.0010000001}, "outer": {"lr": 0.7}}},
        {"creator": "cd" * 32},
        {"name": "demo2"},
        {"created_at": "2026-01-01T00:00:01+00:00"},
        {"nonce": "00112234"},
    ],
)
def test_any_change_changes_the_id(change):
    assert SwarmManifest(**{**BASE, **change}).swarm_id != SwarmManifest(**BASE).swarm_id


def test_two_fresh_manifests_with_the_same_settings_differ():
    base = {k: v for k, v in BASE.items() if k not in ("created_at", "nonce")}
    assert SwarmManifest(**base).swarm_id != SwarmManifest(**base).swarm_id


def test_round_trip_and_verification():
    m = SwarmManifest(**BASE)
    data = m.to_bytes()
    assert SwarmManifest.from_bytes(data, expected_id=m.swarm_id) == m
    other = SwarmManifest(**{**BASE, "name": "x"})
    with pytest.raises(
        ManifestError, match=f"hashes to {m.swarm_id}, not to the swarm id {other.swarm_id}"
    ):
        SwarmManifest.from_bytes(data, expected_id=other.swarm_id)


@pytest.mark.parametrize(
    "data,match",
    [
        (b"\xff\xfe", "UTF-8"),
        (b"[1,2]", "JSON object"),
        (b'{"task":"x"}', "format"),
        (canonical_json({**BASE, "format": 1, "evil": 1}), "unknown fields"),
        (json.dumps({**BASE, "format": 1}, indent=1).encode(), "canonical"),
        (canonical_json({**BASE, "format": 2}), "format 2"),
    ],
)
def test_malformed_manifests_are_refused(data, match):
    with pytest.raises(ManifestError, match=match):
        SwarmManifest.from_bytes(data)


def test_values_must_be_plain_finite_data():
    with pytest.raises(ManifestError, match="finite"):
        SwarmManifest(**{**BASE, "hparams": {"lr": float("nan")}})
    with pytest.raises(ManifestError, match="type set"):
        SwarmManifest(**{**BASE, "model": {"x": {1, 2}}})
    with pytest.raises(ManifestError, match="creator"):
        SwarmManifest(**{**BASE, "creator": "not-a-key"})


def test_swarm_id_syntax():
    assert check_swarm_id(" " + "AB" * 20 + "\n") == "ab" * 20
    with pytest.raises(ManifestError, match="40 hex digits"):
        check_swarm_id("xyz")


def test_manifest_module_does_not_import_torch():
    code = "import sys, swarmloco.core.manifest; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_is_frozen():
    m = SwarmManifest(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.task = "other"  # type: ignore[misc]


def _created(data_dir, manifest, *, checkpoint: bool = True):
    swarm_dir = data_dir / "swarms" / manifest.swarm_id
    swarm_dir.mkdir(parents=True, exist_ok=True)
    if checkpoint:
        (swarm_dir / "checkpoints" / "0000000001").mkdir(parents=True)
    (swarm_dir / "manifest.json").write_bytes(manifest.to_bytes())


def test_the_same_create_in_the_same_data_dir_resumes_its_swarm_and_names_another(tmp_path, caplog):
    from swarmloco.runtime.api import created_before
    from swarmloco.train.tasks import build_manifest

    creator = "ab" * 32
    first = build_manifest("gpt-bytes", "tiny", creator=creator)
    again = build_manifest("gpt-bytes", "tiny", creator=creator)  # another time and salt
    assert again.swarm_id != first.swarm_id
    assert created_before(again, tmp_path) is again  # nothing there yet
    _created(tmp_path, first, checkpoint=False)
    assert created_before(again, tmp_path) is again  # no checkpoint: nothing to resume
    _created(tmp_path, first)
    assert created_before(again, tmp_path).swarm_id == first.swarm_id
    # Other settings, or another creator: a new swarm, and the old one named with how to
    # resume it.
    other = build_manifest("gpt-bytes", "tiny", creator=creator, name="other")
    with caplog.at_level("INFO", logger="swarmloco.create"):
        assert created_before(other, tmp_path) is other
    assert f"swarmloco join {first.swarm_id}" in caplog.text
    stranger = build_manifest("gpt-bytes", "tiny", creator="cd" * 32)
    assert created_before(stranger, tmp_path) is stranger
