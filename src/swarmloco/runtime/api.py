"""The library API: :func:`create` and :func:`join` a swarm with your own model.

::

    import swarmloco
    spec = swarmloco.RunSpec(sync_every=100, total_steps=10_000)
    swarm = swarmloco.create(spec, model, optimizer, data_dir="peer0", tokens_per_step=512)
    print(swarm.swarm_id)                    # give it to the others
    sched = swarm.scheduler(lambda step: min(1.0, (step + 1) / 500))   # follows the swarm
    with swarm:                              # checks the model, resumes, catches up
        for x, y in loader:                  # your loop, optimizer, scaler, clipping
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()                 # rounds start and land after this step
            sched.step()
            optimizer.zero_grad()

and on another machine, ``swarmloco.join(SWARM_ID, model, optimizer, data_dir="peer1",
peers=["HOST:PORT"], tokens_per_step=512)`` with the same model. Both return a
:class:`~.swarm.Swarm`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from swarmloco.core.manifest import SwarmManifest, identity_work_for
from swarmloco.core.runspec import RunSpec
from swarmloco.core.signature import LayerUnit, ModelSignature, default_layer_unit, signature_of
from swarmloco.errors import ManifestError
from swarmloco.net.identity import Identity
from swarmloco.runtime.box import Box, BoxRank, unwrap, whole_values
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.swarm import Evaluator, EventSink, Swarm

CUSTOM_TASK = "custom"
"""The task name of runs whose model lives in their creator's own script."""

logger = logging.getLogger("swarmloco.create")


def created_before(manifest: SwarmManifest, data_dir: Path) -> SwarmManifest:
    """The swarm to run for ``create``: ``manifest``, unless ``data_dir`` already holds the
    checkpoints of a swarm this key created with the same settings (every field but the
    creation time and the salt), which is then resumed, as the creator. So the same
    ``create`` command after a crash or Ctrl-C goes on with the same swarm; a swarm of
    other settings in the same directory is named in the log, with how to resume it."""
    swarms = data_dir / "swarms"
    if not swarms.is_dir():
        return manifest
    same: list[SwarmManifest] = []
    other: list[SwarmManifest] = []
    for copy in sorted(swarms.glob("*/manifest.json")):
        try:
            old = SwarmManifest.from_bytes(copy.read_bytes(), expected_id=copy.parent.name)
        except (OSError, ManifestError):
            continue  # not a swarm of ours to resume (a torn or foreign copy)
        checkpoints = copy.parent / "checkpoints"
        if old.creator != manifest.creator or not (
            checkpoints.is_dir() and any(checkpoints.iterdir())
        ):
            continue
        salted = dataclasses.replace(old, created_at=manifest.created_at, nonce=manifest.nonce)
        (same if salted.to_bytes() == manifest.to_bytes() else other).append(old)
    if same:
        old = max(same, key=lambda m: m.created_at)
        logger.info(
            "resuming swarm %s, created by this key on %s with the same settings, from its "
            "checkpoints in %s (a new swarm needs another data directory)",
            old.swarm_id,
            old.created_at,
            data_dir,
        )
        return old
    for old in other:
        logger.info(
            "%s also holds swarm %s (created %s, other settings); this is a new swarm. "
            "To resume that one: swarmloco join %s --data-dir %s",
            data_dir,
            old.swarm_id,
            old.created_at,
            old.swarm_id,
            data_dir,
        )
    return manifest


def run_manifest(
    spec: RunSpec,
    signature: ModelSignature,
    *,
    creator: str,
    task: str = CUSTOM_TASK,
    name: str = "",
    model: Mapping[str, Any] | None = None,
    data: Mapping[str, Any] | None = None,
    admission: str = "",
    identity_work: int | None = None,
) -> SwarmManifest:
    """The manifest of a run of a user's model: the spec, the model's signature, and any
    model description worth keeping (``model``, e.g. a Hugging Face config for export).
    ``identity_work``: bits of work each key proves (default: 8 public, 0 private)."""
    return SwarmManifest(
        task=task,
        model={**(model or {}), "signature": signature.to_manifest()},
        data=dict(data or {}),
        hparams={"run": spec.for_run(private=bool(admission)).to_manifest()},
        creator=creator,
        name=name,
        admission=admission,
        identity_work=identity_work_for(identity_work, private=bool(admission)),
    )


def peer_config(
    config: PeerConfig | None,
    *,
    data_dir: str | Path | None,
    peers: Sequence[str],
    tokens_per_step: int | None,
    host: str | None,
    port: int | None,
) -> PeerConfig:
    """``config`` (or the defaults) with the shortcuts given as arguments applied."""
    config = config or PeerConfig()
    changes: dict[str, Any] = {}
    if data_dir is not None:
        if config.data_dir is not None and config.data_dir != Path(data_dir):
            raise ValueError(
                f"two data directories: data_dir={str(data_dir)!r} and the config's "
                f"{str(config.data_dir)!r}; give one"
            )
        changes["data_dir"] = Path(data_dir)
    elif config.data_dir is None:
        raise ValueError("give data_dir (where the peer keeps its key and checkpoints)")
    if tokens_per_step is not None:
        changes["tokens_per_step"] = tokens_per_step
    node = config.node
    if peers:
        node = dataclasses.replace(node, peers=tuple(peers))
    if node.server is not None:
        server = node.server
        if host is not None:
            server = dataclasses.replace(server, host=host)
        if port is not None:
            server = dataclasses.replace(server, port=port)
        node = dataclasses.replace(node, server=server)
    if node != config.node:
        changes["node"] = node
    return dataclasses.replace(config, **changes) if changes else config


def create(
    spec: RunSpec,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data_dir: str | Path | None = None,
    peers: Sequence[str] = (),
    tokens_per_step: int | None = None,
    name: str = "",
    task: str = CUSTOM_TASK,
    layer_unit: LayerUnit = default_layer_unit,
    model_info: Mapping[str, Any] | None = None,
    host: str | None = None,
    port: int | None = None,
    config: PeerConfig | None = None,
    on_event: EventSink | None = None,
    evaluate: Evaluator | None = None,
    private: bool = False,
    identity_work: int | None = None,
    box: Box | None = None,
) -> Swarm:
    """A new swarm training ``model`` (its current weights are the run's initial weights),
    with this process as its first peer. The swarm id is ``swarm.swarm_id``; other peers
    :func:`join` it with the same model. Called again with the same settings and
    ``data_dir`` (after a crash, Ctrl-C or the end of the script), it resumes that swarm
    from its checkpoints instead, as its creator (:func:`created_before`).

    ``data_dir``: the peer's key and checkpoints (or ``config.data_dir``). ``peers``:
    HOST:PORT of peers or bootstrap nodes to join through (none: start a network; others
    join through this peer's address, ``swarm.endpoint`` once entered). ``tokens_per_step``:
    what one optimizer step trains on (the weight of this peer's update in a round, and
    the step a round is H of: peers may differ, each does about H of its own).
    ``layer_unit``: the layer of a parameter, for Streaming DiLoCo fragments.
    ``model_info``: kept in the manifest beside the signature (``swarmloco export`` writes
    a ``config`` entry as ``config.json``).
    ``host``/``port``: where to serve (default 127.0.0.1, any free port). ``config``: every
    other choice of the peer (:class:`PeerConfig`). ``evaluate``: the global model's loss,
    run every ``config.eval_every`` rounds (see :meth:`Swarm.load_global_into`).
    ``private``: only peers this key admits take part (:func:`admit`); default: anyone.
    ``identity_work``: bits of work every key proves to take part (about 2^bits x 5 ms of
    one core, once per key and run; default 8 for a public run, 0 for a private one).
    ``box``: the ranks of this machine that train the model together (under torchrun, with
    DDP or FSDP2): call ``create`` on every rank with the same arguments; rank 0 is the peer
    and gets the :class:`Swarm`, the other ranks a :class:`BoxRank` that follows it (what a
    loop uses: ``with``, ``step``, ``stopping``, ``round``, ``global_step``, ``data_seed``,
    ``register``, ``scheduler``, ``lr_lambda``, ``log``, ``discard_local``).
    """
    config = peer_config(
        config,
        data_dir=data_dir,
        peers=peers,
        tokens_per_step=tokens_per_step,
        host=host,
        port=port,
    )
    model = unwrap(model)
    values = whole_values(box, model)  # every rank takes part when the model is sharded
    if box is not None and not box.leader:
        return _follower(box, model, optimizer, config)
    identity, manifest = _key_and_swarm(
        spec,
        model,
        config.directory,
        values=values,
        layer_unit=layer_unit,
        task=task,
        name=name,
        model_info=model_info,
        private=private,
        identity_work=identity_work,
    )
    return Swarm(
        manifest,
        model,
        optimizer,
        config,
        identity=identity,
        on_event=on_event,
        evaluate=evaluate,
        box=box,
    )


def join(
    swarm_id: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data_dir: str | Path | None = None,
    peers: Sequence[str] = (),
    tokens_per_step: int | None = None,
    host: str | None = None,
    port: int | None = None,
    config: PeerConfig | None = None,
    on_event: EventSink | None = None,
    evaluate: Evaluator | None = None,
    membership: str = "",
    box: Box | None = None,
) -> Swarm:
    """A peer of the swarm ``swarm_id`` training ``model``, which must be the swarm's
    (the same parameter names, shapes and dtypes: checked on enter, before the peer
    averages anything). The manifest is fetched through ``peers`` on enter (or read from
    the data directory's copy when no peer has it). ``membership``: a private swarm's
    certificate for this peer (from :func:`admit`; kept in the data directory after).
    Other arguments as for :func:`create` (``box`` too: every rank calls ``join``)."""
    config = peer_config(
        config,
        data_dir=data_dir,
        peers=peers,
        tokens_per_step=tokens_per_step,
        host=host,
        port=port,
    )
    if membership:
        config = dataclasses.replace(config, membership=membership)
    if box is not None and not box.leader:
        return _follower(box, model, optimizer, config)
    identity = Identity.load_or_create(config.directory)
    return Swarm(
        swarm_id,
        model,
        optimizer,
        config,
        identity=identity,
        on_event=on_event,
        evaluate=evaluate,
        box=box,
    )


def _key_and_swarm(
    spec: RunSpec,
    model: torch.nn.Module,
    data_dir: Path,
    *,
    values: Sequence[torch.Tensor] | None,
    layer_unit: LayerUnit,
    task: str,
    name: str,
    model_info: Mapping[str, Any] | None,
    private: bool,
    identity_work: int | None,
) -> tuple[Identity, SwarmManifest]:
    """The key in ``data_dir`` (made on first use) and the swarm :func:`create` runs with
    it: a new one of ``spec`` training ``model`` (its whole parameter ``values`` when
    sharded), unless ``data_dir`` holds the same one created before
    (:func:`created_before`)."""
    identity = Identity.load_or_create(data_dir)
    signature = signature_of(
        model,
        fragments=spec.fragments,
        block_size=spec.codec.block_size,
        layer_unit=layer_unit,
        values=values,
    )
    manifest = run_manifest(
        spec,
        signature,
        creator=identity.public_key.hex(),
        task=task,
        name=name,
        model=model_info,
        admission="certificate" if private else "",
        identity_work=identity_work,
    )
    return identity, created_before(manifest, data_dir)


def _follower(
    box: Box, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: PeerConfig
) -> Swarm:
    """A rank other than 0 of a box: a :class:`BoxRank`, which offers what a training loop
    uses of a :class:`Swarm` (typed as one so that one script serves every rank)."""
    return cast(Swarm, BoxRank(box, model, optimizer, hook=config.hook))


def admit(swarm_id: str, peer_id: str, *, data_dir: str | Path, days: float = 0.0) -> str:
    """A membership certificate (one line of text) for ``peer_id`` in the private swarm
    ``swarm_id``, signed with the creator's key in ``data_dir``; it expires after ``days``
    (0: never). The peer passes it to :func:`join` as ``membership``."""
    import time

    from swarmloco.net.admission import Membership

    identity = Identity.load_or_create(Path(data_dir))
    expires_at = int(time.time() + days * 86400) if days else 0
    return Membership.issue(identity, swarm_id, peer_id, expires_at=expires_at).to_text()
