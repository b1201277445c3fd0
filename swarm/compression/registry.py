"""Every codec by name (flags, configs, `CallMeta.reply_codec_name`) and by wire enum (headers).

Names: `none`, `fp16`, `blockwise8`, `piecewiseN` (N = 2..8 bits), and for activation gradients only `lowrankR`
(R = 1..256) and `topkP+INNER` (P = 1..99 percent of the rows, INNER one of the quantizers), each of these two with
`-noef` for no error feedback. Adding a codec family: its class, a name pattern here, one value in wire.proto's `Codec`
enum; the check below fails at import if the enum and the decoders disagree. Decoders read every setting from the
header, so one instance per wire value decodes what any instance of its family encoded.
"""

from __future__ import annotations

import functools
import re

from swarm.compression.base import Codec
from swarm.compression.blockwise import Blockwise8Codec
from swarm.compression.lowrank import LowRankCodec
from swarm.compression.piecewise import BITS, PiecewiseCodec
from swarm.compression.plain import Float16Codec, NoneCodec
from swarm.compression.topk import TokenTopKCodec
from swarm.protocol import wire_pb2 as pb

# the codecs that compress each tensor on its own (any role; hivemind's all-reduce takes the first three)
CODECS: dict[str, Codec] = {
    c.name: c for c in (NoneCodec(), Float16Codec(), Blockwise8Codec(), *(PiecewiseCodec(bits) for bits in BITS))
}
WHOLE_TENSOR_CODECS = ("none", "fp16", "blockwise8")  # what hivemind's averagers can send
CODECS_BY_WIRE: dict[int, Codec] = {
    c.wire: c for c in (*CODECS.values(), LowRankCodec(), TokenTopKCodec(50, CODECS["blockwise8"]))
}
CODEC_NAMES_HELP = (
    "none, fp16, blockwise8, piecewiseN (N bits, 2-8); for activation gradients also lowrankR (rank R) and "
    "topkP+CODEC (P%% of the tokens, CODEC one of the former), either with -noef for no error feedback"
)
MAX_NAME_CHARS = 40
_LOWRANK = re.compile(r"lowrank(\d{1,3})(-noef)?")
_TOPK = re.compile(r"topk(\d{1,2})\+([a-z0-9]+)(-noef)?")


@functools.cache
def get_codec(name: str) -> Codec:
    """The codec a name stands for; ValueError naming the choices if it stands for none."""
    if name in CODECS:
        return CODECS[name]
    try:
        if len(name) <= MAX_NAME_CHARS and (m := _LOWRANK.fullmatch(name)):
            return LowRankCodec(int(m[1]), error_feedback=not m[2])
        if len(name) <= MAX_NAME_CHARS and (m := _TOPK.fullmatch(name)) and m[2] in CODECS:
            return TokenTopKCodec(int(m[1]), CODECS[m[2]], error_feedback=not m[3])
    except ValueError as e:
        raise ValueError(f"codec {name!r}: {e}") from None
    shown = name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "..."
    raise ValueError(f"unknown codec {shown!r}; choose one of: {CODEC_NAMES_HELP.replace('%%', '%')}")


def _check_registry() -> None:
    """The wire enum and the decoders must name the same codecs, or a peer could send what nobody decodes."""
    enum = {value for _, value in pb.Codec.items()}
    if set(CODECS_BY_WIRE) != enum:
        raise ImportError(
            f"codec decoders {sorted(CODECS_BY_WIRE)} do not match wire.proto's Codec enum {sorted(enum)}"
        )


_check_registry()
