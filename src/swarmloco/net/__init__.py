"""The peer layer: asyncio + grpc.aio server and client, identity, the Kademlia DHT."""
