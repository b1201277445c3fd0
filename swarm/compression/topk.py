"""Token-level top-k (AccTFM, Zeng et al., §4.3.1): send only the rows (tokens) of an activation gradient with the
largest norms, and a bitmask saying which, the rows encoded by an inner codec.

A gradient of shape (..., d) is M rows of d values. The `ceil(fraction * M)` rows with the largest L2 norms travel,
in their original order; the others arrive as zeros. With error feedback the sender carries what it left out (the
dropped rows, and the inner codec's error on the kept ones) to the next microbatch of the same stream and global batch,
as swarm.compression.lowrank does. Payload: the mask (M bits, 8 a byte, little-endian), then the inner codec's payload.
Parameters: kept rows (uint32), the inner codec's wire value (uint8), then the inner codec's own parameters.
"""

from __future__ import annotations

import math
import struct

import torch

from swarm.compression.base import WIRE_TO_DTYPE, Codec, CodecContext, CodecError, bytes_to_tensor, tensor_view
from swarm.compression.blockwise import Blockwise8Codec
from swarm.compression.piecewise import PiecewiseCodec, pack_bits, unpack_bits
from swarm.compression.plain import Float16Codec, NoneCodec
from swarm.protocol import wire_pb2 as pb

# what may encode the kept rows: quantizers that keep each row on its own, never another stateful codec
INNER_DECODERS: dict[int, Codec] = {
    c.wire: c for c in (NoneCodec(), Float16Codec(), Blockwise8Codec(), PiecewiseCodec())
}


class TokenTopKCodec(Codec):
    """`topkP+INNER` (`-noef`: without error feedback): P percent of the rows, 1 <= P <= 99, encoded with INNER."""

    wire = pb.CODEC_TOKEN_TOPK
    gradients_only = True
    PARAMS = struct.Struct("<IB")

    def __init__(self, percent: int, inner: Codec, error_feedback: bool = True):
        if not 1 <= percent <= 99:
            raise ValueError(f"token top-k keeps 1 to 99 percent of the rows, got {percent}")
        if inner.wire not in INNER_DECODERS:
            raise ValueError(f"token top-k cannot nest {inner.name}")
        self.percent, self.inner, self.error_feedback = percent, inner, error_feedback
        self.name = f"topk{percent}+{inner.name}" + ("" if error_feedback else "-noef")

    def encode(self, t, ctx: CodecContext | None = None):
        shape = tuple(t.shape)
        g = t.detach().float().reshape(-1, shape[-1])  # (M, d)
        if ctx is not None and self.error_feedback:
            g = ctx.with_carried_error(shape, g)
        k = max(1, math.ceil(self.percent * g.shape[0] / 100))
        rows = torch.topk(g.norm(dim=1), k, sorted=False).indices.sort().values
        mask = torch.zeros(g.shape[0], dtype=torch.uint8, device=g.device)
        mask[rows] = 1
        inner_params, inner_payload = self.inner.encode(g[rows])
        if ctx is not None and ctx.memory is not None and self.error_feedback:  # decoding costs a pass: only if kept
            header = self._inner_header("error", k, g.shape[1], pb.DTYPE_FLOAT32, inner_params, inner_payload)
            error = g.clone()
            error[rows] -= self.inner.decode(header, inner_payload, g.device)
            ctx.keep_error(shape, error)
        params = self.PARAMS.pack(k, self.inner.wire) + inner_params
        return params, b"".join((tensor_view(pack_bits(mask, 1)), inner_payload))

    def _inner_header(
        self, name: str, k: int, d: int, dtype: int, params: bytes, payload: bytes | bytearray | memoryview
    ) -> pb.TensorHeader:
        header = pb.TensorHeader(name=name, shape=[k, d], payload_bytes=len(payload), codec_params=params)
        header.codec, header.dtype = self.inner.wire, dtype  # type: ignore[assignment]  # protobuf enums are ints
        return header

    def _split(
        self, header: pb.TensorHeader, payload: bytes | bytearray
    ) -> tuple[torch.Tensor, pb.TensorHeader, Codec]:
        """-> (row mask (M,) bool, the inner tensor's header, its decoder), every size and count checked."""
        if len(header.codec_params) < self.PARAMS.size:
            raise CodecError(f"tensor {header.name!r}: top-k takes at least {self.PARAMS.size} bytes of parameters")
        k, inner_wire = self.PARAMS.unpack(header.codec_params[: self.PARAMS.size])
        if inner_wire not in INNER_DECODERS:
            raise CodecError(f"tensor {header.name!r}: top-k rows cannot be encoded with codec {inner_wire}")
        d = int(header.shape[-1])
        m = math.prod(header.shape) // d if d else 0
        if not 1 <= k <= m:
            raise CodecError(f"tensor {header.name!r}: {k} rows kept of {m}")
        mask_bytes = -(-m // 8)
        if len(payload) < mask_bytes:
            raise CodecError(f"tensor {header.name!r}: payload shorter than its {mask_bytes}-byte row mask")
        packed = bytes_to_tensor(memoryview(payload)[:mask_bytes], torch.uint8, (mask_bytes,))
        mask = unpack_bits(packed, 1, mask_bytes * 8)
        if int(mask[m:].sum()) != 0 or int(mask[:m].sum()) != k:
            raise CodecError(f"tensor {header.name!r}: row mask does not select {k} of {m} rows")
        inner = self._inner_header(
            header.name,
            k,
            d,
            header.dtype,
            bytes(header.codec_params[self.PARAMS.size :]),
            memoryview(payload)[mask_bytes:],
        )
        return mask[:m].bool(), inner, INNER_DECODERS[inner_wire]

    def decode(self, header, payload, device, ctx=None):
        mask, inner_header, inner = self._split(header, payload)
        rows = inner.decode(inner_header, memoryview(payload)[len(payload) - inner_header.payload_bytes :], device)
        out = torch.zeros(mask.numel(), int(header.shape[-1]), dtype=rows.dtype, device=device)
        out[mask.to(device)] = rows
        return out.reshape(tuple(header.shape)).to(WIRE_TO_DTYPE[header.dtype])

    def value_bound(self, header, payload):
        """The rows' bound (the other values are zeros)."""
        _, inner_header, inner = self._split(header, payload)
        return inner.value_bound(inner_header, memoryview(payload)[len(payload) - inner_header.payload_bytes :])

    def encoded_bytes(self, numel, dtype):
        raise ValueError("top-k payloads depend on the tensor's shape (rows kept, row mask), not its size alone")
