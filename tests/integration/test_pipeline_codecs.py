"""The pipeline's compressing codecs: piecewise N-bit, low-rank activation gradients and token top-k with lazy error
propagation; garbage and forged parameters; the reply codec a caller names, through a real stage server."""

import asyncio
import math

import grpc
import pytest
import torch

from swarm.compression import CompressionPolicy, get_codec
from swarm.config import tiny_test
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import PROTOCOL_VERSION
from swarm.protocol.tensors import WireStats, encode_tensor
from tests.stages import InProcessStages, random_batch, raw_call, run_microbatch
from trainer.client import StageClient


def test_stage_servers_reply_in_the_named_codec_and_refuse_forged_names():
    """A real swarm of in-process stage servers: a microbatch with forward piecewise4 and backward low-rank, its
    gradients relayed between stages as they came; a Forward that asks for a low-rank reply, and unknown names, get
    INVALID_ARGUMENT."""
    cfg = tiny_test()

    async def main():
        async with InProcessStages(cfg) as stages:
            stats = WireStats()
            client = StageClient(CompressionPolicy.for_wire("piecewise4", "lowrank4"), stats, 1 << 26)
            try:
                loss = await run_microbatch(stages, client, *random_batch(cfg, 4))
            finally:
                await client.close()
            assert loss is not None and math.isfinite(loss)
            by_role = stats.by_role()
            assert by_role["activations"][0] * 6 < by_role["activations"][1]  # ~7.8x at 4 bits
            assert by_role["activation_gradients"][0] * 2 < by_role["activation_gradients"][1]
            memory = stages.services[1].codec_memory
            assert memory._warm, "stage 1 encoded its grad_inputs with the low-rank codec and kept its query"
            h = torch.randn(2, cfg.max_seq_len, cfg.d_model)
            for name, method in (("lowrank4", "Forward"), ("lowrank9999", "Backward"), ("zzz", "Backward")):
                meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, microbatch_id="x", stage=1)
                meta.reply_codec_name = name
                tensors = {"inputs": h} | ({"grad_outputs": h} if method == "Backward" else {})
                frames = [pb.Frame(meta=meta)] + [
                    pb.Frame(tensor=(e := encode_tensor(k, v, get_codec("none"))).header, data=bytes(e.payload))
                    for k, v in tensors.items()
                ]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await raw_call(stages.addresses[1], method, frames)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert "codec" in (err.value.details() or "")

    asyncio.run(main())
