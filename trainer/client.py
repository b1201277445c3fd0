"""Calls to stage servers: one grpc.aio channel per address, codec work off the event loop, replies validated."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from swarm.compression import WIRE_TO_DTYPE, CompressionPolicy, TensorRole, role_of
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.frames import Limits, iter_frames, read_call
from swarm.protocol.rpc import PROTOCOL_VERSION, Channels
from swarm.protocol.tensors import (
    FP16_MAX,
    EncodedTensor,
    WireError,
    WireStats,
    check_encoded,
    decode_tensor,
    encode_tensor,
    relayed,
)


@dataclass(frozen=True)
class Admission:
    """Where stage 0 put a microbatch: its global batch, and stage 0's epoch at the time, signed by the stage-0 peer
    that admitted it. Every later call of the microbatch carries it as it came (stages check the signature)."""

    global_batch: int
    admitted_at: int
    signer: str = ""
    signature: bytes = b""


@dataclass
class StageReply:
    encoded: EncodedTensor | None  # outputs (Forward) or grad_inputs (Backward; None from stage 0), as they came
    loss: float | None
    param_version: int
    admission: Admission | None = None  # stage 0's Forward reply

    @property
    def tensor(self) -> torch.Tensor | None:
        """The reply's tensor decoded (the trainer itself sends the encoded bytes on instead: `StageClient.call`)."""
        return None if self.encoded is None else decode_tensor(self.encoded, torch.device("cpu"))


# an earlier reply's bytes sent on are framed (copied) on the event loop below this size, in the codec pool above it
# (only its first piece where the rest came in frames of their own: EncodedTensor.relay_frames)
RELAY_ON_LOOP_BYTES = 1 << 20


def _handed_over(frames: deque[bytes]) -> Iterator[bytes]:
    """Each frame once, let go as gRPC takes it: a call does not hold its serialized request until its reply."""
    while frames:
        yield frames.popleft()


REPLY_ROLE = {"Forward": TensorRole.ACTIVATIONS, "Backward": TensorRole.ACTIVATION_GRADIENTS}


class StageClient:
    """Encodes each tensor with its role's codec (the policy's), and asks the server to encode its reply likewise."""

    def __init__(
        self,
        policy: CompressionPolicy,
        stats: WireStats,
        max_tensor_bytes: int,
        max_activation: float = FP16_MAX,
        backward_epilogue: float = 1.0,
        p2p: Callable[[], Awaitable] | None = None,
    ):
        """Replies are refused (WireError) above `max_tensor_bytes` per tensor or with a value beyond
        `max_activation` in magnitude (or NaN). `backward_epilogue` < 1: servers use the policy's low-rank or top-k
        gradient codec only for the last share of each global batch (CallMeta.reply_epilogue). `p2p`: this
        process's libp2p handle (`SwarmDHT.p2p`), for servers reached over libp2p."""
        self.policy, self.stats, self.max_activation = policy, stats, max_activation
        self.backward_epilogue = backward_epilogue
        self.channels = Channels(p2p)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="codec")
        self.reply_limits = Limits(max_tensor_bytes, frozenset({"outputs", "grad_inputs"}))

    async def call(
        self,
        address: str,
        method: str,
        stage: int,
        microbatch_id: str,
        tensors: dict[str, torch.Tensor | EncodedTensor],
        expect_shape: tuple[int, ...] | None,
        timeout: float,
        forward_version: int | None = None,
        inference: bool = False,
        admission: Admission | None = None,
    ) -> StageReply:
        """`method` is "Forward" or "Backward"; a Backward names the `forward_version` that served its Forward (the
        server recomputes the forward at it). `inference`: a Forward no Backward follows (evaluation). Tensors that
        are an earlier reply's `encoded` go on as they came, under their new name: a hidden state or gradient between
        two stages is quantized once, by the stage that computed it, and the trainer never decodes it. Raises
        grpc.aio.AioRpcError, asyncio.TimeoutError or WireError."""
        loop = asyncio.get_running_loop()
        reply_codec = self.policy.codec(REPLY_ROLE[method])
        meta = pb.CallMeta(
            protocol_version=PROTOCOL_VERSION,
            microbatch_id=microbatch_id,
            stage=stage,
            reply_codec=reply_codec.wire,  # type: ignore[arg-type]  # protobuf enums are ints at run time
            reply_codec_name=reply_codec.name,
            forward_version=forward_version,
            inference=inference,
        )
        if admission is not None:
            meta.global_batch, meta.admitted_at = admission.global_batch, admission.admitted_at
            meta.admitted_by, meta.admission_signature = admission.signer, admission.signature
        if method == "Backward" and reply_codec.gradients_only and self.backward_epilogue < 1:
            meta.reply_epilogue = self.backward_epilogue

        def encode(name: str, t: torch.Tensor | EncodedTensor) -> EncodedTensor:
            if isinstance(t, EncodedTensor):
                return relayed(t, name)
            return encode_tensor(name, t, self.policy.codec(role_of(name, t.dtype)))

        def frames() -> deque[bytes]:
            encoded = [encode(k, v) for k, v in tensors.items()]
            for sent in encoded:
                self.stats.add(role_of(sent.header.name, WIRE_TO_DTYPE[sent.header.dtype]), sent)
            return deque(iter_frames(meta, encoded))

        # frames are bytes both ways (swarm.protocol.frames): each payload is copied once into its frames, here in the
        # codec pool, not on the event loop, unless nothing is encoded and the bytes to copy are few
        few = sum(t.bytes_to_frame for t in tensors.values() if isinstance(t, EncodedTensor)) < RELAY_ON_LOOP_BYTES
        if few and all(isinstance(t, EncodedTensor) for t in tensors.values()):
            request = frames()
        else:
            request = await loop.run_in_executor(self.pool, frames)
        call = self.channels.stub(address).method(method)(_handed_over(request), timeout=timeout)
        del request  # held by the sender alone, which lets each frame go once gRPC has it
        reply = await asyncio.wait_for(read_call(call, self.reply_limits), timeout)
        enc: EncodedTensor | None = None
        if expect_shape is not None and not reply.tensors:
            raise WireError(f"stage {stage} replied without a tensor")
        if reply.tensors:
            (enc,) = reply.tensors.values()
            self.stats.add(role_of(enc.header.name, WIRE_TO_DTYPE[enc.header.dtype]), enc)
            shape, dtype = tuple(enc.header.shape), WIRE_TO_DTYPE[enc.header.dtype]
            if expect_shape is not None and shape != expect_shape:
                raise WireError(f"stage {stage} replied with shape {list(shape)}, expected {list(expect_shape)}")
            if not dtype.is_floating_point:
                raise WireError(f"stage {stage} replied with {dtype}, not floating-point values")
            await loop.run_in_executor(self.pool, check_encoded, enc, f"stage {stage}'s reply", self.max_activation)
        loss = reply.meta.loss if reply.meta.has_loss else None
        if loss is not None and not 0 <= loss < math.inf:
            raise WireError(f"stage {stage} replied with loss {loss}")
        admitted = None
        if reply.meta.HasField("global_batch") and reply.meta.HasField("admitted_at"):
            meta = reply.meta
            admitted = Admission(meta.global_batch, meta.admitted_at, meta.admitted_by, meta.admission_signature)
        return StageReply(encoded=enc, loss=loss, param_version=reply.meta.param_version, admission=admitted)

    async def close(self) -> None:
        await self.channels.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
