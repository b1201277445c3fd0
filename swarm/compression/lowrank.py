"""Compressed backpropagation (Optimus-CC, Song et al., §5): activation gradients as rank-r factors, with lazy error
propagation.

A gradient of shape (..., d) is the matrix G (M x d), M the product of the leading dims (B*T for a hidden state).
One power iteration from the stream's last query Q (warm start, PowerSGD-style): P = orth(G Q), Q' = G^T P, and
G ~ P Q'^T. P has orthonormal columns (|values| <= 1) and travels fp16; Q' travels float32 (it carries G's scale). With
error feedback the sender adds the last error of the same stream and batch to G first and keeps the new error
(G - P Q'^T) for the next microbatch of that batch (swarm.compression.memory): over a batch, the sum of what was sent
tracks the sum of the true gradients. Payload: P (M x r fp16), then Q' (d x r float32); parameter: r.
"""

from __future__ import annotations

import math
import struct

import torch

from swarm.compression.base import WIRE_TO_DTYPE, Codec, CodecContext, CodecError, bytes_to_tensor, tensor_to_bytes
from swarm.protocol import wire_pb2 as pb

MAX_RANK = 256


def orthonormal_columns(x: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of x's column space (reduced QR, float32)."""
    return torch.linalg.qr(x.float(), mode="reduced").Q


def first_query(d: int, r: int, device: torch.device) -> torch.Tensor:
    """A stream's first query: the same on every sender, for reproducible runs."""
    gen = torch.Generator().manual_seed(d * 1_000_003 + r)
    return torch.randn(d, r, generator=gen).to(device)


class LowRankCodec(Codec):
    """`lowrankR` (`-noef`: without error feedback). Rank R in [1, 256], capped by the matrix's dims."""

    wire = pb.CODEC_LOWRANK
    gradients_only = True
    PARAMS = struct.Struct("<I")  # the rank

    def __init__(self, rank: int = 8, error_feedback: bool = True):
        if not 1 <= rank <= MAX_RANK:
            raise ValueError(f"low-rank codecs take a rank in [1, {MAX_RANK}], got {rank}")
        self.rank, self.error_feedback = rank, error_feedback
        self.name = f"lowrank{rank}" + ("" if error_feedback else "-noef")

    def encode(self, t, ctx: CodecContext | None = None):
        shape = tuple(t.shape)
        g = t.detach().float().reshape(-1, shape[-1])  # (M, d)
        r = min(self.rank, *g.shape)
        if ctx is not None and self.error_feedback:
            g = ctx.with_carried_error(shape, g)
        warm = ctx.warm_start(shape) if ctx is not None else None
        if warm is None or warm.shape != (g.shape[1], r):
            warm = first_query(g.shape[1], r, g.device)
        p = orthonormal_columns(g @ orthonormal_columns(warm)).to(torch.float16)  # (M, r)
        q = g.T @ p.float()  # (d, r)
        if ctx is not None:
            ctx.keep_warm_start(shape, q)
            if self.error_feedback and ctx.memory is not None:
                ctx.keep_error(shape, g - p.float() @ q.T)
        return self.PARAMS.pack(r), tensor_to_bytes(p, q)

    def _layout(self, header: pb.TensorHeader, payload: bytes | bytearray) -> tuple[int, int, int]:
        """-> (M, d, r) of a payload whose parameters and size are checked."""
        if len(header.codec_params) != self.PARAMS.size:
            raise CodecError(f"tensor {header.name!r}: lowrank takes {self.PARAMS.size} bytes of parameters")
        (r,) = self.PARAMS.unpack(header.codec_params)
        d = int(header.shape[-1])
        m = math.prod(header.shape) // d if d else 0
        if not 1 <= r <= min(m, d, MAX_RANK):
            raise CodecError(f"tensor {header.name!r}: rank {r} outside [1, {min(m, d, MAX_RANK)}]")
        self._check_size(header, payload, m * r * 2 + d * r * 4)
        return m, d, r

    def decode(self, header, payload, device, ctx=None):
        m, d, r = self._layout(header, payload)
        p = bytes_to_tensor(memoryview(payload)[: m * r * 2], torch.float16, (m, r)).to(device).float()
        q = bytes_to_tensor(memoryview(payload)[m * r * 2 :], torch.float32, (d, r)).to(device)
        if not bool(torch.isfinite(p).all() & torch.isfinite(q).all()):
            raise CodecError(f"tensor {header.name!r}: non-finite low-rank factors")
        return (p @ q.T).reshape(tuple(header.shape)).to(WIRE_TO_DTYPE[header.dtype])

    def encoded_bytes(self, numel, dtype):
        raise ValueError("low-rank payloads depend on the tensor's shape ((M * 2 + d * 4) * rank), not its size alone")
