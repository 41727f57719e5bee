"""Getting the trained model out: the swarm's latest global weights as safetensors.

:func:`export` writes, into a directory:

* ``model.safetensors``: ``theta_g`` cut back into the model's parameters (by name, with
  their shapes and dtypes, from the manifest's model signature; no model code needed), with
  the swarm id, round and state digest in the file's metadata;
* ``manifest.json``: the run's manifest, whose hash is the swarm id;
* ``config.json``: when the manifest carries a model ``config`` (a Hugging Face model's,
  as ``swarmloco.integrations.hf`` records it), or its task derives one (the ``llama``
  task: ``LlamaForCausalLM``), so that ``from_pretrained(DIR)`` loads it.

The state comes from the newest valid checkpoint in the peer's data directory (read
without a lock: safe beside a running peer), or, with ``peers``, from the swarm: the most
held digest of its latest round, downloaded and checked against that digest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from swarmloco.core.adoption import Evidence, Reference
from swarmloco.core.manifest import SwarmManifest, check_swarm_id
from swarmloco.core.signature import ModelSignature
from swarmloco.core.state import THETA_G, StateSchema, state_digest
from swarmloco.errors import SwarmlocoError
from swarmloco.net.admission import AdmissionError, Gate, gate_of
from swarmloco.net.identity import KEY_FILE_NAME, Identity
from swarmloco.runtime.catchup import CatchUp, CatchUpConfig, trusted_peers
from swarmloco.runtime.checkpoint import CheckpointStore
from swarmloco.runtime.swarm import manifest_signature, manifest_spec
from swarmloco.train.diloco import DilocoState

logger = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
MANIFEST = "manifest.json"
CONFIG = "config.json"
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclasses.dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote."""

    directory: Path
    swarm_id: str
    round: int
    digest: str
    source: str
    """Where the weights came from (a checkpoint's path, or the donor)."""


@dataclasses.dataclass(frozen=True)
class Latest:
    """One swarm's latest global weights, as found."""

    theta: torch.Tensor
    """``theta_g``: flat, in the layout of the swarm's model signature."""
    round: int
    digest: str
    source: str
    """Where they came from (a checkpoint's path, or the donor)."""


def export(
    swarm_id: str,
    out_dir: str | Path,
    *,
    data_dir: str | Path | None = None,
    peers: Sequence[str] = (),
    timeout_s: float = 300.0,
    membership: str = "",
) -> Exported:
    """Write the latest global weights of ``swarm_id`` to ``out_dir`` (see the module
    docstring): from the newest checkpoint under ``data_dir``, or, with ``peers``
    (HOST:PORT), downloaded from the swarm and checked against its published digest.

    A private swarm serves its state to members only: the download is signed with the key
    in ``data_dir`` and its certificate (``membership``, or the one a peer kept there), and
    AdmissionError says what to do when there is none."""
    swarm_id = check_swarm_id(swarm_id)
    local = local_swarm_dir(data_dir, swarm_id)
    if peers:
        manifest, [latest] = from_swarm(
            swarm_id,
            lambda manifest: [manifest],
            local=local,
            data_dir=data_dir,
            peers=peers,
            timeout_s=timeout_s,
            membership=membership,
        )
    elif local is not None:
        kept = local_manifest(swarm_id, local)
        if kept is None:
            raise SwarmlocoError(f"no copy of swarm {swarm_id}'s manifest in {local}")
        manifest, latest = kept, from_checkpoint(kept, local)
    else:
        raise ValueError("give data_dir (a peer's data directory) or peers (HOST:PORT)")
    return export_latest(swarm_id, out_dir, manifest, latest)


def export_latest(
    swarm_id: str, out_dir: str | Path, manifest: SwarmManifest, latest: Latest
) -> Exported:
    """Write ``latest`` (the weights of ``manifest``'s swarm) into ``out_dir``: see
    :func:`export`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    block = manifest_spec(manifest).codec.block_size
    tensors = weights_of(manifest_signature(manifest), latest.theta, block)
    metadata = {"swarm_id": swarm_id, "round": str(latest.round), "digest": latest.digest}
    write_export(out, manifest, tensors, metadata, task_config(manifest))
    logger.info(
        "exported round %d of swarm %s to %s (from %s)",
        latest.round,
        swarm_id[:12],
        out,
        latest.source,
    )
    return Exported(out, swarm_id, latest.round, latest.digest, latest.source)


def write_export(
    out: Path,
    manifest: SwarmManifest,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    derived: dict[str, Any] | None,
) -> None:
    """``tensors`` into ``out/model.safetensors`` (with ``metadata``), the manifest, and the
    model's ``config.json`` (a Hugging Face model's own, else ``derived``), each written
    whole or not at all."""
    metadata = {"format": "pt", **metadata}
    write_atomic(out / WEIGHTS, lambda path: save_file(tensors, str(path), metadata=metadata))
    write_manifest(out, manifest, derived)


def write_manifest(out: Path, manifest: SwarmManifest, derived: dict[str, Any] | None) -> None:
    """The run's manifest into ``out``, and the model's ``config.json`` (a Hugging Face
    model's own, else ``derived``, when there is one)."""
    write_atomic(out / MANIFEST, lambda path: path.write_bytes(manifest.to_bytes()))
    config = manifest.model.get("config") or derived
    if isinstance(config, dict):
        text = json.dumps(config, indent=2, sort_keys=True)
        write_atomic(out / CONFIG, lambda path: path.write_text(text + "\n"))


def local_swarm_dir(data_dir: str | Path | None, swarm_id: str) -> Path | None:
    """Where a peer whose data directory is ``data_dir`` keeps swarm ``swarm_id``."""
    return Path(data_dir) / "swarms" / swarm_id if data_dir is not None else None


def task_config(manifest: SwarmManifest) -> dict[str, Any] | None:
    """The Hugging Face config a built-in task derives from the manifest's model (the
    ``llama`` task's), or None."""
    from swarmloco.train.tasks import get_task

    try:
        task = get_task(manifest.task)
    except ValueError:  # a task of a package this machine lacks: the weights alone
        return None
    derive = getattr(task, "hf_config", None)
    if derive is None:
        return None
    model = {k: v for k, v in manifest.model.items() if k not in ("preset", "signature")}
    config = derive(model)
    return dict(config) if config is not None else None


def weights_of(
    signature: ModelSignature, theta: torch.Tensor, block_size: int
) -> dict[str, torch.Tensor]:
    """``theta_g`` as the model's named parameters (their shapes and dtypes)."""
    layout = signature.layout(block_size)
    if theta.numel() != layout.numel:
        raise SwarmlocoError(
            f"the state holds {theta.numel()} values, the manifest's model {layout.numel}"
        )
    dtypes = {p.name: _DTYPES[p.dtype] for p in signature.params}
    return {
        slot.name: theta[slot.start : slot.start + slot.numel]
        .view(slot.shape)
        .to(dtypes[slot.name])
        .clone()
        for slot in layout.slots
    }


def from_checkpoint(manifest: SwarmManifest, local: Path) -> Latest:
    """The weights of the newest valid checkpoint of ``manifest``'s swarm under ``local``
    (read without a lock: safe beside a running peer)."""
    swarm_id = manifest.swarm_id
    numel = manifest_signature(manifest).layout(manifest_spec(manifest).codec.block_size).numel
    with CheckpointStore(local / "checkpoints", swarm_id=swarm_id, readonly=True) as store:
        for found in store.valid():
            try:
                theta, digest = _committed_digest(found.state, found.round, numel)
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("skipping checkpoint %s: no global state (%s)", found.path, exc)
                continue
            return Latest(theta.clone(), found.round, digest, str(found.path))
    raise SwarmlocoError(f"no valid checkpoint of swarm {swarm_id} in {local / 'checkpoints'}")


def _committed_digest(state: dict[str, Any], round: int, numel: int) -> tuple[torch.Tensor, str]:
    """A checkpoint's ``theta_g`` and the digest peers publish for it: of the committed
    state as a donor serves it (with the momentum, token count and landed sequences once a
    round was applied)."""
    diloco = state["diloco"]
    for name in ("theta_g", "momentum"):
        t = diloco[name]
        if not isinstance(t, torch.Tensor) or t.shape != (numel,):
            raise ValueError(f"{name} is not a vector of the model's {numel} values")
    tensors = DilocoState.snapshot_tensors({**diloco, "round": round})
    return diloco["theta_g"], state_digest(tensors).hex()


def local_manifest(swarm_id: str, local: Path | None) -> SwarmManifest | None:
    if local is None or not (local / "manifest.json").is_file():
        return None
    return SwarmManifest.from_bytes((local / "manifest.json").read_bytes(), expected_id=swarm_id)


def _reader_identity(data_dir: str | Path | None) -> Identity:
    """The key in ``data_dir`` (a peer's, or one a private swarm's creator admitted), or a
    fresh one that leaves nothing behind: an export never writes a key."""
    if data_dir is not None and (Path(data_dir) / KEY_FILE_NAME).is_file():
        return Identity.load_or_create(data_dir)
    return Identity.generate()


def _reader_admission(
    manifest: SwarmManifest, identity: Identity, local: Path | None, membership: str
) -> Gate | None:
    """A private swarm's gate for the exporting key, or a public run's proof of work for
    it (donors serve proven keys only; None: an open run)."""
    text = membership.strip()
    kept = local / "membership" if local is not None else None
    if not text and kept is not None and kept.is_file():
        text = kept.read_text().strip()
    try:
        work = local / "swarms" / manifest.swarm_id / "work" if local is not None else None
        return gate_of(manifest, identity, text or None, work_file=work)
    except AdmissionError:
        if text:
            raise  # a certificate that does not fit: its own message says why
        me = identity.peer_id_hex
        raise AdmissionError(
            f"swarm {manifest.run_id} is private: its peers serve its state to members "
            "only. Export with --data-dir DIR of one of its peers (its key and the "
            "certificate it kept), or have the creator admit the key in --data-dir DIR "
            f"(`swarmloco admit PEER_ID --swarm {manifest.run_id}`; this one is {me}"
            + ("" if local is not None else ", a throwaway key: give --data-dir")
            + ") and pass --membership CERTIFICATE"
        ) from None


def from_swarm(
    swarm_id: str,
    swarms: Callable[[SwarmManifest], Sequence[SwarmManifest]],
    *,
    local: Path | None,
    data_dir: str | Path | None,
    peers: Sequence[str],
    timeout_s: float,
    membership: str,
    each: Callable[[SwarmManifest], Callable[[int, Latest], None] | None] | None = None,
) -> tuple[SwarmManifest, list[Latest]]:
    """The manifest of ``swarm_id`` (the copy in ``local``, or fetched through ``peers``),
    and the latest weights of each of the swarms ``swarms(manifest)`` names (the run's
    own; a pipelined run's stages), each the most held digest of its latest round,
    downloaded and checked as a joining peer checks it. Through one client-only node, the
    key in ``data_dir`` or a throwaway one. ``each(manifest)``: what takes each swarm's
    weights as they arrive (index, weights), or None; the weights it took are not kept
    (their ``theta`` is empty): one swarm's at a time is in memory."""
    from swarmloco.net.node import NetNode, NodeConfig
    from swarmloco.net.swarm import fetch_manifest

    identity = _reader_identity(data_dir)

    async def fetch() -> tuple[SwarmManifest, list[Latest]]:
        config = NodeConfig(server=None, peers=tuple(peers))
        async with NetNode(identity=identity, config=config) as node:
            manifest = local_manifest(swarm_id, local) or await fetch_manifest(node.dht, swarm_id)
            take = each(manifest) if each is not None else None
            found = []
            for index, one in enumerate(swarms(manifest)):
                admission = _reader_admission(one, identity, local, membership)
                if admission is not None:
                    node.dht.admit(admission)
                latest = await _download_latest(node, one, identity, admission, timeout_s)
                if take is not None:
                    take(index, latest)
                    latest = dataclasses.replace(latest, theta=torch.empty(0))
                found.append(latest)
            return manifest, found

    return asyncio.run(fetch())


async def _download_latest(
    node: Any,
    manifest: SwarmManifest,
    identity: Identity,
    admission: Gate | None,
    timeout_s: float,
) -> Latest:
    from swarmloco.net.state.wire import Requester

    swarm_id = manifest.swarm_id
    spec = manifest_spec(manifest)
    layout = manifest_signature(manifest).layout(spec.codec.block_size)
    finder = CatchUp(
        me=identity.peer_id_hex,
        swarm_id=swarm_id,
        dht=node.dht,
        client=node.client,
        schema=StateSchema.diloco(layout.numel),
        evidence=Evidence(),  # a reader has nothing to check claims against
        config=CatchUpConfig(state_timeout_s=timeout_s),
        requester=Requester(identity, admission.own_bytes) if admission else None,
        trusted=lambda: trusted_peers(node, manifest),
    )
    # Nothing of its own to hold a state against: a reader checks that the state is finite
    # and that its momentum is no longer than its weights went.
    reference = Reference(
        theta_g=layout.zeros(),
        momentum=None,
        tokens=0,
        outer_lr=spec.outer_lr,
        outer_momentum=spec.outer_momentum,
    )
    found = await finder.find(round=0, digest=None, reference=reference, distrusted=set())
    if found.adopted is None:
        failed = "; ".join(found.failed) or "no peer published the state of a round"
        raise SwarmlocoError(f"cannot download swarm {swarm_id}'s state: {failed}")
    snap = found.adopted.snapshot
    return Latest(snap.tensor(THETA_G), snap.round, snap.digest.hex(), str(found.adopted.donor))


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through a temporary file renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
