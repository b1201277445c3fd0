"""Discovery over hivemind's Kademlia DHT: typed server records, announce/discover, the `swarm-dht` bootstrap node."""
