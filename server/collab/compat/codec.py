"""hivemind's 8-bit blockwise all-reduce format, encoded and decoded by torch on the CPU (TorchBlockwiseQuantization):
the codec `install()` puts in hivemind's codec table, and its warm-up before the averagers fork."""

from __future__ import annotations

import math

import torch
from hivemind.compression import BlockwiseQuantization, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.quantization import _BLOCKWISE_QUANTIZATION_BLOCKSIZE
from hivemind.proto import runtime_pb2

from server.collab.compat import install
from swarm.compression.blockwise import decode_cpu, dynamic_map, encode_cpu


class TorchBlockwiseQuantization(BlockwiseQuantization):
    """hivemind's 8-bit blockwise format (int64 scale count, int64 map size, float32 scales, float32 map, uint8
    codes), encoded and decoded on the CPU by torch (swarm/compression/blockwise.py) instead of bitsandbytes, whose
    import alone costs each process ~3.5 s of CPU. The same bytes: peers running either read each other. Sizes are
    checked before anything is decoded (hivemind's reader does not check them)."""

    def quantize(self, tensor: torch.Tensor, allow_inplace: bool = False):
        x = tensor.reshape(-1).contiguous()
        if x.device.type != "cpu":
            return super().quantize(tensor, allow_inplace)
        blocksize = _BLOCKWISE_QUANTIZATION_BLOCKSIZE
        codes = torch.empty(x.numel(), dtype=torch.uint8)
        absmax = torch.empty(-(-x.numel() // blocksize), dtype=torch.float32)
        if not encode_cpu(x, blocksize, codes, absmax):  # a non-finite value: copies of the part, off the usual path
            _encode_non_finite(x, blocksize, codes, absmax)
        return codes.numpy(), (absmax.numpy(), dynamic_map(torch.device("cpu")).numpy())

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer, shape = serialized_tensor.buffer, tuple(serialized_tensor.size)
        numel, blocksize = math.prod(shape), _BLOCKWISE_QUANTIZATION_BLOCKSIZE
        if len(buffer) < 16:  # (its shape is unsigned in hivemind's protobuf)
            raise ValueError(f"an 8-bit blockwise tensor of {len(buffer)} bytes")
        n_scales, n_codes = (int.from_bytes(buffer[i : i + 8], "little", signed=True) for i in (0, 8))
        if (
            n_scales != -(-numel // blocksize)
            or not 0 < n_codes <= 256
            or len(buffer) != 16 + 4 * (n_scales + n_codes) + numel
        ):
            raise ValueError(
                f"an 8-bit blockwise tensor of shape {list(shape)} with {n_scales} scales, a map of {n_codes} and "
                f"{len(buffer)} bytes"
            )
        view = memoryview(buffer)
        absmax = torch.frombuffer(bytearray(view[16 : 16 + 4 * n_scales]), dtype=torch.float32) if n_scales else None
        code = torch.frombuffer(bytearray(view[16 + 4 * n_scales : 16 + 4 * (n_scales + n_codes)]), dtype=torch.float32)
        if absmax is None:
            values = torch.empty(0)
        else:
            codes = torch.frombuffer(bytearray(view[16 + 4 * (n_scales + n_codes) :]), dtype=torch.uint8)
            if n_codes < 256 and bool((codes >= n_codes).any()):
                raise ValueError(f"an 8-bit blockwise tensor with codes beyond its map of {n_codes}")
            values = decode_cpu(codes, absmax, blocksize, code)
        values = values.reshape(shape).to(getattr(torch, serialized_tensor.dtype))
        return values.requires_grad_(serialized_tensor.requires_grad)


def _encode_non_finite(x: torch.Tensor, blocksize: int, codes: torch.Tensor, absmax: torch.Tensor) -> None:
    """`encode_cpu` of a part holding NaN or infinite values, as bitsandbytes encodes it: its scales ignore NaN, so an
    all-NaN block (the 0/0 of a reducer whose senders all weigh nothing: routine) encodes as zeros, and peers step on
    them as they always did (tests/integration/test_tickets.py); a block holding an infinite value keeps its infinite scale.
    Falling back to bitsandbytes instead imported it inside the averager's round (a round took 2.5-3.1 s, not 1.1)."""
    y = torch.nan_to_num(x, nan=0.0, posinf=math.inf, neginf=-math.inf)
    if encode_cpu(y, blocksize, codes, absmax):
        return
    scales = absmax.clone()
    encode_cpu(torch.nan_to_num(y, posinf=0.0, neginf=0.0), blocksize, codes, absmax)
    infinite = torch.isinf(scales)
    absmax[infinite] = scales[infinite]


def warm_up_8bit() -> None:
    """Build the 8-bit codec's tables (encoding grid, map, pairs of codes) here, before the averagers fork, so that
    none is built inside a round. Installs our codec first (hivemind's own would import bitsandbytes here)."""
    install()
    x = torch.zeros(2 * _BLOCKWISE_QUANTIZATION_BLOCKSIZE)
    deserialize_torch_tensor(serialize_torch_tensor(x, runtime_pb2.CompressionType.BLOCKWISE_8BIT))
