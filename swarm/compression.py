"""Tensor codecs for the wire. A codec turns a tensor into (header, payload bytes) and back; nothing else.

Every codec has a round-trip error-bound test. Integer tensors (token ids, labels) always travel raw.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod

import torch

from swarm import wire_pb2 as pb

DTYPE_TO_WIRE = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.int64: pb.DTYPE_INT64,
}
WIRE_TO_DTYPE = {v: k for k, v in DTYPE_TO_WIRE.items()}


class CodecError(ValueError):
    """A payload that cannot be what its header says."""


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def bytes_to_tensor(
    payload: bytes | bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    if len(payload) == 0:
        return torch.empty(shape, dtype=dtype)
    if isinstance(payload, bytes) or (isinstance(payload, memoryview) and payload.readonly):
        payload = bytearray(payload)  # torch tensors need writable memory
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)


class Codec(ABC):
    wire: int  # wire_pb2.Codec value
    name: str

    @abstractmethod
    def encode(self, t: torch.Tensor) -> tuple[dict, bytes]:
        """-> (extra TensorHeader fields, payload). `t` may live on any device; the payload is host bytes."""

    @abstractmethod
    def decode(self, header: pb.TensorHeader, payload: bytearray, device: torch.device) -> torch.Tensor:
        """Inverse of encode; raises CodecError if the payload size disagrees with the header."""

    @staticmethod
    def _check_size(header: pb.TensorHeader, payload: bytearray, expected: int) -> None:
        if len(payload) != expected:
            raise CodecError(f"tensor {header.name!r}: payload is {len(payload)} bytes, its header implies {expected}")


class NoneCodec(Codec):
    wire, name = pb.CODEC_NONE, "none"

    def encode(self, t):
        return {}, tensor_to_bytes(t)

    def decode(self, header, payload, device):
        dtype, shape = WIRE_TO_DTYPE[header.dtype], tuple(header.shape)
        self._check_size(header, payload, math.prod(shape) * dtype.itemsize)
        return bytes_to_tensor(payload, dtype, shape).to(device)


class Float16Codec(Codec):
    wire, name = pb.CODEC_FLOAT16, "fp16"

    def encode(self, t):
        return {}, tensor_to_bytes(t.to(torch.float16))

    def decode(self, header, payload, device):
        shape = tuple(header.shape)
        self._check_size(header, payload, math.prod(shape) * 2)
        return bytes_to_tensor(payload, torch.float16, shape).to(device).to(WIRE_TO_DTYPE[header.dtype])


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

    def __init__(self, blocksize: int = 4096):
        if blocksize not in (64, 128, 256, 512, 1024, 2048, 4096):
            raise ValueError(f"blocksize must be a power of two in [64, 4096], got {blocksize}")
        self.blocksize = blocksize

    def encode(self, t):
        import bitsandbytes.functional as bnbf

        x = t.detach().contiguous().reshape(-1)
        if x.device.type == "cpu" and x.dtype != torch.float32:
            x = x.float()  # bitsandbytes' CPU path is float32-only
        codes, state = bnbf.quantize_blockwise(x, code=_dynamic_map(x.device), blocksize=self.blocksize)
        return {"blocksize": self.blocksize}, tensor_to_bytes(codes) + tensor_to_bytes(state.absmax.float())

    def decode(self, header, payload, device):
        import bitsandbytes.functional as bnbf

        shape, n = tuple(header.shape), math.prod(header.shape)
        if header.blocksize not in (64, 128, 256, 512, 1024, 2048, 4096):
            raise CodecError(f"tensor {header.name!r}: unsupported blocksize {header.blocksize}")
        n_blocks = -(-n // header.blocksize)
        self._check_size(header, payload, n + 4 * n_blocks)
        view = memoryview(payload)
        codes = bytes_to_tensor(view[:n], torch.uint8, (n,)).to(device)
        absmax = bytes_to_tensor(view[n:], torch.float32, (n_blocks,)).to(device)
        if not torch.isfinite(absmax).all():
            raise CodecError(f"tensor {header.name!r}: non-finite block scale")
        x = bnbf.dequantize_blockwise(codes, absmax=absmax, code=_dynamic_map(codes.device), blocksize=header.blocksize)
        return x.reshape(shape).to(WIRE_TO_DTYPE[header.dtype])


CODECS: dict[str, Codec] = {c.name: c for c in (NoneCodec(), Float16Codec(), Blockwise8Codec())}
CODECS_BY_WIRE: dict[int, Codec] = {c.wire: c for c in CODECS.values()}


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        raise ValueError(f"unknown --codec {name!r}; choose one of {sorted(CODECS)}")
    return CODECS[name]
