"""Every codec by name (flags, configs) and by wire enum (headers). Adding a codec: its class, one entry here, one
value in wire.proto's `Codec` enum; the check below fails at import if the two disagree."""

from __future__ import annotations

from swarm.compression.base import Codec
from swarm.compression.blockwise import Blockwise8Codec
from swarm.compression.plain import Float16Codec, NoneCodec
from swarm.protocol import wire_pb2 as pb

CODECS: dict[str, Codec] = {c.name: c for c in (NoneCodec(), Float16Codec(), Blockwise8Codec())}
CODECS_BY_WIRE: dict[int, Codec] = {c.wire: c for c in CODECS.values()}


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        raise ValueError(f"unknown --codec {name!r}; choose one of {sorted(CODECS)}")
    return CODECS[name]


def _check_registry() -> None:
    """The wire enum and the registry must name the same codecs, or a peer could send what nobody decodes."""
    enum = {value for _, value in pb.Codec.items()}
    if set(CODECS_BY_WIRE) != enum or len(CODECS_BY_WIRE) != len(CODECS):
        raise ImportError(
            f"codec registry {sorted(CODECS_BY_WIRE)} does not match wire.proto's Codec enum {sorted(enum)}"
        )


_check_registry()
