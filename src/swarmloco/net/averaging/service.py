"""The ``swarmloco.v1.Averaging`` gRPC service of a peer: matchmaking and all-reduce streams.

A serving peer registers it on its server before the server starts::

    node = NetNode(identity=identity, config=node_config)
    matchmaker = Matchmaker(identity=identity, dht=node.dht, client=node.client, swarm_id=...)
    averager = Averager(identity=identity, client=node.client, config=averaging_config)
    if node.server is not None:
        node.server.add_service(averaging_service(matchmaker, averager))
    async with node:
        group = await matchmaker.form_group(r, weight=tokens, numel=n, block_size=b,
                                            deadline=deadline)
        result = await averager.all_reduce(group, vector, deadline=deadline)
"""

from __future__ import annotations

import grpc

from swarmloco.net.averaging.allreduce import Averager, averaging_service_handlers
from swarmloco.net.averaging.matchmaking import Matchmaker
from swarmloco.net.averaging.wire import SERVICE_NAME
from swarmloco.net.server import Service, unary_method_handlers
from swarmloco.proto.v1 import averaging_pb2 as pb


def averaging_service(matchmaker: Matchmaker, averager: Averager) -> Service:
    """``Join`` (answered by ``matchmaker``) and ``Aggregate`` (served by ``averager``)."""
    handlers = unary_method_handlers(
        {"Join": (pb.JoinRequest, matchmaker.handle_join)}, rejections=matchmaker.rejections
    )
    handlers.update(averaging_service_handlers(averager))
    generic = grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
    return Service(SERVICE_NAME, lambda server: server.add_generic_rpc_handlers((generic,)))
