"""A stage fails closed: requests with values no healthy activation or gradient has are refused before they touch the
model, outlier gradients are not accumulated, a step never leaves the parameters non-finite, a stranger's optimizer
settings are not loaded, and malformed or oversized calls get a short INVALID_ARGUMENT (never UNKNOWN). Real grpc.aio
servers on 127.0.0.1 in this process (tests/stages.py)."""

import asyncio
import dataclasses
import math

import grpc
import pytest
import torch

from server.config import ComputeConfig, GuardConfig, OptimizerConfig
from server.errors import MAX_STATUS_CHARS
from server.guard import GradientGuard, GradientRejected
from server.state import state_digest
from server.worker import StageWorker
from swarm.compression import CompressionPolicy, get_codec
from swarm.config import tiny_test
from swarm.model import Stage
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.frames import Busy, ByteBudget, Limits, iter_frames, read_call
from swarm.protocol.rpc import PROTOCOL_VERSION, SERVICE, StageStub, aio_channel
from swarm.protocol.tensors import WireError, WireStats, encode_tensor
from tests.stages import CPU, InProcessStages, frames, random_batch, raw_call, run_microbatch
from trainer.client import StageClient

pytestmark = pytest.mark.timeout(120)
FLOAT32_MAX = torch.finfo(torch.float32).max


def hashed(worker: StageWorker) -> str:
    """The digest of the worker's state, hashed now: `digest()` is cached until a change goes through
    `changing_state`, and these tests look for changes that went around it."""
    meta, tensors = worker.state_tensors()
    return state_digest(tensors, meta)


def grads_of(worker: StageWorker) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in worker.params]


def same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


async def expect_refused(address: str, method: str, request: list, code=grpc.StatusCode.INVALID_ARGUMENT) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw_call(address, method, request)
    assert info.value.code() == code, info.value
    return info.value.details()


async def test_extreme_but_finite_requests_are_refused_and_change_nothing():
    """Values near the float32 limit, on every stage's Forward and Backward: INVALID_ARGUMENT, gradients and
    parameters untouched; the same stage then trains on a good microbatch."""
    cfg = tiny_test()
    B, T, D, last = 2, cfg.max_seq_len, cfg.d_model, cfg.n_stages - 1
    tokens, labels = random_batch(cfg, B)
    hidden = torch.randn(B, T, D)
    extreme = torch.full((B, T, D), FLOAT32_MAX / 2)
    just_over = hidden.clone()
    just_over[0, 0, 0] = 65505.0
    async with InProcessStages(cfg, samples_per_step=2) as stages:
        before = {i: (grads_of(w), hashed(w)) for i, w in stages.workers.items()}
        cases = [
            (0, "Backward", {"inputs": tokens, "grad_outputs": extreme}),
            (1, "Forward", {"inputs": extreme}),
            (1, "Forward", {"inputs": just_over}),
            (1, "Backward", {"inputs": extreme, "grad_outputs": hidden}),
            (1, "Backward", {"inputs": hidden, "grad_outputs": extreme}),
            (last, "Backward", {"inputs": extreme, "labels": labels}),
            (last, "Backward", {"inputs": -extreme, "labels": labels}),
        ]
        for stage, method, tensors in cases:
            message = await expect_refused(stages.addresses[stage], method, frames(stage, tensors))
            assert "outside [-65504, 65504]" in message, message
        for i, w in stages.workers.items():
            assert same(grads_of(w), before[i][0]) and hashed(w) == before[i][1], f"stage {i} changed"
        client = StageClient(CompressionPolicy.for_wire("none"), WireStats(), max_tensor_bytes=1 << 26)
        loss = await run_microbatch(stages, client, tokens, labels)
        await client.close()
        assert math.isfinite(loss)
        assert all(w.param_version == 1 for w in stages.workers.values())  # 2 samples: one step, finite
        assert all(torch.isfinite(p).all() for w in stages.workers.values() for p in w.params)


async def test_outlier_gradients_are_refused_after_the_warm_up():
    """Within the magnitude bound, grad_outputs 1e4 x the usual give gradients far above the median of the recent
    ones (more than the default 1000x): refused, counted, nothing accumulated; ordinary ones go on being accepted."""
    cfg = tiny_test()
    B, T, D = 2, cfg.max_seq_len, cfg.d_model
    async with InProcessStages(cfg, stages=[1]) as stages:
        worker, address = stages.workers[1], stages.addresses[1]
        gen = torch.Generator().manual_seed(0)
        for _ in range(worker.guard.warmup):
            x, g = torch.randn(B, T, D, generator=gen), torch.randn(B, T, D, generator=gen) * 1e-3
            await raw_call(address, "Backward", frames(1, {"inputs": x, "grad_outputs": g}))
        kept = grads_of(worker)
        x, g = torch.randn(B, T, D, generator=gen), torch.randn(B, T, D, generator=gen) * 10.0
        message = await expect_refused(address, "Backward", frames(1, {"inputs": x, "grad_outputs": g}))
        assert "exceeds" in message and "median" in message, message
        assert same(grads_of(worker), kept) and worker.guard.rejected == 1
        await raw_call(address, "Backward", frames(1, {"inputs": x, "grad_outputs": g * 1e-4}))
        assert worker.guard.accepted == worker.guard.warmup + 1
        async with aio_channel(address) as channel:
            info = await StageStub(channel).info(pb.InfoRequest(), timeout=5)
        assert info.gradients_rejected == 1 and info.requests_rejected == 1


def test_gradient_guard_policy():
    guard = GradientGuard(factor=10, warmup=3, window=5)
    ones = [torch.ones(4)]  # norm 2
    for _ in range(3):
        assert guard.limit() == math.inf
        guard.check(ones)
    assert guard.limit() == 20
    guard.check([torch.full((4,), 9.9)])  # norm 19.8: accepted
    with pytest.raises(GradientRejected):
        guard.check([torch.full((4,), 10.1)])
    with pytest.raises(GradientRejected):
        guard.check([torch.tensor([float("nan")])])
    with pytest.raises(GradientRejected):
        guard.check([torch.tensor([3e38, 3e38])])  # finite values whose squares overflow
    assert (guard.accepted, guard.rejected) == (4, 3)
    # honest gradients that grow past the bar are refused only until they are most of the window: no lock-out
    grown = [torch.full((4,), 50.0)]  # norm 100
    refused = 0
    for _ in range(5):
        try:
            guard.check(grown)
            break
        except GradientRejected:
            refused += 1
    assert 1 <= refused <= 3
    finite_only = GradientGuard(factor=0, warmup=1, window=1)
    finite_only.check(ones)
    finite_only.check([torch.full((4,), 1e15)])
    assert finite_only.limit() == math.inf


def test_a_step_never_leaves_parameters_non_finite():
    cfg = tiny_test()
    worker = StageWorker(Stage(cfg, 1), OptimizerConfig(clip_grad_norm=0), ComputeConfig(), CPU)
    start = state_digest(worker.state_tensors()[1])  # parameters and optimizer state (the epoch moves on)
    worker.apply_gradients([torch.full_like(p, float("inf")) for p in worker.params], end_epoch=True)
    assert (worker.steps_skipped, worker.param_version, worker.epoch) == (1, 0, 1)
    assert state_digest(worker.state_tensors()[1]) == start
    params = [p.detach().clone() for p in worker.params]
    for group in worker.optimizer.param_groups:
        group["lr"] = float("inf")  # what a corrupted schedule or state would do
    worker.apply_gradients([torch.ones_like(p) for p in worker.params], end_epoch=True)
    assert (worker.steps_rolled_back, worker.param_version, worker.epoch) == (1, 0, 2)
    assert all(torch.equal(a, b) for a, b in zip(worker.params, params, strict=True))


def test_a_state_with_other_settings_non_finite_values_or_missing_tensors_is_not_loaded():
    cfg = tiny_test()
    donor = StageWorker(Stage(cfg, 0), OptimizerConfig(lr=1.0), ComputeConfig(), CPU)
    joiner = StageWorker(Stage(cfg, 0), OptimizerConfig(), ComputeConfig(), CPU)
    start = hashed(joiner)
    with pytest.raises(ValueError, match="initial_lr"):
        joiner.load_state(*donor.state_tensors())
    meta, tensors = joiner.state_tensors()
    meta["param_groups"][0]["lr"] = 5.0
    with pytest.raises(ValueError, match="learning rate"):
        joiner.load_state(meta, tensors)
    meta, tensors = joiner.state_tensors()
    tensors[0][0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        joiner.load_state(meta, tensors)
    assert hashed(joiner) == start
    joiner.load_state(*joiner.state_tensors())  # its own: fine
    joiner.apply_gradients([torch.ones_like(p) for p in joiner.params], end_epoch=True)  # optimizer state now
    stepped = hashed(joiner)
    meta, tensors = joiner.state_tensors()
    assert meta["slots"]
    with pytest.raises(ValueError, match="incomplete"):  # a download cut short: it used to raise KeyError('step')
        joiner.load_state(meta, tensors[:-1])
    assert hashed(joiner) == stepped


async def test_malformed_unary_calls_and_huge_names_get_short_invalid_argument():
    cfg = tiny_test()
    async with InProcessStages(cfg, stages=[1]) as stages:
        address = stages.addresses[1]
        async with aio_channel(address) as channel:
            for method in ("Info", "Progress"):
                rpc = channel.unary_unary(f"/{SERVICE}/{method}")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await rpc(b"\xff\xff\xff\x0f garbage", timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await StageStub(channel).progress(pb.StageProgress(protocol_version=PROTOCOL_VERSION), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, stage=1)
        huge_name = pb.Frame(meta=meta, tensor=pb.TensorHeader(name="x" * 100_000, dtype=pb.DTYPE_FLOAT32, shape=[1]))
        message = await expect_refused(address, "Forward", [huge_name])
        assert len(message) <= MAX_STATUS_CHARS and "100000 characters" in message


def test_guard_flags_are_validated():
    with pytest.raises(ValueError, match="max-activation"):
        GuardConfig(max_activation=float("inf"))
    with pytest.raises(ValueError, match="grad-outlier-factor"):
        GuardConfig(grad_outlier_factor=0.5)


async def test_a_flood_gets_resource_exhausted_and_holds_no_more_than_the_budget():
    """40 concurrent Forwards that pause halfway through their payload, against a server that holds 3 requests' bytes
    (each with the frame it reads next) and 8 calls: the excess is turned away with RESOURCE_EXHAUSTED ("busy"), the bytes held never exceed the budget
    and are all given back, and the server then serves as before."""
    cfg = tiny_test()
    B, T, D = 4, cfg.max_seq_len, cfg.d_model
    request = frames(1, {"inputs": torch.randn(B, T, D)})
    encoded = encode_tensor("inputs", torch.randn(B, T, D), get_codec("none"))
    meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, stage=1)
    chunks = list(iter_frames(meta, [encoded], chunk_bytes=len(encoded.payload) // 2))
    async with InProcessStages(cfg, stages=[1], max_batch=B) as stages:
        service = stages.services[1]
        service.budget.limit = 3 * (len(encoded.payload) + service.schema.forward_limits.frame_bytes)  # + reading
        service.budget.caller_share = 1.0  # every call here comes from one address (tests/test_wire.py: per caller)
        service.guard = dataclasses.replace(service.guard, max_active_calls=8)
        peak = 0

        async def slow_stream():
            nonlocal peak
            yield chunks[0]
            await asyncio.sleep(0.5)
            peak = max(peak, service.budget.used)
            for chunk in chunks[1:]:
                yield chunk

        async def one(channel) -> grpc.StatusCode:
            try:
                async for _ in channel.stream_stream(f"/{SERVICE}/Forward")(slow_stream(), timeout=30):
                    pass
            except grpc.aio.AioRpcError as e:
                assert e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or "busy" in e.details(), e
                return e.code()
            return grpc.StatusCode.OK

        async with aio_channel(stages.addresses[1]) as channel:
            codes = await asyncio.gather(*(one(channel) for _ in range(40)))
        assert codes.count(grpc.StatusCode.OK) >= 3 and codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 20, codes
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert 0 < peak <= service.budget.limit and service.budget.used == 0
        assert service.requests_busy == codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
        reply = await raw_call(stages.addresses[1], "Forward", request)
        assert reply[0].tensor.name == "outputs"


def test_read_call_gives_back_what_it_took_when_a_stream_fails():
    encoded = encode_tensor("inputs", torch.randn(64, 64), get_codec("none"))
    meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, stage=1)
    chunks = list(iter_frames(meta, [encoded], chunk_bytes=1024))
    limits = Limits(len(encoded.payload), frozenset({"inputs"}))

    async def stream(parts):
        for part in parts:
            yield part

    budget = ByteBudget(1 << 20)
    with pytest.raises(WireError):
        asyncio.run(read_call(stream(chunks[:-1]), limits, budget))  # one chunk short
    assert budget.used == 0
    with pytest.raises(Busy):  # room for the frame being read and 4 chunks of payload
        asyncio.run(read_call(stream(chunks), limits, ByteBudget(limits.frame_bytes + 4096)))
    call = asyncio.run(read_call(stream(chunks), limits, budget))
    assert call.reserved == budget.used == len(encoded.payload)


def test_zero_gradients_are_no_evidence_of_scale():
    """A caller that sends Backwards whose gradients are zero drove the window's median to 0, and a limit of 0
    refused every honest microbatch for the rest of the run (`exceeds 0 (1000 x the median of the last 19)`)."""
    guard = GradientGuard(factor=1000, warmup=4, window=16)
    honest = [torch.full((4,), 3.46)]  # norm 6.92
    for _ in range(4):
        guard.check(honest, caller="ipv4:10.0.0.1")
    for _ in range(100):
        guard.check([torch.zeros(4)], caller="ipv4:10.0.0.66")
    assert guard.check(honest, caller="ipv4:10.0.0.1") == pytest.approx(6.92)
    assert guard.limit() == pytest.approx(1000 * 6.92)


def test_a_caller_that_is_most_of_the_traffic_moves_the_limit_no_further_than_any_other():
    """Tiny gradients from one caller, many times more of them than honest ones: the limit stays where the honest
    callers put it (a caller's median is one vote)."""
    guard = GradientGuard(factor=1000, warmup=4, window=16)
    for i in range(8):
        guard.check([torch.full((4,), 1.0 + i / 8)], caller=f"p2p:honest{i % 2}")
    for _ in range(500):
        guard.check([torch.full((4,), 1e-7)], caller="p2p:hostile")
    assert guard.limit() > 1000, guard.limit()  # the median of 3 votes: two honest ones (~2-3) against one
    guard.check([torch.full((4,), 5.0)], caller="p2p:honest0")  # norm 10: accepted
    with pytest.raises(GradientRejected):  # and the guard still refuses what no honest caller shows
        guard.check([torch.full((4,), 1e5)], caller="p2p:hostile")


def test_the_limit_never_falls_below_its_floor():
    """A majority of callers sending tiny gradients lowers the limit to factor x the floor, no further."""
    guard = GradientGuard(factor=1000, warmup=4, window=16, floor=1e-2)
    for caller in ("a", "b", "c"):
        for _ in range(4):
            guard.check([torch.full((4,), 1e-9)], caller=caller)
    assert guard.limit() == pytest.approx(10.0)
    assert guard.check([torch.full((4,), 3.46)], caller="honest") == pytest.approx(6.92)
