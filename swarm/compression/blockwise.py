"""8-bit dynamic blockwise quantization (bitsandbytes' format), on the device where the tensor lives.

On CUDA bitsandbytes' kernels encode and decode. On the CPU, bitsandbytes' encoder searches the 256-entry map for every
value (~4-8 ns a value on the development VM): the codec's largest CPU cost, paid by trainers and CPU-only peers. Here
the CPU encoder is torch: each value, scaled by its block's absmax, is rounded onto a uniform grid of 2**15 + 1 points
over [-1, 1], and a table built once from the map gives the code nearest to each grid point. Same format, same map:
every peer decodes what any other encodes. A grid step is 1/16384 of the block's absmax, far below the map's widest
gap (1/70 near +-1): the largest error per value stays the map's, and the code differs from bitsandbytes' nearest only
for values within 1/32768 of a midpoint between two codes (or, for tiny values, where the map is finer than the grid).
"""

from __future__ import annotations

import functools
import math
import struct

import torch

from swarm.compression.base import WIRE_TO_DTYPE, Codec, CodecError, bytes_to_tensor, tensor_to_bytes
from swarm.protocol import wire_pb2 as pb


@functools.cache
def _dynamic_map(device: torch.device) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    return bnbf.create_dynamic_map().to(device)


GRID_HALF = 1 << 14  # grid point k stands for (k - GRID_HALF) / GRID_HALF: -1, 0 and 1 are on the grid
SMALLEST_SCALE = 1e-30  # GRID_HALF / SMALLEST_SCALE is a finite float32
CHUNK_BLOCKS_BYTES = 1 << 20  # the CPU encoder's temporaries per chunk of whole blocks: within a core's cache


@functools.cache
def _grid_to_code() -> torch.Tensor:
    """uint8[2 * GRID_HALF + 1]: the code of the dynamic map nearest to each grid point."""
    code = _dynamic_map(torch.device("cpu")).double()
    grid = (torch.arange(2 * GRID_HALF + 1, dtype=torch.float64) - GRID_HALF) / GRID_HALF
    return torch.bucketize(grid, (code[1:] + code[:-1]) / 2).to(torch.uint8)


def _encode_cpu(x: torch.Tensor, blocksize: int, out: torch.Tensor, absmax: torch.Tensor) -> bool:
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


class Blockwise8Codec(Codec):
    """bitsandbytes dynamic blockwise quantization: one uint8 code per value plus one float32 absmax per block.

    Runs where the tensor lives (bitsandbytes' kernels on CUDA; on the CPU torch encodes, see above, and bitsandbytes
    decodes). The 256-entry dynamic map is the same on every peer, so only codes and absmax travel: 1 + 4/blocksize
    bytes per value. `cpu_encoder="bitsandbytes"` keeps bitsandbytes' CPU encoder (the benchmarks compare the two).
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
                if _encode_cpu(x, self.blocksize, codes, absmax):
                    return self.PARAMS.pack(self.blocksize), payload
        return self.PARAMS.pack(self.blocksize), self._encode_bitsandbytes(x)

    def _encode_bitsandbytes(self, x: torch.Tensor) -> bytes:
        import bitsandbytes.functional as bnbf

        codes, state = bnbf.quantize_blockwise(x, code=_dynamic_map(x.device), blocksize=self.blocksize)
        return tensor_to_bytes(codes) + tensor_to_bytes(state.absmax.float())

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
        import bitsandbytes.functional as bnbf

        n, blocksize, n_blocks = self._layout(header, payload)
        codes = bytes_to_tensor(memoryview(payload)[:n], torch.uint8, (n,)).to(device)
        absmax = self._scales(header, payload, n, n_blocks).to(device)
        x = bnbf.dequantize_blockwise(codes, absmax=absmax, code=_dynamic_map(codes.device), blocksize=blocksize)
        return x.reshape(tuple(header.shape)).to(WIRE_TO_DTYPE[header.dtype])

    def value_bound(self, header, payload):
        """Every value is a map entry (|entry| <= 1) times its block's scale: the largest scale bounds them all."""
        n, _, n_blocks = self._layout(header, payload)
        return float(self._scales(header, payload, n, n_blocks).abs().max()) if n_blocks else 0.0

    def encoded_bytes(self, numel, dtype):
        return numel + 4 * -(-numel // self.blocksize)
