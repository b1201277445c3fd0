"""Piecewise N-bit quantization (AccTFM, Zeng et al., §4.3.2): finer steps near zero, where most values are.

A value is stored as a sign bit and an (N-1)-bit magnitude index, relative to its block's absmax. The magnitude range
[0, 1] is split into m = N-1 clusters of equal width 1/m; cluster k holds 2**(m-1-k) intervals of width
U_k = 2**k / (m * 2**(m-1)), so each cluster's steps are twice the previous one's (U_{k+1} = 2 U_k) and the levels,
zero and every interval boundary, number 2**m. For N = 4: 0, 1/12, 2/12, 3/12, 4/12, 6/12, 8/12, 1. Activations and
their gradients are roughly Gaussian within a block, so this keeps a lower mean squared error than N-bit linear steps
(tests/unit/test_pipeline_codecs.py measures both). Each value rounds to its nearest level.

Payload: the codes packed N bits each (8 values in N bytes, little-endian), then one float32 absmax per block.
Torch ops only, on the tensor's device.
"""

from __future__ import annotations

import functools
import math
import struct

import torch

from swarm.compression.base import WIRE_TO_DTYPE, Codec, CodecError, bytes_to_tensor, tensor_to_bytes
from swarm.protocol import wire_pb2 as pb

BITS = range(2, 9)
BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)


@functools.cache
def magnitude_levels(bits: int) -> tuple[float, ...]:
    """The 2**(bits-1) magnitudes a code can stand for, ascending, from 0 to 1."""
    m = bits - 1
    levels, start = [0.0], 0.0
    for k in range(m):
        step = 2**k / (m * 2 ** (m - 1))
        levels += [start + step * (i + 1) for i in range(2 ** (m - 1 - k))]
        start = (k + 1) / m
    levels[-1] = 1.0  # exact, whatever the float sums above gave
    return tuple(levels)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2**bits -> uint8 bytes, 8 codes in `bits` bytes (the last group padded with zero codes)."""
    groups = -(-codes.numel() // 8)
    padded = torch.zeros(groups * 8, dtype=torch.int64, device=codes.device)
    padded[: codes.numel()] = codes
    grouped = padded.view(groups, 8)
    word = torch.zeros(groups, dtype=torch.int64, device=codes.device)
    for i in range(8):
        word |= grouped[:, i] << (bits * i)
    return torch.stack([(word >> (8 * j)) & 0xFF for j in range(bits)], dim=1).to(torch.uint8).view(-1)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: the first `n` codes, as int64."""
    grouped = packed.view(-1, bits).to(torch.int64)
    word = torch.zeros(grouped.shape[0], dtype=torch.int64, device=packed.device)
    for j in range(bits):
        word |= grouped[:, j] << (8 * j)
    mask = (1 << bits) - 1
    return torch.stack([(word >> (bits * i)) & mask for i in range(8)], dim=1).view(-1)[:n]


class PiecewiseCodec(Codec):
    """`piecewiseN`: N bits a value (2 <= N <= 8) plus a float32 scale per block of `blocksize` values."""

    wire = pb.CODEC_PIECEWISE
    PARAMS = struct.Struct("<BI")  # codec parameters: bits, block size

    def __init__(self, bits: int = 4, blocksize: int = 256):
        if bits not in BITS:
            raise ValueError(f"piecewise codecs take 2 to 8 bits, got {bits}")
        if blocksize not in BLOCKSIZES:
            raise ValueError(f"blocksize must be a power of two in [64, 4096], got {blocksize}")
        self.bits, self.blocksize = bits, blocksize
        self.name = f"piecewise{bits}"

    def encode(self, t, ctx=None):
        x = t.detach().reshape(-1).float()
        n, n_blocks = x.numel(), -(-x.numel() // self.blocksize)
        padded = torch.zeros(n_blocks * self.blocksize, device=x.device)
        padded[:n] = x
        blocks = padded.view(n_blocks, self.blocksize)
        absmax = blocks.abs().amax(dim=1)
        if not bool(torch.isfinite(absmax).all()):
            raise CodecError("piecewise: cannot encode non-finite values")
        levels = torch.tensor(magnitude_levels(self.bits), device=x.device)
        relative = blocks.abs() / absmax.clamp_min(1e-30)[:, None]
        index = torch.bucketize(relative, (levels[1:] + levels[:-1]) / 2)  # nearest level
        codes = (index | ((blocks < 0).long() << (self.bits - 1))).view(-1)[:n].to(torch.uint8)
        payload = tensor_to_bytes(pack_bits(codes, self.bits), absmax)
        return self.PARAMS.pack(self.bits, self.blocksize), payload

    def _layout(self, header: pb.TensorHeader, payload: bytes | bytearray) -> tuple[int, int, int, int]:
        """-> (values, bits, block size, blocks) of a payload whose parameters and size are checked."""
        if len(header.codec_params) != self.PARAMS.size:
            raise CodecError(f"tensor {header.name!r}: piecewise takes {self.PARAMS.size} bytes of parameters")
        bits, blocksize = self.PARAMS.unpack(header.codec_params)
        if bits not in BITS or blocksize not in BLOCKSIZES:
            raise CodecError(f"tensor {header.name!r}: unsupported piecewise bits {bits} or block size {blocksize}")
        n = math.prod(header.shape)
        n_blocks = -(-n // blocksize)
        self._check_size(header, payload, packed_bytes(n, bits) + 4 * n_blocks)
        return n, bits, blocksize, n_blocks

    def _scales(self, header: pb.TensorHeader, payload: bytes | bytearray, n_blocks: int) -> torch.Tensor:
        absmax = bytes_to_tensor(memoryview(payload)[len(payload) - 4 * n_blocks :], torch.float32, (n_blocks,))
        if not bool((torch.isfinite(absmax) & (absmax >= 0)).all()):
            raise CodecError(f"tensor {header.name!r}: block scales must be finite and >= 0")
        return absmax

    def decode(self, header, payload, device, ctx=None):
        n, bits, blocksize, n_blocks = self._layout(header, payload)
        absmax = self._scales(header, payload, n_blocks).to(device)
        packed = bytes_to_tensor(memoryview(payload)[: packed_bytes(n, bits)], torch.uint8, (packed_bytes(n, bits),))
        codes = unpack_bits(packed.to(device), bits, n)
        levels = torch.tensor(magnitude_levels(bits), device=device)
        magnitude = levels[codes & ((1 << (bits - 1)) - 1)]
        sign = 1.0 - 2.0 * (codes >> (bits - 1)).float()
        scale = absmax.repeat_interleave(blocksize)[:n]
        return (magnitude * sign * scale).reshape(tuple(header.shape)).to(WIRE_TO_DTYPE[header.dtype])

    def value_bound(self, header, payload):
        """Every magnitude level is <= 1: no value exceeds its block's scale."""
        _, _, _, n_blocks = self._layout(header, payload)
        return float(self._scales(header, payload, n_blocks).max()) if n_blocks else 0.0

    def encoded_bytes(self, numel, dtype):
        return packed_bytes(numel, self.bits) + 4 * -(-numel // self.blocksize)


def packed_bytes(n: int, bits: int) -> int:
    return -(-n // 8) * bits
