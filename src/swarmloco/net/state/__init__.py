"""State transfer: a joining or lagging peer downloads the swarm's global state from a donor.

Imports torch (the state's tensors), so only the training daemon imports this package; the
bootstrap node and the dashboard never do.

- ``wire``: the signed header, the chunks and their checks (pure);
- ``donor``: :class:`StateDonor`, which serves a snapshot provider's state, and
  :func:`state_service`, the gRPC service to register on the server;
- ``download``: :func:`download_state`, which tries donors in order under one deadline
  and falls back on any failure.

The state itself (:class:`~swarmloco.core.state.StateSnapshot`) and its digest live in
``core/state.py``. Typical use::

    donor = StateDonor(identity=identity, snapshot=lambda: daemon.snapshot)
    node = NetNode(identity=identity, config=node_config, services=[state_service(donor)])
    async with node:
        got = await download_state(
            node.client, donors, swarm_id=swarm_id, expected_digest=majority_digest,
            schema=StateSchema.diloco(numel), deadline=Deadline.after(300),
        )
        theta_g = got.snapshot.tensors[THETA_G]
"""

from swarmloco.net.state.donor import (
    ByteBudget,
    DonorConfig,
    SnapshotProvider,
    StateDonor,
    state_service,
)
from swarmloco.net.state.download import (
    Donor,
    DonorFailure,
    DownloadConfig,
    DownloadedState,
    StateTransferError,
    download_state,
)
from swarmloco.net.state.wire import ReceiveLimits, Requester

__all__ = [
    "ByteBudget",
    "Donor",
    "DonorConfig",
    "DonorFailure",
    "DownloadConfig",
    "DownloadedState",
    "ReceiveLimits",
    "Requester",
    "SnapshotProvider",
    "StateDonor",
    "StateTransferError",
    "download_state",
    "state_service",
]
