"""`swarmloco data prepare` and the dataset index, on generated text with tokenizers
trained on the spot (nothing downloaded): the id pins the content, the shards hold every
document and its end-of-text token in order, tampering and broken input are refused."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from swarmloco.cli import main
from swarmloco.dataset.index import INDEX, DatasetIndex, read_index, shard_name, verify
from swarmloco.dataset.prepare import PrepareConfig, input_files, prepare
from swarmloco.errors import DataError

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "peers",
         "average", "their", "rounds"]  # fmt: skip


def texts(n: int, seed: int = 0) -> list[str]:
    g = random.Random(seed)
    return [" ".join(g.choice(WORDS) for _ in range(g.randint(3, 40))) for _ in range(n)]


def corpus(root: Path) -> list[str]:
    """A directory of text files, a JSONL file and a parquet file; the documents in the
    order prepare reads them (the directory's files sorted by path, then the others)."""
    docs = texts(60)
    (root / "txt" / "b").mkdir(parents=True)
    (root / "txt" / "b" / "2.txt").write_text(docs[1])
    (root / "txt" / "1.txt").write_text(docs[0])
    (root / "txt" / ".hidden").write_text("never read")
    with (root / "docs.jsonl").open("w") as f:
        for d in docs[2:30]:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
        f.write("\n")  # a blank line is no document
    pq.write_table(pa.table({"body": docs[30:], "n": list(range(30))}), root / "more.parquet")
    return docs


def inputs(root: Path) -> list[Path]:
    return [root / "txt", root / "docs.jsonl", root / "more.parquet"]


def prepared_tokens(out: Path) -> np.ndarray:
    index = read_index(out)
    parts = [
        np.fromfile(out / shard_name(i), dtype=np.dtype(index.dtype).newbyteorder("<"))
        for i in range(len(index.shards))
    ]
    return np.concatenate(parts).astype(np.int64)


def test_the_shards_hold_every_document_in_order_each_followed_by_the_end_of_text(tmp_path):
    docs = corpus(tmp_path)
    assert [p.name for p in input_files(inputs(tmp_path))] == [
        "1.txt", "2.txt", "docs.jsonl", "more.parquet",
    ]  # fmt: skip
    config = PrepareConfig(shard_tokens=97, text_field="text")
    with pytest.raises(DataError, match=r"no column 'text'.*body"):
        prepare(inputs(tmp_path), tmp_path / "bad", train_vocab=300, config=config)
    # The JSONL's field is "text", the parquet's column "body": one field for all inputs,
    # so the parquet file is prepared on its own to name it.
    out = tmp_path / "out"
    done = prepare(inputs(tmp_path)[:2], out, train_vocab=300, config=config, progress=False)
    index = done.index
    assert done.documents == 30 and index.dtype == "uint16" and index.vocab_size <= 300
    assert [s.tokens for s in index.shards[:-1]] == [97] * (len(index.shards) - 1)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokens = prepared_tokens(out)
    assert tokens.size == index.tokens
    ends = np.flatnonzero(tokens == index.eos)
    assert len(ends) == 30 and ends[-1] == len(tokens) - 1
    starts = [0, *(ends[:-1] + 1)]
    decoded = [tokenizer.decode(tokens[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]
    assert decoded == docs[:30]
    assert verify(out, index) == []
    parquet = prepare(
        [tmp_path / "more.parquet"], tmp_path / "pq", tokenizer=out / "tokenizer.json",
        config=PrepareConfig(text_field="body"), progress=False,
    )  # fmt: skip
    assert parquet.documents == 30 and parquet.index.tokenizer_sha256 == index.tokenizer_sha256


def test_the_same_input_gives_the_same_id_and_a_changed_byte_another(tmp_path):
    (tmp_path / "in").mkdir()
    for i, doc in enumerate(texts(40, seed=1)):
        (tmp_path / "in" / f"{i:03}.txt").write_text(doc)
    config = PrepareConfig(shard_tokens=500)
    ids = [
        prepare([tmp_path / "in"], tmp_path / f"o{k}", train_vocab=320, config=config,
                progress=False).index.dataset_id
        for k in range(2)
    ]  # fmt: skip
    assert ids[0] == ids[1] and len(ids[0]) == 40
    with (tmp_path / "in" / "017.txt").open("a") as f:
        f.write("!")
    tok = tmp_path / "o0" / "tokenizer.json"
    again = prepare([tmp_path / "in"], tmp_path / "o2", tokenizer=tok, config=config,
                    progress=False)  # fmt: skip
    assert again.index.dataset_id != ids[0]
    # The id covers the content, not where it came from: the index read back gives it.
    assert read_index(tmp_path / "o0").dataset_id == ids[0]


def test_a_tampered_or_missing_shard_is_found_and_info_says_so(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("\n".join(texts(50)))
    out = tmp_path / "out"
    assert main(["-q", "data", "prepare", str(tmp_path / "a.txt"), "--train-tokenizer", "300",
                 "--out", str(out), "--shard-tokens", "64", "--no-progress"]) == 0  # fmt: skip
    dataset_id = capsys.readouterr().out.strip()
    assert main(["data", "info", str(out), "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dataset_id"] == dataset_id
    shard = out / shard_name(1)
    data = bytearray(shard.read_bytes())
    data[5] ^= 1
    shard.write_bytes(bytes(data))
    (out / shard_name(2)).unlink()
    assert main(["data", "info", str(out), "--verify"]) == 1
    printed = capsys.readouterr().out
    assert "shard-00001.bin does not match" in printed and "shard-00002.bin is missing" in printed


def test_a_vocabulary_over_65536_is_written_as_uint32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)} | {"</s>": 70_000, "[UNK]": 70_001}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tok.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 w65536 nope")
    done = prepare([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tmp_path / "tok.json",
                   progress=False)  # fmt: skip
    assert done.index.dtype == "uint32" and done.index.eos == 70_000
    assert prepared_tokens(tmp_path / "out").tolist() == [1, 69_999, 65_536, 70_001, 70_000]


def test_broken_input_is_refused_with_where_and_leaves_no_dataset(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text(" ".join(WORDS))
    tokenizer = prepare([good], tmp_path / "t", train_vocab=300, progress=False).directory
    tok = tokenizer / "tokenizer.json"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "also fine"}\nnot json\n')
    config = PrepareConfig(shard_tokens=2, batch_documents=1)  # shards before the bad line
    with pytest.raises(DataError, match=r"bad.jsonl:3: not a JSON object"):
        prepare([bad], tmp_path / "o1", tokenizer=tok, config=config, progress=False)
    assert any((tmp_path / "o1").glob("shard-*.bin"))
    with pytest.raises(DataError, match="holds no dataset"):
        read_index(tmp_path / "o1")  # no index: an interrupted preparation is no dataset
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: no text field 'text'"):
        prepare([bad], tmp_path / "o2", tokenizer=tok, progress=False)
    with pytest.raises(DataError, match="already holds dataset"):
        prepare([good], tokenizer, tokenizer=tok, progress=False)
    with pytest.raises(DataError, match="does not exist"):
        prepare([tmp_path / "nope"], tmp_path / "o3", tokenizer=tok, progress=False)
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(DataError, match="not a tokenizers JSON file"):
        prepare([good], tmp_path / "o4", tokenizer=tmp_path / "junk.json", progress=False)
    with pytest.raises(DataError, match=r"none of <\|endoftext\|>"):
        no_eos = Tokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
        no_eos.save(str(tmp_path / "no_eos.json"))
        prepare([good], tmp_path / "o5", tokenizer=tmp_path / "no_eos.json", progress=False)
    with pytest.raises(ValueError, match="not both"):
        prepare([good], tmp_path / "o6", tokenizer=tok, train_vocab=300)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"format": "other/1"}, "format"),
        ({"dtype": "float32"}, "'dtype'"),
        ({"vocab_size": 70_000}, "'vocab_size'"),  # over uint16's range
        ({"eos": 999}, "'eos'"),
        ({"tokenizer_sha256": "zz"}, "'tokenizer_sha256'"),
        ({"shards": [{"tokens": -1, "sha256": "0" * 64}]}, "shard 0"),
        ({"shards": [{"tokens": 5, "sha256": "bad"}]}, "shard 0"),
        ({"shards": "many"}, "'shards'"),
    ],
)
def test_an_index_that_is_not_ours_is_refused_naming_the_field(tmp_path, change, field):
    good = DatasetIndex(dtype="uint16", vocab_size=300, eos=0, tokenizer_sha256="a" * 64,
                        shards=())  # fmt: skip
    (tmp_path / INDEX).write_text(json.dumps({**good.to_json(), **change}))
    with pytest.raises(DataError, match=field):
        read_index(tmp_path)


def test_a_large_text_file_is_read_in_pieces_cut_after_newlines(tmp_path, monkeypatch):
    import swarmloco.dataset.prepare as prepare_module

    lines = [f"{' '.join(texts(1, seed=i)[0].split()[:8])} é {i}" for i in range(400)]
    (tmp_path / "big.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "long.txt").write_text("ü" * 3000, encoding="utf-8")  # one line, 6,000 bytes
    whole = prepare([tmp_path / "big.txt", tmp_path / "long.txt"], tmp_path / "whole",
                    train_vocab=300, progress=False)  # fmt: skip
    monkeypatch.setattr(prepare_module, "PIECE_BYTES", 512)  # many pieces, a line cut too
    pieces = list(prepare_module.documents([tmp_path / "big.txt"], "text"))
    assert len(pieces) > 10 and [ends for _, _, ends in pieces].count(True) == 1
    assert "".join(text for text, _, _ in pieces) == (tmp_path / "big.txt").read_text()
    long = list(prepare_module.documents([tmp_path / "long.txt"], "text"))
    assert "".join(text for text, _, _ in long) == "ü" * 3000  # never cut inside a character
    cut = prepare([tmp_path / "big.txt", tmp_path / "long.txt"], tmp_path / "cut",
                  tokenizer=whole.directory / "tokenizer.json", progress=False)  # fmt: skip
    assert cut.documents == whole.documents == 2  # the end-of-text after each file only
    tokens = prepared_tokens(tmp_path / "cut")
    assert (tokens == cut.index.eos).sum() == 2 and tokens[-1] == cut.index.eos
    tokenizer = Tokenizer.from_file(str(whole.directory / "tokenizer.json"))
    first = tokens[: np.flatnonzero(tokens == cut.index.eos)[0]].tolist()
    assert tokenizer.decode(first) == (tmp_path / "big.txt").read_text()


def test_a_full_disk_is_said_and_leaves_no_dataset(tmp_path, small_tmpfs):
    vocab = {f"w{i}": i for i in range(70_000)} | {"</s>": 70_000, "[UNK]": 70_001}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tok.json"))  # uint32: 4 bytes a word
    words = " ".join(f"w{i % 1000}" for i in range(1_000_000))  # 4 MB of tokens, a 3 MiB disk
    (tmp_path / "big.txt").write_text(words)
    out = small_tmpfs / "data"
    with pytest.raises(DataError, match=r"No space left on device.*the index is written last"):
        prepare([tmp_path / "big.txt"], out, tokenizer=tmp_path / "tok.json",
                config=PrepareConfig(shard_tokens=100_000), progress=False)  # fmt: skip
    with pytest.raises(DataError, match="holds no dataset"):
        read_index(out)


def _write_often(path: str, data: bytes, times: int, start) -> str:  # type: ignore[no-untyped-def]
    from swarmloco.dataset.index import write_whole

    start.wait()
    try:
        for _ in range(times):
            write_whole(Path(path), data)
    except OSError as exc:
        return repr(exc)
    return ""


def test_processes_keeping_the_same_file_at_once_each_write_it_whole(tmp_path):
    """The ranks of a box fill one dataset cache at once: each writes every file under a
    name of its own and renames it whole (with one temporary name for all, a rank's rename
    found the file gone and the box stopped)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    data = bytes(range(256)) * 4096  # 1 MiB
    path = tmp_path / "index.json"
    with ctx.Manager() as manager:
        start = manager.Barrier(2)
        with ctx.Pool(2) as pool:
            errors = pool.starmap(_write_often, [(str(path), data, 40, start)] * 2)
    assert errors == ["", ""]
    assert path.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"]  # no part left behind
