"""Peers as a source of a pinned dataset, over real gRPC on loopback: a peer reads another
peer's dataset files whole; the server serves the dataset's own files only and refuses
past its limits; a fetch takes the shards from a peer with the HTTP mirror down, from the
mirror with the peer gone, and refuses a peer's tampered shard."""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from swarmloco.dataset.fetch import DatasetCache, HttpSource
from swarmloco.dataset.index import INDEX, read_index, shard_name
from swarmloco.dataset.peers import FilesConfig, FileServer, PeerReader, PeerSource, holdings_in
from swarmloco.dataset.prepare import PrepareConfig, prepare
from swarmloco.dataset.serve import serve_dataset
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.rejections import RejectionLog
from swarmloco.runtime.loop_thread import LoopThread

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dataset")
    words = ["alpha", "beta", "gamma", "delta", "swarm", "peer", "shard"]
    g = np.random.default_rng(1)
    (root / "in.txt").write_text(" ".join(words[i] for i in g.integers(0, len(words), 4000)))
    prepare([root / "in.txt"], root / "out", train_vocab=300,
            config=PrepareConfig(shard_tokens=300), progress=False)  # fmt: skip
    return root / "out"


@contextlib.contextmanager
def peer_serving(directory: Path, config: FilesConfig | None = None) -> Iterator[FileServer]:
    """A peer's gRPC server carrying the dataset files of ``directory`` (its local copy)."""
    server = FileServer(
        holdings_in([directory], directory / "no-cache"),
        rejections=RejectionLog(logging.getLogger("test")),
        config=config,
    )
    node = NetNode(identity=Identity.generate(), config=NodeConfig(), services=[server.service()])
    with LoopThread(name="test-file-server") as loop:
        loop.run(node.__aenter__(), timeout=30)
        server.endpoint = node.endpoint  # type: ignore[attr-defined]
        try:
            yield server
        finally:
            loop.run(node.__aexit__(None, None, None), timeout=30)


def dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_peer_reads_another_peers_files_and_only_the_datasets(dataset):
    index = read_index(dataset)
    with (
        peer_serving(dataset) as server,
        PeerReader([server.endpoint], timeout_s=10) as reader,  # type: ignore[attr-defined]
    ):
        at = server.endpoint  # type: ignore[attr-defined]
        for name in (INDEX, "tokenizer.json", shard_name(len(index.shards) - 1)):
            assert reader.read(at, index.dataset_id, name, 1 << 24) == (dataset / name).read_bytes()
        refused = [
            ("provenance.json", "INVALID_ARGUMENT"),
            ("../in.txt", "INVALID_ARGUMENT"),
            (shard_name(999), "NOT_FOUND"),
        ]
        for name, why in refused:
            with pytest.raises(OSError, match=why):
                reader.read(at, index.dataset_id, name, 1 << 24)
        with pytest.raises(OSError, match="NOT_FOUND"):  # a dataset it does not hold
            reader.read(at, "0" * 40, INDEX, 1 << 24)
        with pytest.raises(OSError, match="over 10"):
            reader.read(at, index.dataset_id, shard_name(0), 10)
    assert server.served_bytes > 0


def test_a_network_past_its_byte_budget_is_refused(dataset):
    index = read_index(dataset)
    size = (dataset / shard_name(0)).stat().st_size
    config = FilesConfig(budget_bytes=size * 1.5, limit_loopback=True)
    with (
        peer_serving(dataset, config) as server,
        PeerReader([server.endpoint], timeout_s=10) as reader,  # type: ignore[attr-defined]
    ):
        at = server.endpoint  # type: ignore[attr-defined]
        reader.read(at, index.dataset_id, shard_name(0), 1 << 24)
        with pytest.raises(OSError, match=r"RESOURCE_EXHAUSTED.*ask another peer"):
            reader.read(at, index.dataset_id, shard_name(1), 1 << 24)


def test_shards_come_from_a_peer_with_the_mirror_down_and_from_the_mirror_with_peers_gone(
    dataset, tmp_path, caplog
):
    index = read_index(dataset)
    tampered = tmp_path / "tampered"
    shutil.copytree(dataset, tampered)
    data = bytearray((tampered / shard_name(2)).read_bytes())
    data[3] ^= 0x55
    (tampered / shard_name(2)).write_bytes(bytes(data))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = HttpSource(f"http://127.0.0.1:{s.getsockname()[1]}", timeout_s=5)
    # The mirror is down: everything from the peer.
    with peer_serving(dataset) as server, PeerReader([server.endpoint], timeout_s=10) as reader:  # type: ignore[attr-defined]
        peer = PeerSource(server.endpoint, index.dataset_id, reader)  # type: ignore[attr-defined]
        cache = DatasetCache(tmp_path / "a", index.dataset_id, [peer, down])
        cache.all_shards(cache.index(), progress=False)
    # The peers are gone (one dead, one serving a tampered shard): the mirror's.
    with (
        peer_serving(tampered) as liar,
        serve_dataset(dataset) as mirror,
        PeerReader([liar.endpoint], timeout_s=10) as reader,  # type: ignore[attr-defined]
    ):
        sources = [
            PeerSource(dead_endpoint(), index.dataset_id, reader),
            PeerSource(liar.endpoint, index.dataset_id, reader),  # type: ignore[attr-defined]
            HttpSource(mirror),
        ]
        cache = DatasetCache(tmp_path / "b", index.dataset_id, sources)
        with caplog.at_level(logging.WARNING):
            cache.all_shards(cache.index(), progress=False)
        assert liar.served_bytes > 0
    assert f"refused {shard_name(2)} from peer {liar.endpoint}" in caplog.text  # type: ignore[attr-defined]
    for root in (tmp_path / "a", tmp_path / "b"):
        for i in range(len(index.shards)):
            assert (root / shard_name(i)).read_bytes() == (dataset / shard_name(i)).read_bytes()
