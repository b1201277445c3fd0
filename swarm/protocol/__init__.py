"""The stage RPC protocol: wire.proto and its generated code, tensors on the wire (tensors.py), frames and call
assembly with limits (frames.py), and channels, servers and stubs (rpc.py)."""
