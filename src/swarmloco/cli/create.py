"""`swarmloco create`: a new swarm, and its first peer."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

from swarmloco.cli.box import _box_launch, _box_rank
from swarmloco.cli.common import (
    _add_data_dir_option,
    _add_data_options,
    _add_peer_option,
    _data_spec,
    _model_overrides,
    run_async,
)
from swarmloco.cli.peer import CLIENT_MODE_STAGE, _add_peer_run_options, _run_peer


def _create_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "create",
        help="create a swarm, print its id, and train as its first peer",
        description=(
            "Create a new swarm (a training run). The manifest (task, model, data, "
            "hyperparameters, your public key) is built from the options below; its hash is "
            "the swarm id, printed alone on the first line of stdout. Then this process "
            "trains as the swarm's first peer: it serves on --host/--port, publishes the "
            "manifest, and averages with every peer that joins "
            "(`swarmloco join SWARM_ID --peer HOST:PORT`). Without --peer it starts a new "
            "network (others join through this peer's address, logged at start). With "
            "--no-train the manifest is only published through --peer. The same command "
            "again with the same --data-dir (after Ctrl-C or a crash) resumes that swarm "
            "from its checkpoints, as its creator; other settings make a new swarm."
        ),
        epilog=(
            "examples:\n"
            "  swarmloco create --task gpt-bytes --preset tiny --host 127.0.0.1\n"
            "  swarmloco create --preset tiny --sync-every 100 --peer 127.0.0.1:31337\n"
            "  swarmloco create --preset tiny --peer 127.0.0.1:31337 --no-train"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _describe_tasks_in_help(parser)
    parser.add_argument(
        "--task",
        default="gpt-bytes",
        help="task to train (default: %(default)s; the list is at the end)",
    )
    parser.add_argument(
        "--preset",
        default="tiny",
        help="model size preset of the task (default: %(default)s; each preset's size and "
        "hyperparameters are at the end)",
    )
    parser.add_argument("--name", default="", help="a human label for dashboards (optional)")
    parser.add_argument(
        "--stages",
        type=int,
        default=None,
        metavar="S",
        help="a pipelined run: the model cut into S stages, each served by its own peers, "
        "micro-batches driven through one peer of each (gpt-bytes and llama; rounds overlap the "
        "steps: --delay defaults to 1); default: every peer holds the whole model",
    )
    parser.add_argument(
        "--activations",
        choices=("int8", "bf16", "f32"),
        default="int8",
        help="how a pipelined run's activations and gradients travel (default: %(default)s)",
    )
    _add_hyperparameter_options(
        parser.add_argument_group("hyperparameters (default: the preset's; all enter the manifest)")
    )
    parser.add_argument(
        "--private",
        action="store_true",
        help="a private run: only peers you admit take part (give each a certificate with "
        "`swarmloco admit PEER_ID --swarm SWARM_ID`); default: anyone may join",
    )
    parser.add_argument(
        "--identity-work",
        type=int,
        default=None,
        metavar="BITS",
        help="bits of work every peer's key proves for this run before it takes part: about "
        "2^BITS x 5 ms of one core, once per key and run, so that a stranger pays for each "
        "key it shows (default: 8, about a second, for a public run; 0 for a private one)",
    )
    _add_data_options(parser)
    parser.add_argument(
        "--dataset-mirror",
        action="append",
        default=[],
        metavar="URL",
        help="with --dataset: an HTTP(S) server of the dataset's files (URL/index.json, "
        "URL/shard-00000.bin, ...), where joining peers fetch it; repeat for several",
    )
    _add_peer_option(parser, required=False)
    _add_data_dir_option(
        parser,
        "peer",
        "where this peer keeps its key (its public half is the swarm's creator) and checkpoints",
    )
    parser.add_argument(
        "--no-train",
        action="store_true",
        help="only publish the manifest, then exit (`swarmloco join` with this --data-dir "
        "later trains as the creator, the peer dashboards trust by default)",
    )
    _add_peer_run_options(parser)
    parser.set_defaults(handler=_create)


def _add_hyperparameter_options(h: argparse._ArgumentGroup) -> None:
    """The run's hyperparameters: each enters the manifest (unset: the preset's)."""
    h.add_argument(
        "--sync-every", type=int, default=None, metavar="H", help="inner steps per round"
    )
    h.add_argument(
        "--fragments",
        type=int,
        default=None,
        metavar="F",
        help="Streaming DiLoCo: split the model into F fragments, each synced every H steps at "
        "staggered times (1: plain DiLoCo)",
    )
    h.add_argument(
        "--delay",
        type=int,
        default=None,
        metavar="TAU",
        help="Streaming DiLoCo: inner steps a fragment's exchange overlaps before it is applied",
    )
    h.add_argument(
        "--alpha",
        type=float,
        default=None,
        help="Streaming DiLoCo: on landing, local = lerp(global, local, alpha) (0: global)",
    )
    h.add_argument("--batch-size", type=int, default=None, help="sequences per inner step")
    h.add_argument("--lr", type=float, default=None, help="peak inner learning rate")
    h.add_argument(
        "--warmup",
        type=int,
        default=None,
        metavar="STEPS",
        help="inner learning-rate warmup in the swarm's inner steps (tiny: 150, three "
        "rounds of H = 50). A warmup over several rounds learns better from scratch: the "
        "first pseudo-gradients do not carry the whole initial drop of the loss, which "
        "outer momentum would keep re-applying",
    )
    h.add_argument("--outer-lr", type=float, default=None, help="outer learning rate")
    h.add_argument(
        "--outer-momentum",
        type=float,
        default=None,
        help="outer Nesterov momentum (0.9, the papers'; in small runs with small batches "
        "0.5 learned better: compare them with `swarmloco simulate --sweep`)",
    )
    h.add_argument(
        "--total-steps",
        type=int,
        default=None,
        help="the run's length in the swarm's inner steps (rounds x H / F); the cosine "
        "schedule ends there too",
    )
    h.add_argument(
        "--aggregator",
        choices=("mean", "trimmed_mean", "centered_clip"),
        default=None,
        help="how each part's reducer combines the members' updates (default: trimmed_mean "
        "in a public run, where anyone may send a lie; mean in a private one)",
    )
    h.add_argument("--seed", type=int, default=None, help="seed of the initial model and data")


def _describe_tasks_in_help(parser: argparse.ArgumentParser) -> None:
    """Append the tasks and presets to ``parser``'s help, computed only when it is printed
    (listing them imports torch, which other commands' start should not wait for)."""
    plain = parser.format_help

    def with_tasks() -> str:
        from swarmloco.train.tasks import describe_tasks

        return plain().rstrip("\n") + "\n\n" + describe_tasks() + "\n"

    parser.format_help = with_tasks  # type: ignore[method-assign]


def _create(args: argparse.Namespace) -> int:
    from swarmloco.net.identity import Identity
    from swarmloco.runtime.api import created_before
    from swarmloco.train.tasks import build_manifest  # imports torch

    launched = _box_launch(args)
    if launched is not None:
        return launched
    if _box_rank() > 0:
        return _run_peer(None, args)  # rank 0 makes the manifest and sends it

    if args.no_train and not args.peers:
        raise ValueError("--no-train publishes the manifest through a peer: pass --peer HOST:PORT")
    if args.client_mode and not args.peers:
        raise ValueError(
            "--client-mode serves nothing, so others could never reach this swarm: pass "
            "--peer HOST:PORT of a serving peer or bootstrap node"
        )
    if args.client_mode and args.stages is not None and not args.no_train:
        raise ValueError(CLIENT_MODE_STAGE)
    identity = Identity.load_or_create(args.data_dir)
    run = _run_from(args)
    data, overrides = _data_spec(args), _model_overrides(args)
    if args.dataset is not None:
        data, vocab = _pinned_dataset(args)
        overrides.setdefault("vocab_size", vocab)
    options = {
        "creator": identity.public_key.hex(),
        "name": args.name,
        "data": data,
        "run": run,
        "model_overrides": overrides or None,
        "admission": "certificate" if args.private else "",
        "identity_work": args.identity_work,
    }
    if args.stages is not None:
        from swarmloco.pipeline.daemon import build_pipeline_manifest

        if args.delay is None:  # a pipelined run's rounds overlap its steps
            options["run"] = dataclasses.replace(run, spec=dataclasses.replace(run.spec, delay=1))
        manifest = build_pipeline_manifest(
            args.task, args.preset, args.stages, encoding=args.activations, **options
        )
    else:
        manifest = build_manifest(args.task, args.preset, **options)
    # The same create command in the same data directory resumes its swarm as the creator.
    manifest = created_before(manifest, Path(args.data_dir))
    print(manifest.swarm_id, flush=True)
    if not args.no_train:
        return _run_peer(manifest, args)

    async def publish() -> int:
        from swarmloco.net.node import NetNode, NodeConfig
        from swarmloco.net.swarm import publish_manifest

        config = NodeConfig(server=None, peers=tuple(args.peers))
        async with NetNode(identity=identity, config=config) as node:
            return await publish_manifest(node.dht, manifest)

    stored = run_async(publish())
    logging.getLogger("swarmloco.create").info(
        "published the manifest of swarm %s on %d DHT nodes", manifest.swarm_id, stored
    )
    return 0


def _pinned_dataset(args: argparse.Namespace) -> tuple[Any, int]:
    """The data spec pinning ``--dataset`` (a prepared directory, or an id whose index
    ``--dataset-mirror`` serves), and the dataset's vocabulary size."""
    import re

    from swarmloco.dataset.fetch import DatasetCache, sources_for
    from swarmloco.dataset.index import read_index
    from swarmloco.train.spec import DataSpec

    if args.data:
        raise ValueError("--data and --dataset are two sources of data: give one")
    path = Path(args.dataset)
    if path.is_dir():
        index = read_index(path)
    else:
        dataset_id = args.dataset.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{40}", dataset_id):
            raise ValueError(
                f"--dataset {args.dataset}: neither a directory nor a dataset id (40 hex digits)"
            )
        if not args.dataset_mirror:
            raise ValueError(f"--dataset {dataset_id} needs --dataset-mirror URL to find it")
        cache = Path(args.data_dir) / "datasets" / dataset_id
        index = DatasetCache(cache, dataset_id, sources_for(args.dataset_mirror, ())).index()
    if args.vocab_size is not None and args.vocab_size < index.vocab_size:
        raise ValueError(
            f"--vocab-size {args.vocab_size} is smaller than the dataset's vocabulary "
            f"({index.vocab_size})"
        )
    spec = DataSpec(source="dataset", dataset=index.dataset_id, mirrors=tuple(args.dataset_mirror))
    return spec, index.vocab_size


def _run_from(args: argparse.Namespace) -> Any:
    """The task preset's run with the hyperparameters given on the command line."""
    from swarmloco.train.tasks import get_task

    run = get_task(args.task).default_run(args.preset)
    inner_changes = {
        k: v
        for k, v in (
            ("batch_size", args.batch_size),
            ("lr", args.lr),
            ("warmup_steps", args.warmup),
            ("total_steps", args.total_steps),
        )
        if v is not None
    }
    run = dataclasses.replace(run, inner=dataclasses.replace(run.inner, **inner_changes))
    if run.inner.warmup_steps > run.inner.total_steps:
        raise ValueError(
            f"--warmup {run.inner.warmup_steps} is longer than the run "
            f"({run.inner.total_steps} steps): the peak learning rate would never be reached"
        )
    spec_changes: dict[str, Any] = {
        k: v
        for k, v in (
            ("sync_every", args.sync_every),
            ("fragments", args.fragments),
            ("delay", args.delay),
            ("alpha", args.alpha),
            ("outer_lr", args.outer_lr),
            ("outer_momentum", args.outer_momentum),
            ("seed", args.seed),
            ("total_steps", args.total_steps),
            ("aggregator", args.aggregator),
        )
        if v is not None
    }
    run = dataclasses.replace(run, spec=dataclasses.replace(run.spec, **spec_changes))
    return run
