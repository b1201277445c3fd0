"""Command-line tools around the swarm: `swarm-local` (a whole swarm on this machine), `swarm-monitor`,
`swarm-generate`, `swarm-simulate` (rebalancing under churn), the control-plane simulator, and the docs generator."""
