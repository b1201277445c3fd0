"""Codec round trips with written-down error bounds, and the wire stream format."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarm.compression import Blockwise8Codec
from tests.unit.test_compression import RMS_BOUNDS, rel_rms

# piecewise N-bit, Gaussian data in blocks of 256, measured (0.81, 0.25, 0.11, 0.059, 0.035, 0.023, 0.016) plus ~5%:
# its largest step is a third of the block's scale at 4 bits, so these are far above 8-bit's
RMS_BOUNDS |= {
    f"piecewise{b}": bound
    for b, bound in zip(range(2, 9), (0.85, 0.27, 0.12, 0.063, 0.038, 0.025, 0.018), strict=False)
}


@pytest.mark.parametrize("n", [1, 100, 4096, 4097, 3 * 4096 + 5, (1 << 20) + 7])
def test_blockwise8_cpu_encoder_writes_bitsandbytes_format(n):
    """The torch CPU encoder writes what bitsandbytes' decoder reads, with bitsandbytes' own encoder's error: per value
    within the map's gap around it plus one grid step, per tensor within 1% of its RMS error."""
    import bitsandbytes.functional as bnbf

    from swarm.compression.blockwise import GRID_HALF, dynamic_map

    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[:: max(n // 20, 1)] *= 50  # heavy tails: outliers set most blocks' scale
    x[: min(n, 300)] *= 1e-6  # tiny values, where the map is finer than the grid
    ours, theirs = Blockwise8Codec(), Blockwise8Codec(cpu_encoder="bitsandbytes")
    (p1, payload), (p2, reference) = ours.encode(x), theirs.encode(x)
    assert p1 == p2 and len(payload) == len(reference) == ours.encoded_bytes(n, torch.float32)
    assert payload[n:] == reference[n:], "block scales differ"
    codes = torch.frombuffer(bytearray(payload), dtype=torch.uint8, count=n)
    ref_codes = torch.frombuffer(bytearray(reference), dtype=torch.uint8, count=n)
    absmax = torch.frombuffer(bytearray(payload[n:]), dtype=torch.float32).repeat_interleave(4096)[:n]
    coarse = x.abs() > absmax * 1e-3  # where the grid is finer than the map, the nearest code is mostly the same
    assert (codes == ref_codes)[coarse].float().mean() > 0.95
    code = dynamic_map(torch.device("cpu"))
    y = bnbf.dequantize_blockwise(codes, absmax=absmax[::4096].contiguous(), code=code, blocksize=4096)
    y_ref = bnbf.dequantize_blockwise(ref_codes, absmax=absmax[::4096].contiguous(), code=code, blocksize=4096)
    widest_gap = (code[1:] - code[:-1]).max()
    assert ((y - x).abs() <= absmax * (widest_gap / 2 + 1 / GRID_HALF)).all()
    assert rel_rms(y, x) <= rel_rms(y_ref, x) * 1.01 + 1e-7


def test_bitsandbytes_is_not_imported_on_the_cpu():
    """Importing bitsandbytes costs a process ~3.5 s of CPU: every CPU trainer and server paid it at start. The
    8-bit codec, hivemind's 8-bit all-reduce format and state downloads run on the CPU without it."""
    code = """
import sys, torch
import server.main, trainer.main
from hivemind.compression import BlockwiseQuantization, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.serialization import _BASE_COMPRESSION_TYPES
from hivemind.proto import runtime_pb2
from server.collab.compat import install
from swarm.compression import get_codec
from swarm.protocol.tensors import decode_tensor, encode_tensor
assert type(_BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"]) is BlockwiseQuantization, "an import patched hivemind"
install()  # as the server does at start-up: hivemind's 8-bit format through our codec
x = torch.randn(10_000)
y = decode_tensor(encode_tensor("inputs", x, get_codec("blockwise8")), torch.device("cpu"))
z = deserialize_torch_tensor(serialize_torch_tensor(x, runtime_pb2.CompressionType.BLOCKWISE_8BIT))
assert (y - x).abs().max() < 0.1 and (z - x).abs().max() < 0.1
x[4096:8192] = float("nan")  # a reducer's 0/0: zeros, as bitsandbytes encodes it; the other blocks as before
x[9000] = float("inf")  # an infinite value: its block decodes non-finite
w = deserialize_torch_tensor(serialize_torch_tensor(x, runtime_pb2.CompressionType.BLOCKWISE_8BIT))
assert (w[4096:8192] == 0).all() and torch.equal(w[:4096], z[:4096]) and not w[8192:].isfinite().all()
assert "bitsandbytes" not in sys.modules, "imported bitsandbytes"
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_generated_code_matches_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    root = Path(__file__).resolve().parents[2]
    proto = "swarm/protocol/wire.proto"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(root),
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            proto,
        ],
        check=True,
    )
    for name in ("wire_pb2.py", "wire_pb2.pyi"):
        generated = (tmp_path / "swarm" / "protocol" / name).read_text()
        assert (
            generated == (root / "swarm" / "protocol" / name).read_text()
        ), f"regenerate swarm/protocol/{name} (see wire.proto)"
