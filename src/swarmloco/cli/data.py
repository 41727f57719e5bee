"""`swarmloco data`: prepare a corpus into token shards, describe or check one, serve one."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path


def _data_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "data",
        help="prepare a corpus into token shards for a run (prepare), describe or check one "
        "(info), serve one over HTTP (serve)",
        description="Datasets for a run: a corpus tokenized once into shards and an index "
        "whose hash is the dataset id (docs/DESIGN.md section 11).",
    )
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prepare = actions.add_parser(
        "prepare",
        help="tokenize text, JSONL or parquet into token shards and an index",
        description=(
            "Tokenize INPUT (files or directories: a text file is one document, a JSONL "
            "line one, a parquet row one) with a Hugging Face tokenizers file, in batches "
            "on every core, an end-of-text token after each document, into fixed-size "
            "shards of --out, with the tokenizer and an index written last. The dataset id "
            "(printed) is the index's hash: the same input and tokenizer give the same id."
        ),
        epilog=(
            "examples:\n"
            "  swarmloco data prepare corpus/ --tokenizer tokenizer.json --out data/\n"
            "  swarmloco data prepare docs.jsonl --text-field body --train-tokenizer 8192 "
            "--out data/\n"
            "  swarmloco data prepare part-*.parquet --tokenizer tokenizer.json --out data/"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prepare.add_argument("inputs", nargs="+", type=Path, metavar="INPUT")
    how = prepare.add_mutually_exclusive_group(required=True)
    how.add_argument("--tokenizer", type=Path, help="a tokenizers JSON file (tokenizer.json)")
    how.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB",
        help="train a byte-level BPE tokenizer of VOCAB tokens on the input first",
    )
    prepare.add_argument("--out", type=Path, required=True, help="a new or empty directory")
    prepare.add_argument(
        "--text-field",
        default="text",
        help="the JSONL field or parquet column holding the text (default: %(default)s)",
    )
    prepare.add_argument(
        "--shard-tokens",
        type=int,
        default=1 << 24,
        help="tokens a shard holds (default: %(default)s, 32 MiB of uint16)",
    )
    prepare.add_argument(
        "--eos",
        default=None,
        metavar="TOKEN",
        help="the end-of-text token after each document (default: the tokenizer's "
        "<|endoftext|>, </s>, <|end_of_text|> or <eos>)",
    )
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar")
    prepare.set_defaults(handler=_prepare)
    info = actions.add_parser(
        "info",
        help="print a prepared dataset's id and sizes, and check its shards",
        description="Print the id, tokens, shards and tokenizer hash of the dataset in DIR; "
        "with --verify, hash every shard and the tokenizer against the index (exit 1 if "
        "anything differs).",
    )
    info.add_argument("directory", type=Path, metavar="DIR")
    info.add_argument("--verify", action="store_true", help="hash every file against the index")
    info.add_argument("--json", action="store_true", help="one JSON object on stdout")
    info.set_defaults(handler=_info)
    serve = actions.add_parser(
        "serve",
        help="serve a prepared dataset over HTTP: a mirror for --dataset-mirror",
        description="Serve the dataset in DIR over HTTP (its index, tokenizer and shards, "
        "read-only, nothing else) until Ctrl-C: a mirror that `swarmloco create --dataset "
        "DIR --dataset-mirror http://HOST:PORT` names and joining peers fetch from. Any "
        "static file server of DIR does as well.",
    )
    serve.add_argument("directory", type=Path, metavar="DIR")
    serve.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8081, help="port (default: %(default)s)")
    serve.set_defaults(handler=_serve)


def _prepare(args: argparse.Namespace) -> int:
    from swarmloco.dataset.prepare import PrepareConfig, prepare

    config = PrepareConfig(shard_tokens=args.shard_tokens, text_field=args.text_field, eos=args.eos)
    done = prepare(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        train_vocab=args.train_tokenizer,
        config=config,
        progress=not args.no_progress,
    )
    logging.getLogger("swarmloco.data").info(
        "%d documents, %.1f MB of text: %d tokens in %d shard(s) of %s, %.2f MB/s",
        done.documents,
        done.text_bytes / 1e6,
        done.index.tokens,
        len(done.index.shards),
        done.index.dtype,
        done.megabytes_per_s,
    )
    print(done.index.dataset_id, flush=True)
    return 0


def _info(args: argparse.Namespace) -> int:
    from swarmloco.dataset.index import read_index, verify

    index = read_index(args.directory)
    problems = verify(args.directory, index) if args.verify else []
    summary = {
        "dataset_id": index.dataset_id,
        "tokens": index.tokens,
        "shards": len(index.shards),
        "dtype": index.dtype,
        "vocab_size": index.vocab_size,
        "eos": index.eos,
        "tokenizer_sha256": index.tokenizer_sha256,
    }
    if args.verify:
        summary["problems"] = problems
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        for key, value in summary.items():
            if key != "problems":
                print(f"{key:17} {value}")
        if args.verify:
            print("verified: every shard and the tokenizer match the index" if not problems
                  else "\n".join(f"problem: {p}" for p in problems))  # fmt: skip
    return 1 if problems else 0


def _serve(args: argparse.Namespace) -> int:
    import threading

    from swarmloco.dataset.index import read_index
    from swarmloco.dataset.serve import serve_dataset

    index = read_index(args.directory)
    with serve_dataset(args.directory, args.host, args.port) as url:
        print(url, flush=True)
        logging.getLogger("swarmloco.data").info(
            "serving dataset %s (%d shards) at %s until Ctrl-C",
            index.dataset_id,
            len(index.shards),
            url,
        )
        threading.Event().wait()
    return 0
