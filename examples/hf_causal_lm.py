"""Train a Hugging Face causal LM with a swarm, through transformers' own Trainer.

A small GPT-2 built from a config (nothing is downloaded) learns the bytes of the Python
standard library's source files, which every Python install ships. Needs the extra:
``pip install swarmloco[hf]``. Two peers on one machine::

    python examples/hf_causal_lm.py create --data-dir /tmp/lm-a --port 47100
    # it prints the swarm id; then, in another terminal:
    python examples/hf_causal_lm.py join SWARM_ID --peer 127.0.0.1:47100 --data-dir /tmp/lm-b

and the trained model out, loadable with ``GPT2LMHeadModel.from_pretrained("/tmp/lm")``::

    swarmloco export SWARM_ID --data-dir /tmp/lm-a --out /tmp/lm
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import swarmloco
from swarmloco.integrations.hf import SwarmCallback

SEQ = 64
TOTAL_STEPS = 400


def build_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # every peer starts from the same weights (else it fetches them)
    config = GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


class StdlibBytes(torch.utils.data.Dataset):
    """Windows of SEQ bytes from the standard library's own source files."""

    def __init__(self, files: int = 40) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        paths = sorted(root.glob("*.py"))[:files]
        data = b"".join(p.read_bytes() for p in paths)
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // SEQ

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.tokens[i * SEQ : (i + 1) * SEQ]
        return {"input_ids": window, "labels": window}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("create", "join"))
    p.add_argument("swarm_id", nargs="?", help="with join: the swarm id create printed")
    p.add_argument("--peer", action="append", default=[], help="HOST:PORT to join through")
    p.add_argument("--data-dir", required=True, help="this peer's key and checkpoints")
    p.add_argument("--port", type=int, default=0, help="port to serve on (0: any free)")
    p.add_argument("--sync-every", type=int, default=10, help="H: inner steps per round")
    p.add_argument("--max-rounds", type=int, default=None, help="leave at this round")
    p.add_argument(
        "--min-peers",
        type=int,
        default=1,
        help="smallest group to average in; training starts once this many peers are online",
    )
    p.add_argument(
        "--identity-work",
        type=int,
        default=None,
        help="create: bits of work each key proves to take part (default: 8; 0: none)",
    )
    p.add_argument("--events", nargs="?", const="-", help="JSON events on stdout (-)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    def on_event(event: dict) -> None:
        if event["event"] == "ready" and args.command == "create":
            print(event["swarm_id"], flush=True)
        if args.events:
            print(json.dumps(event), flush=True)

    config = swarmloco.PeerConfig(
        data_dir=Path(args.data_dir),
        max_rounds=args.max_rounds,
        matchmaking=swarmloco.MatchmakingConfig(min_group_size=args.min_peers),
    )
    common = dict(
        data_dir=args.data_dir,
        peers=args.peer,
        port=args.port,
        config=config,
        on_event=on_event,
        wait_for_peers=args.min_peers,
    )
    if args.command == "create":
        spec = swarmloco.RunSpec(sync_every=args.sync_every, total_steps=TOTAL_STEPS)
        callback = SwarmCallback(spec=spec, identity_work=args.identity_work, **common)
    else:
        if not args.swarm_id:
            p.error("join needs the SWARM_ID that create printed")
        callback = SwarmCallback(swarm_id=args.swarm_id, **common)
    # Each peer shuffles the data its own way (any per-peer seed will do).
    seed = int.from_bytes(hashlib.blake2b(args.data_dir.encode(), digest_size=4).digest())
    with tempfile.TemporaryDirectory() as scratch:
        training = TrainingArguments(
            output_dir=scratch,
            per_device_train_batch_size=8,
            max_steps=TOTAL_STEPS,
            learning_rate=1e-3,
            warmup_steps=20,
            lr_scheduler_type="cosine",
            logging_steps=10,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=seed,
            disable_tqdm=True,
        )
        model = build_model()
        trainer = Trainer(
            model=model, args=training, train_dataset=StdlibBytes(), callbacks=[callback]
        )
        trainer.train()
    swarm = callback.swarm  # the swarm it trained with, left
    assert swarm is not None
    print(f"left swarm {swarm.swarm_id[:12]} at round {swarm.round}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except swarmloco.SwarmlocoError as exc:
        sys.exit(f"error: {exc}")
