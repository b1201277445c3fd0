"""`swarm-server`: hosts one pipeline stage behind gRPC."""
