"""Codecs that keep every value: raw bytes, and float16."""

from __future__ import annotations

import math

import torch

from swarm.compression.base import WIRE_TO_DTYPE, Codec, CodecError, bytes_to_tensor, tensor_view
from swarm.protocol import wire_pb2 as pb


class NoneCodec(Codec):
    wire, name = pb.CODEC_NONE, "none"

    def encode(self, t, ctx=None):
        return b"", tensor_view(t)

    def decode(self, header, payload, device, ctx=None):
        dtype = self.values_dtype(header, len(payload))  # its checks are decode's
        return bytes_to_tensor(payload, dtype, tuple(header.shape)).to(device)

    def values_dtype(self, header, nbytes):
        dtype = WIRE_TO_DTYPE[header.dtype]
        _no_params(self, header)
        self._check_size(header, nbytes, math.prod(header.shape) * dtype.itemsize)
        return dtype

    def encoded_bytes(self, numel, dtype):
        return numel * dtype.itemsize


class Float16Codec(Codec):
    wire, name = pb.CODEC_FLOAT16, "fp16"

    def encode(self, t, ctx=None):
        return b"", tensor_view(t.to(torch.float16))

    def decode(self, header, payload, device, ctx=None):
        self._check(header, len(payload))
        return bytes_to_tensor(payload, torch.float16, tuple(header.shape)).to(device).to(WIRE_TO_DTYPE[header.dtype])

    def values_dtype(self, header, nbytes):
        self._check(header, nbytes)
        # a float16 value is the value decoded to float16 or float32 exactly; in bfloat16 it rounds (65504 -> 65536)
        return torch.float16 if WIRE_TO_DTYPE[header.dtype] in (torch.float16, torch.float32) else None

    def _check(self, header: pb.TensorHeader, nbytes: int) -> None:
        """What decode checks before it reads the payload: no parameters, two bytes per value."""
        _no_params(self, header)
        self._check_size(header, nbytes, math.prod(header.shape) * 2)

    def encoded_bytes(self, numel, dtype):
        return numel * 2


def _no_params(codec: Codec, header: pb.TensorHeader) -> None:
    if header.codec_params:
        raise CodecError(f"tensor {header.name!r}: codec {codec.name} takes no parameters")
