"""Pipelined runs: a model cut into stages, each served by a pool of peers, micro-batches
driven through one replica of each stage (SWARM parallelism; ``docs/DESIGN.md`` section 10).

- ``stages.py``: the cut of the built-in GPT into stage modules;
- ``manifest.py``: the run's manifest with every stage's signature, and each stage's own;
- ``wire.py``: tensors on the wire, and the checks of what a remote peer sends;
- ``replica.py``: one stage replica's compute, its micro-batches in flight and its
  gradient accumulator;
- ``service.py``: the replica behind the ``swarmloco.v1.Stage`` gRPC service;
- ``driver.py``: a stage-0 peer running micro-batches through the pipeline;
- ``load.py``: the ``stage-load`` records, where each replica serves and how fast;
- ``peer.py``: one peer serving one stage, all of the above around a ``Peer``.
"""
