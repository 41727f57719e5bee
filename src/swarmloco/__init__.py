"""swarmloco: DiLoCo and Streaming DiLoCo on a swarm of unreliable peers.

The library API (see ``runtime/api.py``, the README's own-model script and
docs/own-model.md)::

    import swarmloco
    swarm = swarmloco.create(swarmloco.RunSpec(sync_every=100), model, optimizer,
                             data_dir="peer0")
    with swarm:
        ...   # your own loop: loss.backward(); optimizer.step()

Names are imported on first use, so that ``import swarmloco`` (and the DHT-only bootstrap
node and the dashboard, which never need torch) stays light.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# gRPC's core logs connection events (a peer that left: "Got goaway") at INFO on stderr,
# where a peer's operator reads its log. GRPC_VERBOSITY=INFO in the environment brings them
# back; it must be set before grpc is imported, which only swarmloco's subpackages do.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

_EXPORTS = {
    "RunSpec": "swarmloco.core.runspec",
    "AggregatorConfig": "swarmloco.core.aggregate",
    "CodecConfig": "swarmloco.core.codec",
    "create": "swarmloco.runtime.api",
    "join": "swarmloco.runtime.api",
    "admit": "swarmloco.runtime.api",
    "Swarm": "swarmloco.runtime.swarm",
    "Box": "swarmloco.runtime.box",
    "BoxRank": "swarmloco.runtime.box",
    "PeerConfig": "swarmloco.runtime.config",
    "export": "swarmloco.runtime.export",
    "simulate": "swarmloco.train.simulate",
    "MatchmakingConfig": "swarmloco.net.averaging",
    "SwarmlocoError": "swarmloco.errors",
    "ModelMismatch": "swarmloco.errors",
    "Stopped": "swarmloco.errors",
}

__all__ = [
    "AggregatorConfig",
    "Box",
    "BoxRank",
    "CodecConfig",
    "MatchmakingConfig",
    "ModelMismatch",
    "PeerConfig",
    "RunSpec",
    "Stopped",
    "Swarm",
    "SwarmlocoError",
    "__version__",
    "admit",
    "create",
    "export",
    "join",
    "simulate",
]

if TYPE_CHECKING:
    from swarmloco.core.aggregate import AggregatorConfig
    from swarmloco.core.codec import CodecConfig
    from swarmloco.core.runspec import RunSpec
    from swarmloco.errors import ModelMismatch, Stopped, SwarmlocoError
    from swarmloco.net.averaging import MatchmakingConfig
    from swarmloco.runtime.api import admit, create, join
    from swarmloco.runtime.box import Box, BoxRank
    from swarmloco.runtime.config import PeerConfig
    from swarmloco.runtime.export import export
    from swarmloco.runtime.swarm import Swarm
    from swarmloco.train.simulate import simulate


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'swarmloco' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
