"""A run on a prepared dataset through the CLI, as an organizer starts one: `swarmloco data
prepare` with a tokenizer trained on the spot, `swarmloco create --dataset DIR
--dataset-mirror URL` (`swarmloco data serve`'s mirror on loopback), and a `swarmloco join`
with no copy of it, which fetches the index and the shards it needs from the mirror
(the evaluation's at once, the others as it leases them), checks them, and trains with the
creator; then the mirror goes down and a third peer gets its shards from the two
(`swarmloco.v1.DatasetFiles`). The rounds they average together agree."""

from __future__ import annotations

import contextlib
import re
import signal
from pathlib import Path

import pytest
from swarmutil import PeerProcess, last_landed

from swarmloco.cli import main
from swarmloco.dataset.fetch import EVAL_SHARDS
from swarmloco.dataset.index import read_index, sha256_of
from swarmloco.dataset.serve import serve_dataset
from swarmloco.runtime.export import export

pytestmark = pytest.mark.timeout(300)


def test_a_run_on_a_pinned_dataset_fetched_from_its_mirror_then_from_its_peers(tmp_path, capsys):
    corpus = Path(__file__).resolve().parents[2] / "src" / "swarmloco" / "runtime"
    data = tmp_path / "data"
    assert main(["-q", "data", "prepare", str(corpus), "--train-tokenizer", "400",
                 "--out", str(data), "--shard-tokens", "20000", "--no-progress"]) == 0  # fmt: skip
    dataset_id = capsys.readouterr().out.strip()
    index = read_index(data)
    assert len(index.shards) > 1
    group = ("--min-group", "2")
    with contextlib.ExitStack() as mirror:
        url = mirror.enter_context(serve_dataset(data))
        pinned = ("--dataset", str(data), "--dataset-mirror", url)
        with PeerProcess.create(tmp_path / "a", *pinned, *group) as creator:
            swarm_id, endpoint = creator.swarm_id, creator.endpoint
            with PeerProcess.join(swarm_id, endpoint, tmp_path / "b", *group) as first:
                first.wait_for("ready", timeout=120)  # it holds every shard: from the mirror
                mirror.close()  # the mirror goes down: the next joiner asks the peers
                with PeerProcess.join(swarm_id, endpoint, tmp_path / "c", *group) as late:
                    late.wait_for("round", lambda e: e["group"] >= 2, timeout=180)
                    for peer in (late, first, creator):
                        peer.process.send_signal(signal.SIGINT)
                    for peer in (late, first, creator):
                        assert peer.wait(90) == 0, peer.log_tail()
    # Neither joiner had a copy: the checked files are in their caches, the first's from
    # the mirror, the late one's from the peers (the mirror was down): the evaluation's
    # shards at once, and each shard it leased when it leased it, none other.
    for peer, process in (("b", first), ("c", late)):
        cache = tmp_path / peer / "datasets" / dataset_id
        leased = {int(m) for m in re.findall(r"leased shard (\d+) of epoch", "".join(process.log))}
        expected = set(range(min(EVAL_SHARDS, len(index.shards)))) | leased
        assert sorted(p.name for p in cache.glob("shard-*.bin")) == [
            f"shard-{i:05d}.bin" for i in sorted(expected)
        ], peer
        for i in expected:
            assert sha256_of(cache / f"shard-{i:05d}.bin") == index.shards[i].sha256, (peer, i)
    creator_cache = tmp_path / "a" / "datasets" / dataset_id
    assert not list(creator_cache.glob("shard-*.bin"))  # the creator read its copy in place
    for peer in (creator, first, late):
        assert "dataset " + dataset_id[:12] in "".join(peer.log), peer.log_tail()
    rounds = [{e["round"]: e["digest"] for e in p.of("round") if e["group"] >= 2}
              for p in (creator, first, late)]  # fmt: skip
    for r, digest in rounds[2].items():
        assert all(other.get(r, digest) == digest for other in rounds[:2]), rounds
    # What landed travels with the state (its digest, agreed above, covers it): each peer's
    # last state holds sequences of the dataset, none twice, the late joiner's included.
    for peer in "abc":
        _, landed = last_landed(tmp_path / peer)
        assert landed and sum(r.count for r in landed.ranges) == sum(landed.counted), peer
    # `swarmloco export` from a checkpoint names the digest the peer published for its
    # round: what landed is hashed with the state there too.
    out = export(swarm_id, tmp_path / "model", data_dir=tmp_path / "b")
    published = {e["round"]: e["digest"] for e in first.of("round")}
    assert out.digest == published[out.round], (out, published)
