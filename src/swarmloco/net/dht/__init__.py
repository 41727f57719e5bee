"""The Kademlia DHT: contacts, routing table, storage, the node, and its transports."""

from swarmloco.net.dht.contact import Contact
from swarmloco.net.dht.node import DhtConfig, DHTNode, Entry, GetResult, LookupResult
from swarmloco.net.dht.storage import StorageConfig

__all__ = ["Contact", "DHTNode", "DhtConfig", "Entry", "GetResult", "LookupResult", "StorageConfig"]
