"""Tensor codecs: the interface (base), one module per family, the registry, and the per-role policy."""

from swarm.compression.base import (
    DTYPE_TO_WIRE,
    WIRE_TO_DTYPE,
    Buffer,
    Codec,
    CodecContext,
    CodecError,
    TensorRole,
    bytes_to_tensor,
    tensor_to_bytes,
    tensor_view,
)
from swarm.compression.blockwise import Blockwise8Codec
from swarm.compression.plain import Float16Codec, NoneCodec
from swarm.compression.policy import CompressionPolicy, role_of
from swarm.compression.registry import CODECS, CODECS_BY_WIRE, get_codec

__all__ = [
    "CODECS",
    "CODECS_BY_WIRE",
    "DTYPE_TO_WIRE",
    "WIRE_TO_DTYPE",
    "Blockwise8Codec",
    "Buffer",
    "Codec",
    "CodecContext",
    "CodecError",
    "CompressionPolicy",
    "Float16Codec",
    "NoneCodec",
    "TensorRole",
    "bytes_to_tensor",
    "get_codec",
    "role_of",
    "tensor_to_bytes",
    "tensor_view",
]
