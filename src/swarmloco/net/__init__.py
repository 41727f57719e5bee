"""The peer layer: identity, one hardened gRPC server per peer, the client, the Kademlia DHT.

What lives where:

- ``identity``: Ed25519 key in the data dir (0600), peer id = BLAKE2b-160(public key).
- ``server``: :class:`~swarmloco.net.server.PeerServer` (one port, limits, health,
  reflection); other layers add services as :class:`~swarmloco.net.server.Service`
  registrations, e.g. built with :func:`~swarmloco.net.server.unary_service`.
- ``client``: :class:`~swarmloco.net.client.RpcClient` (cached channels, a deadline on
  every call, bounded retries, :class:`~swarmloco.net.client.RpcError`); client
  interceptors are the seam for fault injection.
- ``records``: the one place that knows DHT record kinds, key names and value schemas.
- ``rejections``: :class:`~swarmloco.net.rejections.Rejection` and the log that counts
  every one and writes few lines per source network.
- ``heap``: hands freed memory back to the system after large input was refused.
- ``dht``: the node (lookups, store, get, upkeep), routing table, storage, contact cards,
  the gRPC and in-memory transports.
- ``node``: :class:`~swarmloco.net.node.NetNode`, server + client + DHT of one peer.
- ``swarm``: a swarm's manifest and peer list in the DHT.
- ``bootstrap``: the DHT-only node behind `swarmloco bootstrap`.

Nothing here imports torch: the bootstrap node and the dashboard depend on this package.

Typical use::

    async with NetNode(identity=Identity.load_or_create(data_dir),
                       config=NodeConfig(peers=("203.0.113.7:31337",)),
                       services=[my_service]) as node:
        await announce_peer(node.dht, swarm_id, role="trainer")
        peers = await find_peers(node.dht, swarm_id)
        reply = await node.client.call(peers[0].endpoint, MY_METHOD, request, timeout=5.0)
"""
