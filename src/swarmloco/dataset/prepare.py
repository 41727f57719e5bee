"""``swarmloco data prepare``: text, JSONL or parquet into token shards and an index
(``docs/DESIGN.md`` section 11).

The documents are read in a fixed order (the inputs as given, a directory's files sorted by
their path within it): a text file is one document, a JSONL line one (its ``text_field``),
a parquet row one (that column). They are tokenized in batches by the Hugging Face
``tokenizers`` library (``encode_batch`` runs on every core), each followed by the
end-of-text id, and written in shards of ``shard_tokens`` tokens (the last one shorter),
each to a temporary name and renamed when whole. The tokenizer is copied beside them, the
provenance written, and the index last: an interrupted preparation leaves no index, so no
dataset. The same input and tokenizer give the same shards, so the same dataset id.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from swarmloco.core.config import require_int
from swarmloco.dataset.index import (
    DTYPES,
    INDEX,
    PROVENANCE,
    TOKENIZER,
    DatasetIndex,
    Shard,
    read_index,
    shard_name,
    write_whole,
)
from swarmloco.errors import DataError
from swarmloco.progress import Progress

logger = logging.getLogger(__name__)

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
"""End-of-text tokens looked for in a given tokenizer, in this order (``--eos`` names
another)."""
TRAINED_EOS = "<|endoftext|>"
PIECE_BYTES = 4 << 20
"""A text file is read (and tokenized) this much at a time, cut after a newline."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    shard_tokens: int = 1 << 24
    """Tokens a shard holds (the last one fewer): 2^24 is 32 MiB of uint16."""
    text_field: str = "text"
    """The field of a JSONL object, or the column of a parquet file, that holds the text."""
    batch_documents: int = 256
    """Documents tokenized in one call (``encode_batch`` spreads them over the cores)."""
    eos: str | None = None
    """The end-of-text token put after each document (None: the tokenizer's own, one of
    :data:`EOS_NAMES`)."""

    def __post_init__(self) -> None:
        require_int("shard_tokens", self.shard_tokens, minimum=1)
        require_int("batch_documents", self.batch_documents, minimum=1)
        if not self.text_field:
            raise ValueError("text_field must name a field")


@dataclasses.dataclass(frozen=True)
class Prepared:
    directory: Path
    index: DatasetIndex
    documents: int
    text_bytes: int
    seconds: float

    @property
    def megabytes_per_s(self) -> float:
        return self.text_bytes / 1e6 / max(self.seconds, 1e-9)


def input_files(inputs: Sequence[Path]) -> list[Path]:
    """Every file to read, in order: the inputs as given, a directory's files (hidden ones
    left out) sorted by their path within it."""
    files: list[Path] = []
    for path in inputs:
        if path.is_dir():
            found = {p.relative_to(path).as_posix(): p for p in path.rglob("*") if p.is_file()}
            hidden = [name for name in found if any(x.startswith(".") for x in name.split("/"))]
            files.extend(found[name] for name in sorted(set(found) - set(hidden)))
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"input {path} does not exist")
    if not files:
        raise DataError(f"no files in {', '.join(map(str, inputs))}")
    return files


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _open(path: Path) -> IO[bytes]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]  # a GzipFile reads bytes
    return path.open("rb")


def documents(files: Iterable[Path], text_field: str) -> Iterator[tuple[str, int, bool]]:
    """Each document's text, the input bytes it was read from (for the progress), and
    whether it ends there: a text file over :data:`PIECE_BYTES` comes in pieces cut after a
    newline (memory stays bounded whatever the file's size), the last one ending it."""
    for path in files:
        kind = _kind(path)
        if kind == "text":
            yield from _text(path)
        elif kind == "jsonl":
            yield from ((text, size, True) for text, size in _jsonl(path, text_field))
        else:
            yield from ((text, size, True) for text, size in _parquet(path, text_field))


def _text(path: Path) -> Iterator[tuple[str, int, bool]]:
    replaced = False
    with _open(path) as f:
        carry = b""
        while True:
            block = f.read(PIECE_BYTES)
            data = carry + block
            if block:
                cut = data.rfind(b"\n") + 1  # a newline is one byte in UTF-8: a safe cut
                if not cut and len(data) >= 4 * PIECE_BYTES:  # one very long line
                    cut = len(data)
                    while cut > 0 and 0x80 <= data[cut - 1] < 0xC0:  # not inside a character
                        cut -= 1
                    cut = max(cut - 1, 1)
                if not cut:
                    carry = data
                    continue
                piece, carry = data[:cut], data[cut:]
            else:
                piece, carry = data, b""
            text = piece.decode("utf-8", errors="replace")
            replaced = replaced or ("\ufffd" in text and b"\xef\xbf\xbd" not in piece)
            if not block:
                if replaced:
                    logger.warning("%s is not all UTF-8: undecodable bytes became U+FFFD", path)
                yield text, len(piece), True
                return
            yield text, len(piece), False


def _jsonl(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    with _open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}:{number}: not a JSON object ({exc})") from None
            text = value.get(text_field) if isinstance(value, dict) else None
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{number}: no text field {text_field!r} (--text-field names another)"
                )
            yield text, len(line)


def _parquet(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading parquet needs pyarrow (pip install 'swarmloco[data]')"
        ) from None
    try:
        f = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's errors have no common base of ours
        raise DataError(f"{path}: not a parquet file ({exc})") from None
    if text_field not in f.schema_arrow.names:
        raise DataError(
            f"{path}: no column {text_field!r} (it has {', '.join(f.schema_arrow.names)}; "
            "--text-field names another)"
        )
    rows = max(1, f.metadata.num_rows)
    per_row = path.stat().st_size / rows
    for batch in f.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield str(text), int(per_row)


def train_tokenizer(files: Sequence[Path], vocab_size: int, text_field: str) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` trained on the documents of ``files``
    (its end-of-text token :data:`TRAINED_EOS`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 256 < vocab_size <= 1 << 32:
        raise ValueError(f"a trained tokenizer's vocabulary must exceed 256, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TRAINED_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((text for text, _, _ in documents(files, text_field)), trainer)
    return tokenizer


def eos_id(tokenizer: Any, name: str | None) -> int:
    names = (name,) if name else EOS_NAMES
    for candidate in names:
        token = tokenizer.token_to_id(candidate)
        if token is not None:
            return int(token)
    if name:
        raise DataError(f"the tokenizer has no token {name!r}")
    raise DataError(
        f"the tokenizer has none of {', '.join(EOS_NAMES)}: name its end-of-text token with --eos"
    )


class _ShardWriter:
    """Tokens into shards of ``size``, each written whole under a temporary name first."""

    def __init__(self, directory: Path, size: int, dtype: str) -> None:
        self.directory = directory
        self.buffer = np.empty(size, dtype=np.dtype(dtype).newbyteorder("<"))
        self.filled = 0
        self.shards: list[Shard] = []

    def add(self, ids: Sequence[int]) -> None:
        tokens = np.asarray(ids, dtype=np.int64)
        while len(tokens):
            room = len(self.buffer) - self.filled
            take = tokens[:room]
            self.buffer[self.filled : self.filled + len(take)] = take
            self.filled += len(take)
            tokens = tokens[room:]
            if self.filled == len(self.buffer):
                self.flush()

    def flush(self) -> None:
        if not self.filled:
            return
        data = self.buffer[: self.filled].tobytes()
        path = self.directory / shard_name(len(self.shards))
        write_whole(path, data)
        self.shards.append(Shard(self.filled, hashlib.sha256(data).hexdigest()))
        self.filled = 0


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        try:
            held = f"dataset {read_index(out).dataset_id}"
        except DataError:
            held = "files"
        raise DataError(f"{out} already holds {held}: give an empty or new --out directory")


def prepare(
    inputs: Sequence[Path],
    out: Path,
    *,
    tokenizer: Path | None = None,
    train_vocab: int | None = None,
    config: PrepareConfig | None = None,
    progress: bool = True,
) -> Prepared:
    """Prepare the dataset of ``inputs`` in ``out`` (new or empty) with the tokenizer file
    ``tokenizer``, or one of ``train_vocab`` tokens trained on the inputs first."""
    from tokenizers import Tokenizer

    config = config or PrepareConfig()
    if (tokenizer is None) == (train_vocab is None):
        raise ValueError("give a tokenizer file or a vocabulary size to train one, not both")
    files = input_files(inputs)
    _check_out(out)
    started = time.monotonic()
    if tokenizer is not None:
        try:
            tokenizer_bytes = tokenizer.read_bytes()
            tok = Tokenizer.from_str(tokenizer_bytes.decode("utf-8"))
        except Exception as exc:  # OSError, UnicodeError, or the library's plain Exception
            raise DataError(f"{tokenizer}: not a tokenizers JSON file ({exc})") from None
    else:
        assert train_vocab is not None
        logger.info("training a BPE tokenizer of %d tokens on the input", train_vocab)
        tok = train_tokenizer(files, train_vocab, config.text_field)
        tokenizer_bytes = tok.to_str().encode("utf-8")
    eos = eos_id(tok, config.eos)
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    dtype = next(name for name, size in DTYPES.items() if vocab <= 1 << (8 * size))
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_whole(out / TOKENIZER, tokenizer_bytes)
        shards, count, read = _tokenize(files, out, tok, eos, dtype, config, progress)
    except OSError as exc:
        where = exc.filename or out
        raise DataError(
            f"{where}: {exc.strerror or exc} (nothing in {out} counts as a dataset: the index "
            "is written last; free some space or give another --out, and prepare again)"
        ) from None
    if not shards:
        raise DataError(f"no documents in {', '.join(map(str, inputs))}")
    index = DatasetIndex(
        dtype=dtype,
        vocab_size=vocab,
        eos=eos,
        tokenizer_sha256=hashlib.sha256(tokenizer_bytes).hexdigest(),
        shards=tuple(shards),
    )
    seconds = time.monotonic() - started
    provenance = {
        "dataset_id": index.dataset_id,
        "inputs": [str(p) for p in inputs],
        "files": len(files),
        "documents": count,
        "text_bytes": read,
        "tokenizer": str(tokenizer) if tokenizer is not None else f"trained, {train_vocab}",
        "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(seconds, 3),
    }
    try:
        write_whole(out / PROVENANCE, json.dumps(provenance, indent=2).encode())
        write_whole(out / INDEX, json.dumps(index.to_json(), indent=1).encode())  # last
    except OSError as exc:
        raise DataError(f"{out}: {exc.strerror or exc}: the dataset has no index") from None
    return Prepared(out, index, count, read, seconds)


def _tokenize(
    files: Sequence[Path],
    out: Path,
    tok: Any,
    eos: int,
    dtype: str,
    config: PrepareConfig,
    progress: bool,
) -> tuple[list[Shard], int, int]:
    """Every document of ``files`` tokenized into shards in ``out``: the shards, the
    documents and the input bytes read."""
    writer = _ShardWriter(out, config.shard_tokens, dtype)
    bar = Progress(sum(p.stat().st_size for p in files), "prepare", enabled=progress)
    count = read = 0
    batch: list[tuple[str, bool]] = []
    batch_bytes = 0

    def encode() -> None:
        nonlocal batch, batch_bytes
        encodings = tok.encode_batch([text for text, _ in batch], add_special_tokens=False)
        for encoding, (_, ends) in zip(encodings, batch, strict=True):
            writer.add([*encoding.ids, eos] if ends else encoding.ids)
        bar.update(batch_bytes)
        batch, batch_bytes = [], 0

    for text, size, ends in documents(files, config.text_field):
        batch.append((text, ends))
        batch_bytes += size
        count += ends
        read += size
        if len(batch) >= config.batch_documents:
            encode()
    if batch:
        encode()
    writer.flush()
    bar.close()
    return writer.shards, count, read
