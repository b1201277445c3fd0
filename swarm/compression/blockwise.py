"""8-bit dynamic blockwise quantization (bitsandbytes), on the device where the tensor lives."""

from __future__ import annotations

import functools
import math
import struct

import torch

from swarm.compression.base import WIRE_TO_DTYPE, Codec, CodecError, bytes_to_tensor, tensor_to_bytes
from swarm.protocol import wire_pb2 as pb


@functools.cache
def _dynamic_map(device: torch.device) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    return bnbf.create_dynamic_map().to(device)


class Blockwise8Codec(Codec):
    """bitsandbytes dynamic blockwise quantization: one uint8 code per value plus one float32 absmax per block.

    Runs where the tensor lives (CUDA kernel on GPU, bitsandbytes' CPU path otherwise). The 256-entry dynamic map is
    the same on every peer, so only codes and absmax travel: 1 + 4/blocksize bytes per value.
    """

    wire, name = pb.CODEC_BLOCKWISE8, "blockwise8"
    BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
    PARAMS = struct.Struct("<I")  # codec parameters: the block size

    def __init__(self, blocksize: int = 4096):
        if blocksize not in self.BLOCKSIZES:
            raise ValueError(f"blocksize must be a power of two in [64, 4096], got {blocksize}")
        self.blocksize = blocksize

    def encode(self, t, ctx=None):
        import bitsandbytes.functional as bnbf

        x = t.detach().contiguous().reshape(-1)
        if x.device.type == "cpu" and x.dtype != torch.float32:
            x = x.float()  # bitsandbytes' CPU path is float32-only
        codes, state = bnbf.quantize_blockwise(x, code=_dynamic_map(x.device), blocksize=self.blocksize)
        return self.PARAMS.pack(self.blocksize), tensor_to_bytes(codes) + tensor_to_bytes(state.absmax.float())

    def decode(self, header, payload, device, ctx=None):
        import bitsandbytes.functional as bnbf

        shape, n = tuple(header.shape), math.prod(header.shape)
        if len(header.codec_params) != self.PARAMS.size:
            raise CodecError(f"tensor {header.name!r}: {self.name} takes {self.PARAMS.size} bytes of parameters")
        (blocksize,) = self.PARAMS.unpack(header.codec_params)
        if blocksize not in self.BLOCKSIZES:
            raise CodecError(f"tensor {header.name!r}: unsupported blocksize {blocksize}")
        n_blocks = -(-n // blocksize)
        self._check_size(header, payload, n + 4 * n_blocks)
        view = memoryview(payload)
        codes = bytes_to_tensor(view[:n], torch.uint8, (n,)).to(device)
        absmax = bytes_to_tensor(view[n:], torch.float32, (n_blocks,)).to(device)
        if not torch.isfinite(absmax).all():
            raise CodecError(f"tensor {header.name!r}: non-finite block scale")
        x = bnbf.dequantize_blockwise(codes, absmax=absmax, code=_dynamic_map(codes.device), blocksize=blocksize)
        return x.reshape(shape).to(WIRE_TO_DTYPE[header.dtype])

    def encoded_bytes(self, numel, dtype):
        return numel + 4 * -(-numel // self.blocksize)
