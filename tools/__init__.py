"""Command-line tools around the swarm: `swarm-local` (a whole swarm on this machine) and `swarm-simulate`."""
