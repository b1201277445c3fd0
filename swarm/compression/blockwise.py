"""8-bit dynamic blockwise quantization (bitsandbytes' format), on the device where the tensor lives.

On CUDA bitsandbytes' kernels encode and decode. On the CPU torch does both, and bitsandbytes is not imported (that
alone cost each process ~3.5 s of CPU). bitsandbytes' CPU encoder searches the 256-entry map for every value (~4-8 ns
a value on the development VM): the codec's largest CPU cost, paid by trainers and CPU-only peers. Here each value,
scaled by its block's absmax, is rounded onto a uniform grid of 2**15 + 1 points over [-1, 1], and a table built once
from the map gives the code nearest to each grid point. Same format, same map: every peer decodes what any other
encodes. A grid step is 1/16384 of the block's absmax, far below the map's widest gap (1/70 near +-1): the largest
error per value stays the map's, and the code differs from bitsandbytes' nearest only for values within 1/32768 of a
midpoint between two codes (or, for tiny values, where the map is finer than the grid). Decoding is the map value
times the block's scale, bitwise what bitsandbytes' CPU decoder gives."""

from __future__ import annotations

import functools
import math
import struct

import numpy as np
import torch

from swarm.compression.base import WIRE_TO_DTYPE, Codec, CodecError, bytes_to_tensor, tensor_to_bytes
from swarm.protocol import wire_pb2 as pb

# bitsandbytes' `create_dynamic_map()` (signed, 8 bits), float32 little-endian, as stored here: importing bitsandbytes
# costs a process ~3.5 s of CPU (it loads torch's compiler stack), which every trainer and CPU server paid at start
# only to read these 1024 bytes (tests/unit/test_compression.py checks them against bitsandbytes')
_DYNAMIC_MAP_HEX = (
    "33337ebf9a997abf000077bf666673bfcdcc6fbf33336cbf9a9968bf000065bf666661bfcdcc5dbf33335abf9a9956bf000053bf66664fbf"
    "cdcc4bbf333348bf9a9944bf000041bf66663dbfcdcc39bf343336bf9a9932bf00002fbf66662bbfcdcc27bf343324bf9a9920bf00001dbf"
    "666619bfcdcc15bf343312bf9a990ebf00000bbf666607bfcccc03bf333300bf3233f9be0000f2becccceabe9a99e3be6666dcbe3333d5be"
    "0000cebeccccc6be9a99bfbe6666b8be3333b1be0000aabecccca2be9a999bbe666694be34338dbe000086be99997dbe33336fbecdcc60be"
    "666652be000044be9a9935be333327becdcc18be66660abe0000f8bd3433dbbd85ebc9bdf728c4bd6766bebdd7a3b8bd48e1b2bdb81eadbd"
    "2a5ca7bd9a99a1bd0ad79bbd7b1496bdeb5190bd5d8f8abdcdcc84bd7b147ebd5d8f72bd3d0a67bd1f855bbd000050bde17a44bdc3f538bd"
    "a3702dbd85eb21bd676616bd48e10abd52b8febc15aee7bcd7a3d0bc9a99b9bc5d8fa2bc1f858bbcc3f568bc48e13abc643b1fbc180416bc"
    "cdcc0cbc819503bc6abcf4bbd34de2bb3bdfcfbba470bdbb0d02abbb749398bbdd2486bb8a6c67bb5c8f42bb2db21dbbfca9f1ba9defa7ba"
    "ff6577ba3ee859ba806a3cbac1ec1eba016f01ba83e2c7b905e78cb90bd723b94b1fbab8b3ef8ab8348037b80642b2b7ff0502b7941a5ab6"
    "b7a313b500000000b7a31335941a5a36ff0502370642b23734803738b3ef8a384b1fba380bd7233905e78c3983e2c739016f013ac1ec1e3a"
    "806a3c3a3ee8593aff65773a9defa73afca9f13a2db21d3b5c8f423b8a6c673bdd24863b7493983b0d02ab3ba470bd3b3bdfcf3bd34de23b"
    "6abcf43b8195033ccdcc0c3c1804163c643b1f3c48e13a3cc3f5683c1f858b3c5d8fa23c9a99b93cd7a3d03c15aee73c52b8fe3c48e10a3d"
    "6766163d85eb213da3702d3dc3f5383de17a443d0000503d1f855b3d3d0a673d5d8f723d7b147e3dcdcc843d5d8f8a3deb51903d7b14963d"
    "0ad79b3d9a99a13d2a5ca73db81ead3d48e1b23dd7a3b83d6766be3df728c43d85ebc93d3433db3d0000f83d66660a3ecdcc183e3333273e"
    "9a99353e0000443e6666523ecdcc603e33336f3e99997d3e0000863e34338d3e6666943e9a999b3ecccca23e0000aa3e3333b13e6666b83e"
    "9a99bf3eccccc63e0000ce3e3333d53e6666dc3e9a99e33eccccea3e0000f23e3233f93e3333003fcccc033f6666073f00000b3f9a990e3f"
    "3433123fcdcc153f6666193f00001d3f9a99203f3433243fcdcc273f66662b3f00002f3f9a99323f3433363fcdcc393f66663d3f0000413f"
    "9a99443f3333483fcdcc4b3f66664f3f0000533f9a99563f33335a3fcdcc5d3f6666613f0000653f9a99683f33336c3fcdcc6f3f6666733f"
    "0000773f9a997a3f33337e3f0000803f"
)


@functools.cache
def dynamic_map(device: torch.device) -> torch.Tensor:
    """float32[256]: the codes' values, ascending, on `device`."""
    return torch.frombuffer(bytearray.fromhex(_DYNAMIC_MAP_HEX), dtype=torch.float32).to(device)


GRID_HALF = 1 << 14  # grid point k stands for (k - GRID_HALF) / GRID_HALF: -1, 0 and 1 are on the grid
SMALLEST_SCALE = 1e-30  # GRID_HALF / SMALLEST_SCALE is a finite float32
CHUNK_BLOCKS_BYTES = 1 << 20  # the CPU encoder's temporaries per chunk of whole blocks: within a core's cache


@functools.cache
def _grid_to_code() -> torch.Tensor:
    """uint8[2 * GRID_HALF + 1]: the code of the dynamic map nearest to each grid point."""
    code = dynamic_map(torch.device("cpu")).double()
    grid = (torch.arange(2 * GRID_HALF + 1, dtype=torch.float64) - GRID_HALF) / GRID_HALF
    return torch.bucketize(grid, (code[1:] + code[:-1]) / 2).to(torch.uint8)


def encode_cpu(x: torch.Tensor, blocksize: int, out: torch.Tensor, absmax: torch.Tensor) -> bool:
    """Codes of float32 `x` (flat, contiguous, CPU) into uint8 `out`, block scales into float32 `absmax`. False (and
    nothing written that counts) if a scale is not finite: bitsandbytes then encodes as it always did."""
    n = x.numel()
    full = n // blocksize
    if n % blocksize:
        absmax[full] = x[full * blocksize :].abs().amax()
    if full:
        torch.amax(x[: full * blocksize].view(full, blocksize).abs(), dim=1, out=absmax[:full])
    if not bool(torch.isfinite(absmax).all()):
        return False
    table = _grid_to_code()
    # value -> grid index: trunc(v * GRID_HALF / absmax + GRID_HALF + 0.5), one fused pass; |v| <= absmax keeps the
    # index within the table. Scales stay finite: a block under SMALLEST_SCALE (all zeros, say) encodes as zeros
    scale = GRID_HALF / absmax.clamp_min(SMALLEST_SCALE)
    offset = torch.tensor(GRID_HALF + 0.5, dtype=torch.float32)

    def encode(start: int, stop: int, values: torch.Tensor, scales: torch.Tensor) -> None:
        grid = torch.addcmul(offset, values, scales).view(-1).to(torch.int32)
        torch.index_select(table, 0, grid, out=out[start:stop])

    step = max(1, CHUNK_BLOCKS_BYTES // (4 * blocksize))
    for first in range(0, full, step):
        blocks = min(step, full - first)
        start, stop = first * blocksize, (first + blocks) * blocksize
        encode(start, stop, x[start:stop].view(blocks, blocksize), scale[first : first + blocks, None])
    if n % blocksize:
        encode(full * blocksize, n, x[full * blocksize :], scale[full])
    return True


@functools.cache
def _pair_table() -> np.ndarray:
    """int64[65536]: for each pair of codes read as one little-endian uint16, the two map values (float32, in order)
    as one 8-byte word: one lookup decodes two codes."""
    table = dynamic_map(torch.device("cpu"))
    pairs = torch.arange(1 << 16)
    return torch.stack([table[pairs & 0xFF], table[pairs >> 8]], 1).contiguous().view(torch.int64).view(-1).numpy()


def decode_cpu(
    codes: torch.Tensor, absmax: torch.Tensor, blocksize: int, code: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 values of uint8 `codes` (flat, contiguous, CPU) with float32 block scales `absmax`: each code's map
    value times its block's scale, the product bitsandbytes' CPU decoder computes (bitwise: tests/unit/test_compression.py).
    `code`: the map, if not the dynamic map. The dynamic map's codes are looked up two at a time (numpy's take with
    16-bit indices needs no conversion pass). Slower than bitsandbytes' C decoder on large tensors: 4.1 ms against
    1.7 per 8 MiB in `bench_wire --quick` on the 2-core VM (one code at a time was slower still); alike at 0.5 MB."""
    n, table = codes.numel(), dynamic_map(torch.device("cpu"))
    if n and n % 2 == 0 and (code is None or torch.equal(code, table)):
        # (every uint16 is in range: "clip" clips nothing, and unlike "raise" it does not buffer the output)
        out = torch.from_numpy(np.take(_pair_table(), codes.numpy().view(np.uint16), mode="clip").view(np.float32))
    else:  # an odd count, or another map (hivemind's format carries its sender's)
        out = torch.index_select(table if code is None else code, 0, codes.to(torch.int32))
    full = n // blocksize
    if full:
        out[: full * blocksize].view(full, blocksize).mul_(absmax[:full, None])
    if n % blocksize:
        out[full * blocksize :].mul_(absmax[full])
    return out


class Blockwise8Codec(Codec):
    """bitsandbytes dynamic blockwise quantization: one uint8 code per value plus one float32 absmax per block.

    Runs where the tensor lives (bitsandbytes' kernels on CUDA; on the CPU torch encodes, see above, and decodes).
    The 256-entry dynamic map is the same on every peer, so only codes and absmax travel: 1 + 4/blocksize bytes per
    value. `cpu_encoder="bitsandbytes"` keeps bitsandbytes' CPU encoder (the benchmarks compare the two).
    """

    wire, name = pb.CODEC_BLOCKWISE8, "blockwise8"
    BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
    PARAMS = struct.Struct("<I")  # codec parameters: the block size

    CPU_ENCODERS = ("torch", "bitsandbytes")

    def __init__(self, blocksize: int = 4096, cpu_encoder: str = "torch"):
        if blocksize not in self.BLOCKSIZES:
            raise ValueError(f"blocksize must be a power of two in [64, 4096], got {blocksize}")
        if cpu_encoder not in self.CPU_ENCODERS:
            raise ValueError(f"cpu_encoder must be one of {self.CPU_ENCODERS}, got {cpu_encoder!r}")
        self.blocksize, self.cpu_encoder = blocksize, cpu_encoder

    def encode(self, t, ctx=None):
        x = t.detach().contiguous().reshape(-1)
        if x.device.type == "cpu":
            x = x.float()  # bitsandbytes' CPU path is float32-only, and so is ours
            if self.cpu_encoder == "torch":
                n, n_blocks = x.numel(), -(-x.numel() // self.blocksize)
                payload = bytearray(n + 4 * n_blocks)  # codes, then scales: written in place
                codes = (
                    torch.frombuffer(payload, dtype=torch.uint8, count=n) if n else torch.empty(0, dtype=torch.uint8)
                )
                absmax = (
                    torch.frombuffer(payload, dtype=torch.float32, offset=n, count=n_blocks) if n else codes.float()
                )
                if encode_cpu(x, self.blocksize, codes, absmax):
                    return self.PARAMS.pack(self.blocksize), payload
        return self.PARAMS.pack(self.blocksize), self._encode_bitsandbytes(x)

    def _encode_bitsandbytes(self, x: torch.Tensor) -> bytes:
        import bitsandbytes.functional as bnbf

        codes, state = bnbf.quantize_blockwise(x, code=dynamic_map(x.device), blocksize=self.blocksize)
        return tensor_to_bytes(codes, state.absmax.float())

    def _layout(self, header: pb.TensorHeader, payload: bytes | bytearray) -> tuple[int, int, int]:
        """-> (values, block size, blocks) of a payload whose parameters and size are checked."""
        n = math.prod(header.shape)
        if len(header.codec_params) != self.PARAMS.size:
            raise CodecError(f"tensor {header.name!r}: {self.name} takes {self.PARAMS.size} bytes of parameters")
        (blocksize,) = self.PARAMS.unpack(header.codec_params)
        if blocksize not in self.BLOCKSIZES:
            raise CodecError(f"tensor {header.name!r}: unsupported blocksize {blocksize}")
        n_blocks = -(-n // blocksize)
        self._check_size(header, payload, n + 4 * n_blocks)
        return n, blocksize, n_blocks

    def _scales(self, header: pb.TensorHeader, payload: bytes | bytearray, n: int, n_blocks: int) -> torch.Tensor:
        absmax = bytes_to_tensor(memoryview(payload)[n:], torch.float32, (n_blocks,))
        if not torch.isfinite(absmax).all():
            raise CodecError(f"tensor {header.name!r}: non-finite block scale")
        return absmax

    def decode(self, header, payload, device, ctx=None):
        n, blocksize, n_blocks = self._layout(header, payload)
        codes = bytes_to_tensor(memoryview(payload)[:n], torch.uint8, (n,)).to(device)
        absmax = self._scales(header, payload, n, n_blocks).to(device)
        if codes.device.type == "cpu":
            x = decode_cpu(codes, absmax, blocksize)
        else:
            import bitsandbytes.functional as bnbf

            x = bnbf.dequantize_blockwise(codes, absmax=absmax, code=dynamic_map(codes.device), blocksize=blocksize)
        return x.reshape(tuple(header.shape)).to(WIRE_TO_DTYPE[header.dtype])

    def value_bound(self, header, payload):
        """Every value is a map entry (|entry| <= 1) times its block's scale: the largest scale bounds them all."""
        n, _, n_blocks = self._layout(header, payload)
        return float(self._scales(header, payload, n, n_blocks).abs().max()) if n_blocks else 0.0

    def encoded_bytes(self, numel, dtype):
        return numel + 4 * -(-numel // self.blocksize)
