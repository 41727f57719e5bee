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
from swarmloco.core.state import MOMENTUM, THETA_G, TOKENS, StateSchema, state_digest
from swarmloco.errors import SwarmlocoError
from swarmloco.net.admission import AdmissionError, Gate, gate_of
from swarmloco.net.identity import KEY_FILE_NAME, Identity
from swarmloco.runtime.catchup import CatchUp, CatchUpConfig
from swarmloco.runtime.checkpoint import CheckpointStore
from swarmloco.runtime.swarm import manifest_signature, manifest_spec

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
    local = Path(data_dir) / "swarms" / swarm_id if data_dir is not None else None
    if peers:
        identity = _reader_identity(data_dir)
        manifest, theta, round, digest, source = _from_swarm(
            swarm_id, local, peers, timeout_s, identity, membership
        )
    elif local is not None:
        manifest, theta, round, digest, source = _from_checkpoint(swarm_id, local)
    else:
        raise ValueError("give data_dir (a peer's data directory) or peers (HOST:PORT)")
    signature = manifest_signature(manifest)
    spec = manifest_spec(manifest)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = weights_of(signature, theta, spec.codec.block_size)
    metadata = {"format": "pt", "swarm_id": swarm_id, "round": str(round), "digest": digest}
    _atomic(out / WEIGHTS, lambda path: save_file(tensors, str(path), metadata=metadata))
    _atomic(out / MANIFEST, lambda path: path.write_bytes(manifest.to_bytes()))
    config = manifest.model.get("config") or _task_config(manifest)
    if isinstance(config, dict):
        text = json.dumps(config, indent=2, sort_keys=True)
        _atomic(out / CONFIG, lambda path: path.write_text(text + "\n"))
    logger.info("exported round %d of swarm %s to %s (from %s)", round, swarm_id[:12], out, source)
    return Exported(out, swarm_id, round, digest, source)


def _task_config(manifest: SwarmManifest) -> dict[str, Any] | None:
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


def _from_checkpoint(
    swarm_id: str, local: Path
) -> tuple[SwarmManifest, torch.Tensor, int, str, str]:
    manifest = _local_manifest(swarm_id, local)
    if manifest is None:
        raise SwarmlocoError(f"no copy of swarm {swarm_id}'s manifest in {local}")
    numel = manifest_signature(manifest).layout(manifest_spec(manifest).codec.block_size).numel
    with CheckpointStore(local / "checkpoints", swarm_id=swarm_id, readonly=True) as store:
        for found in store.valid():
            try:
                theta, digest = _committed_digest(found.state, found.round, numel)
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("skipping checkpoint %s: no global state (%s)", found.path, exc)
                continue
            return manifest, theta, found.round, digest, str(found.path)
    raise SwarmlocoError(f"no valid checkpoint of swarm {swarm_id} in {local / 'checkpoints'}")


def _committed_digest(state: dict[str, Any], round: int, numel: int) -> tuple[torch.Tensor, str]:
    """A checkpoint's ``theta_g`` and the digest peers publish for it: of the committed
    state as a donor serves it (with the momentum and token count once a round was
    applied)."""
    diloco = state["diloco"]
    theta, momentum = diloco["theta_g"], diloco["momentum"]
    for name, t in (("theta_g", theta), ("momentum", momentum)):
        if not isinstance(t, torch.Tensor) or t.shape != (numel,):
            raise ValueError(f"{name} is not a vector of the model's {numel} values")
    if round == 0:
        return theta, state_digest({THETA_G: theta}).hex()
    tensors = {
        THETA_G: theta,
        MOMENTUM: momentum,
        TOKENS: torch.tensor([int(diloco.get("tokens", 0))], dtype=torch.int64),
    }
    return theta, state_digest(tensors).hex()


def _local_manifest(swarm_id: str, local: Path | None) -> SwarmManifest | None:
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
            f"swarm {manifest.swarm_id} is private: its peers serve its state to members "
            "only. Export with --data-dir DIR of one of its peers (its key and the "
            "certificate it kept), or have the creator admit the key in --data-dir DIR "
            f"(`swarmloco admit PEER_ID --swarm {manifest.swarm_id}`; this one is {me}"
            + ("" if local is not None else ", a throwaway key: give --data-dir")
            + ") and pass --membership CERTIFICATE"
        ) from None


def _from_swarm(
    swarm_id: str,
    local: Path | None,
    peers: Sequence[str],
    timeout_s: float,
    identity: Identity,
    membership: str,
) -> tuple[SwarmManifest, torch.Tensor, int, str, str]:
    from swarmloco.net.node import NetNode, NodeConfig
    from swarmloco.net.state.wire import Requester
    from swarmloco.net.swarm import fetch_manifest

    async def fetch() -> tuple[SwarmManifest, torch.Tensor, int, str, str]:
        config = NodeConfig(server=None, peers=tuple(peers))
        async with NetNode(identity=identity, config=config) as node:
            manifest = _local_manifest(swarm_id, local) or await fetch_manifest(node.dht, swarm_id)
            admission = _reader_admission(manifest, identity, local, membership)
            if admission is not None:
                node.dht.admit(admission)
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
            )
            # Nothing of its own to hold a state against: a reader checks that the state is
            # finite and that its momentum is no longer than its weights went.
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
            donor = str(found.adopted.donor)
            return manifest, snap.tensors[THETA_G], snap.round, snap.digest.hex(), donor

    return asyncio.run(fetch())


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through a temporary file renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
