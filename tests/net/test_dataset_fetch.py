"""A pinned dataset fetched by a peer from real HTTP servers on loopback and local copies:
a dead mirror is passed over, a tampered shard or another dataset's index is refused and
taken from the next source, a corrupted cache file is fetched again, a local copy is read
in place, and the task reads what was fetched. The mirrors are `swarmloco data serve`'s."""

from __future__ import annotations

import logging
import shutil
import socket
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from swarmloco.dataset.fetch import (
    EVAL_SHARDS,
    DatasetCache,
    HttpSource,
    LazyDataset,
    LocalSource,
    local_tokens,
)
from swarmloco.dataset.index import read_index, shard_name
from swarmloco.dataset.prepare import PrepareConfig, prepare
from swarmloco.dataset.serve import serve_dataset
from swarmloco.errors import DataError
from swarmloco.train.data import load_tokens
from swarmloco.train.spec import DataSpec

pytestmark = pytest.mark.timeout(60)


def dead_url() -> str:
    """A loopback URL where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dataset")
    text = root / "in.txt"
    words = ["alpha", "beta", "gamma", "delta", "swarm", "peer", "shard"]
    g = np.random.default_rng(0)
    text.write_text(" ".join(words[i] for i in g.integers(0, len(words), 4000)))
    prepare([text], root / "out", train_vocab=300, config=PrepareConfig(shard_tokens=256),
            progress=False)  # fmt: skip
    return root / "out"


def test_a_dead_mirror_and_a_tampered_shard_are_passed_over(dataset, tmp_path, caplog):
    index = read_index(dataset)
    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    data = bytearray((bad / shard_name(1)).read_bytes())
    data[0] ^= 0xFF
    (bad / shard_name(1)).write_bytes(bytes(data))
    with serve_dataset(bad) as tampered, serve_dataset(dataset) as good:
        sources = [HttpSource(dead_url(), timeout_s=5), HttpSource(tampered), HttpSource(good)]
        cache = DatasetCache(tmp_path / "cache", index.dataset_id, sources)
        with caplog.at_level(logging.WARNING):
            assert cache.index() == index  # the dead one passed over
            paths = cache.all_shards(index, progress=False)
    assert "refused shard-00001.bin from " + tampered in caplog.text
    for i, path in enumerate(paths):
        assert path.parent == tmp_path / "cache"
        assert path.read_bytes() == (dataset / shard_name(i)).read_bytes()
    # Nothing left behind but whole files.
    assert not list((tmp_path / "cache").glob(".*partial"))


def test_another_datasets_index_is_refused_and_said(dataset, tmp_path):
    other = tmp_path / "other"
    (tmp_path / "o.txt").write_text("something else entirely " * 50)
    prepare([tmp_path / "o.txt"], other, train_vocab=300, progress=False)
    wanted = read_index(dataset).dataset_id
    with serve_dataset(other) as url:
        cache = DatasetCache(tmp_path / "cache", wanted, [HttpSource(url)])
        with pytest.raises(DataError, match=f"{url} serves dataset {read_index(other).dataset_id}"):
            cache.index()
    with pytest.raises(DataError, match="no source is known"):
        DatasetCache(tmp_path / "none", wanted, []).index()


def test_a_corrupted_cache_file_is_fetched_again_and_a_local_copy_read_in_place(dataset, tmp_path):
    index = read_index(dataset)
    with serve_dataset(dataset) as url:
        cache = DatasetCache(tmp_path / "cache", index.dataset_id, [HttpSource(url)])
        first = cache.shard(cache.index(), 0)
        first.write_bytes(b"\0" * first.stat().st_size)  # same size, other bytes
        again = DatasetCache(tmp_path / "cache", index.dataset_id, [HttpSource(url)])
        assert again.shard(again.index(), 0).read_bytes() == (dataset / shard_name(0)).read_bytes()
    local = DatasetCache(tmp_path / "cache2", index.dataset_id, [LocalSource(dataset)])
    assert local.shard(local.index(), 2) == dataset / shard_name(2)  # not copied
    assert not (tmp_path / "cache2" / shard_name(2)).exists()


def test_the_task_reads_the_fetched_shards_and_a_small_model_is_refused(dataset, tmp_path):
    index = read_index(dataset)
    spec = DataSpec(source="dataset", dataset=index.dataset_id)
    with serve_dataset(dataset) as url:
        spec = DataSpec(source="dataset", dataset=index.dataset_id, mirrors=(url,))
        tokens = local_tokens(spec, tmp_path / "datasets", (), vocab_size=512, progress=False)
        with pytest.raises(DataError, match=f"--vocab-size {index.vocab_size}"):
            local_tokens(spec, tmp_path / "datasets", (), vocab_size=64, progress=False)
    assert tokens.source == "tokens" and tokens.token_dtype == "uint16"
    assert len(tokens.paths) == len(index.shards)
    data = load_tokens(tokens, vocab_size=512)
    assert data.train.num_tokens + data.val.num_tokens == index.tokens
    with pytest.raises(ValueError, match="40 hex digits"):
        DataSpec(source="dataset", dataset="nope")
    with pytest.raises(ValueError, match="http"):
        DataSpec(source="dataset", dataset=index.dataset_id, mirrors=("ftp://x",))


def test_the_mirror_serves_the_datasets_files_and_nothing_else(dataset, tmp_path):
    assert (dataset / "provenance.json").is_file()  # there, and not served
    with serve_dataset(dataset) as url:
        with urllib.request.urlopen(f"{url}/{shard_name(0)}", timeout=10) as r:
            assert r.read() == (dataset / shard_name(0)).read_bytes()
        for path in ("/", "/provenance.json", "/../index.json", "/shard-1.bin", "/x/index.json"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(url + path, timeout=10)
            assert refused.value.code == 404, path
    with pytest.raises(DataError, match="holds no dataset"), serve_dataset(tmp_path):
        pass


def test_a_full_cache_disk_is_said(tmp_path, small_tmpfs):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"</s>": 70_000, "[UNK]": 70_001}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tok.json"))  # uint32: 4 bytes a word
    (tmp_path / "a.txt").write_text(" ".join(f"w{i % 999}" for i in range(1_000_000)))
    big = prepare([tmp_path / "a.txt"], tmp_path / "big", tokenizer=tmp_path / "tok.json",
                  config=PrepareConfig(shard_tokens=200_000), progress=False).index  # fmt: skip
    with serve_dataset(tmp_path / "big") as url:
        cache = DatasetCache(small_tmpfs / "cache", big.dataset_id, [HttpSource(url)])
        with pytest.raises(DataError, match=r"cannot keep shard-\d+\.bin .*No space left"):
            cache.all_shards(cache.index(), progress=False)


def test_a_leasing_peer_fetches_the_evaluations_shards_first_and_the_others_when_read(
    dataset, tmp_path
):
    index = read_index(dataset)
    assert len(index.shards) > EVAL_SHARDS + 1
    with serve_dataset(dataset) as url:
        spec = DataSpec(source="dataset", dataset=index.dataset_id, mirrors=(url,))
        with LazyDataset(spec, tmp_path, [], peers=(), swarm_id="ab" * 20, vocab_size=300) as lazy:
            tokens, _ = lazy.start()
            cache = tmp_path / index.dataset_id
            at_hand = sorted(p.name for p in cache.glob("shard-*.bin"))
            assert at_hand == [shard_name(i) for i in range(EVAL_SHARDS)]
            assert len(tokens.paths) == EVAL_SHARDS  # the task's evaluation set: those
            last = len(index.shards) - 1
            read = lazy.shard_tokens(last)  # leased: fetched now, checked, mapped
            assert len(read) == index.shards[last].tokens
            assert (cache / shard_name(last)).is_file()
            assert np.array_equal(read, np.fromfile(dataset / shard_name(last), dtype=np.uint16))
    # The mirror is gone: what is cached is read, what is not is a clear error.
    with LazyDataset(spec, tmp_path, [], peers=(), swarm_id="ab" * 20, vocab_size=300) as lazy:
        lazy.start()
        assert len(lazy.shard_tokens(len(index.shards) - 1)) > 0
        with pytest.raises(DataError, match=shard_name(EVAL_SHARDS)):
            lazy.shard_tokens(EVAL_SHARDS)
