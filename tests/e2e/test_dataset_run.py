"""A run on a prepared dataset through the CLI, as an organizer starts one: `swarmloco data
prepare` with a tokenizer trained on the spot, `swarmloco create --dataset DIR
--dataset-mirror URL` (`swarmloco data serve`'s mirror on loopback), and a `swarmloco join`
with no copy of it, which fetches the index and every shard from the mirror, checks them,
and trains with the creator: the rounds they average together agree."""

from __future__ import annotations

from pathlib import Path

import pytest
from swarmutil import PeerProcess

from swarmloco.cli import main
from swarmloco.dataset.index import read_index
from swarmloco.dataset.serve import serve_dataset

pytestmark = pytest.mark.timeout(300)


def test_a_run_on_a_pinned_dataset_fetched_from_its_mirror(tmp_path, capsys):
    corpus = Path(__file__).resolve().parents[2] / "src" / "swarmloco" / "runtime"
    data = tmp_path / "data"
    assert main(["-q", "data", "prepare", str(corpus), "--train-tokenizer", "400",
                 "--out", str(data), "--shard-tokens", "20000", "--no-progress"]) == 0  # fmt: skip
    dataset_id = capsys.readouterr().out.strip()
    index = read_index(data)
    assert len(index.shards) > 1
    rounds = ("--max-rounds", "2", "--min-group", "2")
    with serve_dataset(data) as mirror:
        pinned = ("--dataset", str(data), "--dataset-mirror", mirror)
        with PeerProcess.create(tmp_path / "a", *pinned, *rounds) as creator:
            join = (creator.swarm_id, creator.endpoint, tmp_path / "b")
            with PeerProcess.join(*join, *rounds) as joiner:
                for peer in (creator, joiner):
                    assert peer.wait(240) == 0, peer.log_tail()
    # The joiner had no copy: the mirror's files, checked, are in its cache.
    cache = tmp_path / "b" / "datasets" / dataset_id
    assert sorted(p.name for p in cache.glob("shard-*.bin")) == [
        f"shard-{i:05d}.bin" for i in range(len(index.shards))
    ]
    assert not (tmp_path / "a" / "datasets" / dataset_id).exists()  # the creator read in place
    for peer in (creator, joiner):
        assert "dataset " + dataset_id[:12] in "".join(peer.log), peer.log_tail()
    together = [
        {e["round"]: e["digest"] for e in p.of("round") if e["group"] == 2}
        for p in (creator, joiner)
    ]
    common = set(together[0]) & set(together[1])
    assert common and all(together[0][r] == together[1][r] for r in common), together
