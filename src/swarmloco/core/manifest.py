"""The swarm manifest and the content-addressed swarm id.

A manifest says everything every peer of a run must agree on: the task, the model config,
the data spec, the hyperparameters and the creator's public key. Its canonical encoding is
compact JSON with sorted keys (UTF-8, no NaN or Infinity), and the swarm id is the BLAKE2b-160
hash of those bytes, written as 40 hex digits. A peer that joins by id fetches the bytes,
hashes them and refuses a manifest whose hash differs, so two runs can never be confused.

This module must not import torch: the DHT-only bootstrap node and the dashboard use it.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import re
import secrets
from collections.abc import Mapping
from typing import Any

from swarmloco.errors import ManifestError

FORMAT_VERSION = 1
SWARM_ID_BYTES = 20
MAX_MANIFEST_BYTES = 64 * 1024
MAX_IDENTITY_WORK = 24
PUBLIC_IDENTITY_WORK = 8
"""A public run's default ``identity_work``: about a second of one core per key."""


def identity_work_for(bits: int | None, *, private: bool) -> int:
    """The ``identity_work`` of a new run: ``bits`` as given, else 8 for a public run and 0
    for a private one (its certificates already say who takes part)."""
    if bits is None:
        return 0 if private else PUBLIC_IDENTITY_WORK
    return bits


_SWARM_ID_RE = re.compile(rf"^[0-9a-f]{{{2 * SWARM_ID_BYTES}}}$")
_MAX_DEPTH = 8

JsonValue = Any  # None | bool | int | float | str | list[JsonValue] | dict[str, JsonValue]


def _canonical_value(value: JsonValue, where: str, depth: int = 0) -> JsonValue:
    """Return ``value`` as plain JSON data (tuples become lists), or raise ManifestError."""
    if depth > _MAX_DEPTH:
        raise ManifestError(f"manifest field {where} is nested more than {_MAX_DEPTH} deep")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ManifestError(f"manifest field {where} is {value!r}; only finite numbers")
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical_value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise ManifestError(f"manifest field {where} has a non-string key {key!r}")
            out[key] = _canonical_value(v, f"{where}.{key}", depth + 1)
        return out
    raise ManifestError(
        f"manifest field {where} has type {type(value).__name__}; "
        "only null, bool, int, float, str, lists and string-keyed maps are allowed"
    )


def canonical_json(value: JsonValue) -> bytes:
    """The canonical encoding: sorted keys, no spaces, UTF-8, finite numbers only."""
    return json.dumps(
        _canonical_value(value, "$"),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


def swarm_id_of(manifest_bytes: bytes) -> str:
    """The swarm id of canonical manifest bytes: BLAKE2b-160 in lowercase hex."""
    return hashlib.blake2b(manifest_bytes, digest_size=SWARM_ID_BYTES).hexdigest()


def check_swarm_id(swarm_id: str) -> str:
    """Return ``swarm_id`` normalized to lowercase, or raise ManifestError if malformed."""
    normalized = swarm_id.strip().lower()
    if not _SWARM_ID_RE.match(normalized):
        raise ManifestError(
            f"{swarm_id!r} is not a swarm id: expected {2 * SWARM_ID_BYTES} hex digits "
            "(as printed by `swarmloco create`)"
        )
    return normalized


def _utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwarmManifest:
    """What every peer of one run agrees on. Its hash is the swarm id."""

    task: str
    """Registered task name, e.g. ``gpt-bytes``."""
    model: Mapping[str, JsonValue]
    """Model config of the task (preset and any overrides, fully resolved)."""
    data: Mapping[str, JsonValue]
    """Data spec: which data every peer trains on and how it is split."""
    hparams: Mapping[str, JsonValue]
    """Inner/outer optimizer, codec and round hyperparameters."""
    creator: str = ""
    """Hex Ed25519 public key of the peer that created the run (empty in simulations)."""
    name: str = ""
    """A human label for dashboards; not needed to be unique."""
    created_at: str = dataclasses.field(default_factory=_utc_now)
    """Creation time (ISO-8601, UTC)."""
    nonce: str = dataclasses.field(default_factory=lambda: secrets.token_hex(8))
    """Random salt so that two runs with the same settings get different ids."""
    format: int = FORMAT_VERSION
    """Manifest format version."""
    admission: str = ""
    """Who may take part: empty for anyone (a public run), ``certificate`` for the peers
    holding a membership certificate signed by the creator (a private run; see
    ``net/admission.py``). Left out of the encoding when empty, so public runs keep the
    ids they had before the field existed."""
    identity_work: int = 0
    """Bits of work each key must prove for this run to take part (``net/work.py``; about
    2^bits scrypt evaluations of 5 ms, once per key and run); 0: none. Left out of the
    encoding when 0."""

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task:
            raise ManifestError("manifest task must be a non-empty string")
        for field in ("creator", "name", "created_at", "nonce"):
            if not isinstance(getattr(self, field), str):
                raise ManifestError(f"manifest {field} must be a string")
        if self.creator and not re.fullmatch(r"[0-9a-f]{64}", self.creator):
            raise ManifestError("manifest creator must be a 64-hex-digit Ed25519 public key")
        for field in ("model", "data", "hparams"):
            if not isinstance(getattr(self, field), Mapping):
                raise ManifestError(f"manifest {field} must be a mapping")
        if self.admission not in ("", "certificate"):
            raise ManifestError(
                f"manifest admission must be empty (public) or 'certificate' (private), got "
                f"{self.admission!r}"
            )
        if type(self.identity_work) is not int or not 0 <= self.identity_work <= MAX_IDENTITY_WORK:
            raise ManifestError(
                f"manifest identity_work must be an integer from 0 to {MAX_IDENTITY_WORK} "
                f"(bits), got {self.identity_work!r}"
            )
        if self.admission and self.identity_work:
            raise ManifestError(
                "identity_work is for public runs: a private run's certificates already say "
                "who takes part"
            )
        if self.admission and not self.creator:
            raise ManifestError("a private run (admission 'certificate') needs a creator key")
        if self.format != FORMAT_VERSION:
            raise ManifestError(
                f"manifest format {self.format} is not supported (this swarmloco speaks "
                f"format {FORMAT_VERSION}); upgrade swarmloco"
            )
        size = len(self.to_bytes())
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest is {size} bytes; the limit is {MAX_MANIFEST_BYTES}")

    def to_dict(self) -> dict[str, JsonValue]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if not self.admission:
            del out["admission"]
        if not self.identity_work:
            del out["identity_work"]
        return out

    @property
    def private(self) -> bool:
        """Whether only peers with a membership certificate may take part."""
        return self.admission == "certificate"

    def to_bytes(self) -> bytes:
        """The canonical encoding (what is hashed, stored in the DHT and sent on the wire)."""
        return canonical_json(self.to_dict())

    @property
    def swarm_id(self) -> str:
        return swarm_id_of(self.to_bytes())

    @property
    def run_id(self) -> str:
        """The run this swarm is part of: a pipelined run's id for the swarm of one of its
        stages (``model.stage.run``, ``pipeline/manifest.py``), else its own id. A key's
        proof of work or membership certificate names the run."""
        stage = self.model.get("stage")
        run = stage.get("run") if isinstance(stage, Mapping) else None
        if isinstance(run, str) and _SWARM_ID_RE.match(run):
            return run
        return self.swarm_id

    @classmethod
    def from_bytes(cls, data: bytes, *, expected_id: str | None = None) -> SwarmManifest:
        """Parse canonical manifest bytes, checking them against ``expected_id`` if given.

        Raises ManifestError when the bytes are not a canonical manifest or their hash is not
        the expected swarm id (the message gives both ids).
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest is {len(data)} bytes; the limit is {MAX_MANIFEST_BYTES}")
        if expected_id is not None:
            expected = check_swarm_id(expected_id)
            actual = swarm_id_of(data)
            if actual != expected:
                raise ManifestError(
                    f"the manifest received hashes to {actual}, not to the swarm id {expected}: "
                    "it belongs to another run or was tampered with; refusing it"
                )
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"manifest is not valid UTF-8 JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ManifestError("manifest must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ManifestError(f"manifest has unknown fields: {', '.join(unknown)}")
        if raw.get("format") != FORMAT_VERSION:
            raise ManifestError(
                f"manifest format {raw.get('format')!r} is not supported (this swarmloco speaks "
                f"format {FORMAT_VERSION}); upgrade swarmloco"
            )
        try:
            manifest = cls(**raw)
        except TypeError as exc:
            raise ManifestError(f"manifest is missing fields: {exc}") from exc
        if manifest.to_bytes() != data:
            raise ManifestError("manifest bytes are not in canonical form; refusing them")
        return manifest

    def describe(self) -> str:
        """A human-readable, multi-line rendering for `swarmloco join --dry-run`."""
        pretty = json.dumps(self.to_dict(), indent=2, sort_keys=True, ensure_ascii=False)
        return f"swarm {self.swarm_id}\n{pretty}"
