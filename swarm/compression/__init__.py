"""Tensor codecs: the interface (base), one module per family, the registry, and the per-role policy."""

from swarm.compression.base import DTYPE_TO_WIRE, WIRE_TO_DTYPE, Codec, CodecError, bytes_to_tensor, tensor_to_bytes
from swarm.compression.blockwise import Blockwise8Codec
from swarm.compression.plain import Float16Codec, NoneCodec
from swarm.compression.registry import CODECS, CODECS_BY_WIRE, get_codec

__all__ = [
    "CODECS",
    "CODECS_BY_WIRE",
    "DTYPE_TO_WIRE",
    "WIRE_TO_DTYPE",
    "Blockwise8Codec",
    "Codec",
    "CodecError",
    "Float16Codec",
    "NoneCodec",
    "bytes_to_tensor",
    "get_codec",
    "tensor_to_bytes",
]
