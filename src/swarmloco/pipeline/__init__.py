"""Pipelined runs: a model cut into stages, each served by a pool of peers, micro-batches
driven through one replica of each stage (SWARM parallelism; ``docs/DESIGN.md`` section 10).

- ``api.py``: a pipelined run of your own stage modules (``create_pipeline``,
  ``fetch_pipeline``; the names below are importable from this package);
- ``stages.py``: the cut of the built-in GPT and Llama into stage modules;
- ``manifest.py``: the run's manifest with every stage's signature, and each stage's own;
- ``wire.py``: tensors on the wire, and the checks of what a remote peer sends;
- ``replica.py``: one stage replica's compute, its micro-batches in flight and its
  gradient accumulator;
- ``service.py``: the replica behind the ``swarmloco.v1.Stage`` gRPC service;
- ``driver.py``: a stage-0 peer running micro-batches through the pipeline;
- ``load.py``: the ``stage-load`` records, where each replica serves and how fast;
- ``peer.py``: one peer serving one stage, all of the above around a ``Peer``;
- ``rebalance.py`` and ``daemon.py``: moving peers to the stage that limits the pipeline,
  and a built-in task's stage peer as ``swarmloco join`` runs it;
- ``export.py``: the stages' latest weights back into one model (``export_run``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Boundary": "swarmloco.pipeline.wire",
    "PipelineError": "swarmloco.pipeline.driver",
    "StagePeer": "swarmloco.pipeline.peer",
    "StageWork": "swarmloco.pipeline.peer",
    "create_pipeline": "swarmloco.pipeline.api",
    "export_run": "swarmloco.pipeline.export",
    "fetch_pipeline": "swarmloco.pipeline.api",
}
__all__ = [
    "Boundary",
    "PipelineError",
    "StagePeer",
    "StageWork",
    "create_pipeline",
    "export_run",
    "fetch_pipeline",
]

if TYPE_CHECKING:
    from swarmloco.pipeline.api import create_pipeline, fetch_pipeline
    from swarmloco.pipeline.driver import PipelineError
    from swarmloco.pipeline.export import export_run
    from swarmloco.pipeline.peer import StagePeer, StageWork
    from swarmloco.pipeline.wire import Boundary


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'swarmloco.pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
