import numpy as np
import pytest
import torch

from swarmloco.errors import DataError
from swarmloco.train.data import BatchStream, eval_windows, load_tokens
from swarmloco.train.spec import DataSpec


@pytest.fixture(scope="module")
def stdlib():
    return load_tokens(DataSpec(), vocab_size=256)


def _stream(store, worker=0, seed=0):
    return BatchStream(store, seq_len=32, batch_size=4, vocab_size=256, seed=seed, worker=worker)


def test_stdlib_is_split_by_file_and_real_python(stdlib):
    assert stdlib.train.num_tokens > 1_000_000
    assert 0.01 < stdlib.val.num_tokens / stdlib.train.num_tokens < 0.15
    text = bytes(stdlib.train.segments[0][:200_000]).decode("utf-8", "replace")
    assert "def " in text and "import " in text
    again = load_tokens(DataSpec(), vocab_size=256)
    assert np.array_equal(again.val.segments[0], stdlib.val.segments[0])


def test_save_and_restore_yields_identical_next_batches(stdlib):
    stream = _stream(stdlib.train)
    for _ in range(5):
        stream.next_batch()
    state = stream.state_dict()
    expected = [stream.next_batch() for _ in range(4)]
    fresh = _stream(stdlib.train)
    fresh.load_state_dict(state)
    got = [fresh.next_batch() for _ in range(4)]
    for (x1, y1), (x2, y2) in zip(expected, got):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert fresh.batches_drawn == stream.batches_drawn == 9


def test_state_survives_json(stdlib):
    import json

    stream = _stream(stdlib.train)
    stream.next_batch()
    state = json.loads(json.dumps(stream.state_dict()))
    fresh = _stream(stdlib.train)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.next_batch()[0], stream.next_batch()[0])


def test_workers_draw_different_streams(stdlib):
    a = _stream(stdlib.train, worker=0).next_batch()[0]
    b = _stream(stdlib.train, worker=1).next_batch()[0]
    a2 = _stream(stdlib.train, worker=0).next_batch()[0]
    assert not torch.equal(a, b)
    assert torch.equal(a, a2)


def test_targets_are_inputs_shifted(stdlib):
    x, y = _stream(stdlib.train).next_batch()
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_eval_set_is_fixed(stdlib):
    a = eval_windows(stdlib.val, seq_len=64, count=16)
    b = eval_windows(stdlib.val, seq_len=64, count=16)
    assert a.shape == (16, 65) and torch.equal(a, b)


def test_text_directory_with_suffix_filter(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i}.txt").write_text(f"hello world {i}\n" * 50)
    (tmp_path / "skip.md").write_text("x" * 10_000)
    (tmp_path / "binary.txt").write_bytes(b"\x00\x01" * 100)
    data = load_tokens(DataSpec(source="text", paths=(str(tmp_path),), suffixes=(".txt",)), 256)
    total = data.train.num_tokens + data.val.num_tokens
    assert total == sum(len(f"hello world {i}\n" * 50) for i in range(40))
    assert data.val.num_tokens > 0
    assert "binary" in data.description


def test_single_text_file_is_split_by_position(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("abcdefgh" * 1000)
    data = load_tokens(DataSpec(source="text", paths=(str(f),), val_fraction=0.1), 256)
    assert data.val.num_tokens == 800 and data.train.num_tokens == 7200


def test_token_files_npy_and_bin(tmp_path):
    arr = (np.arange(10_000) % 1000).astype(np.uint16)
    np.save(tmp_path / "a.npy", arr)
    arr.tofile(tmp_path / "b.bin")
    spec = DataSpec(source="tokens", paths=(str(tmp_path / "a.npy"), str(tmp_path / "b.bin")))
    data = load_tokens(spec, vocab_size=1000)
    assert data.train.num_tokens == 2 * 9500
    stream = BatchStream(data.train, seq_len=16, batch_size=8, vocab_size=1000, seed=0, worker=0)
    x, y = stream.next_batch()
    assert torch.equal((x + 1) % 1000, y)  # consecutive tokens from the real arrays
    too_small = BatchStream(data.train, seq_len=16, batch_size=8, vocab_size=10, seed=0, worker=0)
    with pytest.raises(DataError, match="outside the vocabulary of 10"):
        too_small.next_batch()


@pytest.mark.parametrize(
    "spec,match",
    [
        (DataSpec(source="text", paths=("/nonexistent/dir",)), "does not exist"),
        (DataSpec(source="tokens", paths=("/nonexistent.npy",)), "does not exist"),
    ],
)
def test_missing_data_is_a_clear_error(spec, match):
    with pytest.raises(DataError, match=match):
        load_tokens(spec, 256)


def test_wrong_token_file_shape(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 4), dtype=np.int32))
    with pytest.raises(DataError, match="1-D integer"):
        load_tokens(DataSpec(source="tokens", paths=(str(tmp_path / "x.npy"),)), 256)


def test_data_too_short_for_a_window(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("tiny")
    data = load_tokens(DataSpec(source="text", paths=(str(f),)), 256)
    with pytest.raises(DataError, match="shorter seq_len"):
        _stream(data.train)


def test_malformed_state_is_a_clear_error(stdlib):
    with pytest.raises(DataError, match="malformed"):
        _stream(stdlib.train).load_state_dict({"rng": {"x": 1}})


def test_spec_validation():
    with pytest.raises(ValueError, match="needs at least one path"):
        DataSpec(source="text")
    with pytest.raises(ValueError, match="token_dtype"):
        DataSpec(source="tokens", paths=("a",), token_dtype="float32")
