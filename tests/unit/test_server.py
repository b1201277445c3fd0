"""Real grpc.aio stage servers on 127.0.0.1 in this process (so their gradients can be inspected), driven by the
trainer's own client: gradient parity with the single-process model, wire savings, and rejection of bad requests."""

import dataclasses
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from server.config import ComputeConfig, OptimizerConfig
from server.worker import StageWorker
from swarm.compression import CompressionPolicy
from swarm.config import tiny_test
from swarm.model import GPT, Stage
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import PROTOCOL_VERSION, SERVICE, StageStub, aio_channel
from swarm.protocol.tensors import WireStats
from tests.stages import CPU, InProcessStages, frames, random_batch, raw_call, run_microbatch
from trainer.client import StageClient

pytestmark = pytest.mark.timeout(120)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def reference(cfg, tokens, labels):
    model = GPT(cfg)
    loss = model(tokens, labels)
    loss.backward()
    return loss.item(), model


async def grads_through_grpc(cfg, codec: str):
    tokens, labels = random_batch(cfg, 4)
    stats = WireStats()
    client = StageClient(CompressionPolicy.for_wire(codec), stats, max_tensor_bytes=1 << 26)
    async with InProcessStages(cfg) as stages:
        loss = await run_microbatch(stages, client, tokens, labels)
        await client.close()
        # servers accumulate sample-weighted sums (divided by the sample count at the step): one microbatch of B
        grads = [[p.grad / tokens.shape[0] for p in w.stage.parameters()] for w in stages.workers.values()]
    loss_ref, model = reference(cfg, tokens, labels)
    errors = [
        rel_err(g, p.grad)
        for gs, st in zip(grads, model.stages, strict=False)
        for g, p in zip(gs, st.parameters(), strict=False)
    ]
    return loss, loss_ref, errors, stats.as_dict()


async def test_grpc_gradients_equal_single_process_with_codec_none():
    cfg = dataclasses.replace(tiny_test(), checkpointing=True)
    loss, loss_ref, errors, _ = await grads_through_grpc(cfg, "none")
    # codec none sends exact fp32 bytes; weighting by the power-of-two B and dividing back is exact: fp noise only
    assert abs(loss - loss_ref) / loss_ref < 1e-6
    assert max(errors) < 1e-5, max(errors)


async def test_grpc_blockwise8_gradients_close_and_bytes_saved():
    cfg = dataclasses.replace(tiny_test(), d_model=64, n_heads=4, d_ff=128, max_seq_len=64)
    loss, loss_ref, errors, wire = await grads_through_grpc(cfg, "blockwise8")
    median_err = sorted(errors)[len(errors) // 2]
    print(
        f"\nblockwise8 in all four directions: loss {loss:.5f} vs {loss_ref:.5f}, relative gradient error median "
        f"{median_err:.2e} max {max(errors):.2e}; bytes fp32/wire {wire['fp32_bytes'] / wire['wire_bytes']:.2f}"
    )
    assert abs(loss - loss_ref) / loss_ref < 1e-2
    assert median_err < 5e-2  # 8-bit dynamic quantisation of activations and their gradients: ~1e-2 expected
    float_classes = {k: v for k, v in wire["by_role"].items() if k != "tokens"}
    ratio = sum(v["fp32"] for v in float_classes.values()) / sum(v["wire"] for v in float_classes.values())
    assert ratio >= 3.5, wire


async def test_bad_requests_get_invalid_argument_and_server_keeps_serving():
    cfg = tiny_test()
    B, T, D = 2, cfg.max_seq_len, cfg.d_model
    good_hidden = torch.randn(B, T, D)
    nan_hidden = good_hidden.clone()
    nan_hidden[0, 0, 0] = float("nan")
    header_too_big = pb.Frame(
        meta=pb.CallMeta(protocol_version=PROTOCOL_VERSION, stage=1),
        tensor=pb.TensorHeader(name="inputs", dtype=pb.DTYPE_FLOAT32, shape=[10**4, T, D]),
    )
    bad = {
        "garbage bytes": [b"\xff\x00garbage\x13\x37" * 10],
        "wrong shape": frames(1, {"inputs": torch.randn(B, T, D + 1)}),
        "wrong dtype": frames(1, {"inputs": torch.randint(0, 5, (B, T, D))}),
        "NaN": frames(1, {"inputs": nan_hidden}),
        "oversized": [header_too_big],
        "too long sequence": frames(1, {"inputs": torch.randn(B, T + 1, D)}),
        "wrong stage": frames(2, {"inputs": good_hidden}),
        "ids out of vocab": "stage0",
    }
    async with InProcessStages(cfg) as stages:
        for name, request in bad.items():
            address, request = stages.addresses[1], request
            if request == "stage0":
                address, request = stages.addresses[0], frames(0, {"inputs": torch.full((B, T), cfg.vocab_size)})
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_call(address, "Forward", request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, info.value)
            reply = await raw_call(stages.addresses[1], "Forward", frames(1, {"inputs": good_hidden}))
            assert reply[0].tensor.name == "outputs" and list(reply[0].tensor.shape) == [B, T, D], name
        assert stages.services[1].requests_rejected == len(bad) - 1
        # labels out of range on the last stage's Backward: rejected before the model, no gradient accumulated
        last = cfg.n_stages - 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw_call(
                stages.addresses[last],
                "Backward",
                frames(last, {"inputs": good_hidden, "labels": torch.full((B, T), -1)}),
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert all(p.grad is None for p in stages.workers[last].stage.parameters())

        async with aio_channel(stages.addresses[0]) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            reply = await StageStub(channel).info(pb.InfoRequest(with_digest=True), timeout=5)
            assert (reply.stage, reply.n_stages, reply.protocol_version) == (0, cfg.n_stages, PROTOCOL_VERSION)
            assert reply.requests_rejected == 1 and reply.epoch == 0  # the out-of-vocabulary ids
            assert reply.state_digest == stages.workers[0].digest()[1] != stages.workers[1].digest()[1]


async def test_server_steps_after_samples_per_step():
    cfg = tiny_test()
    client = StageClient(CompressionPolicy.for_wire("none"), WireStats(), max_tensor_bytes=1 << 26)
    async with InProcessStages(cfg, samples_per_step=8) as stages:
        before = [p.detach().clone() for p in stages.workers[0].stage.parameters()]
        for seed in range(2):
            await run_microbatch(stages, client, *random_batch(cfg, 4, seed))  # 4 samples each
        await client.close()
        assert [w.param_version for w in stages.workers.values()] == [1] * cfg.n_stages
        after = list(stages.workers[0].stage.parameters())
        assert all(p.grad is None for p in after), "gradients are cleared after the step"
        assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=False))


def test_returned_gradients_accumulate_on_as_if_never_taken():
    """After a failed round nobody stepped on, a peer puts its gradients back and the epoch goes on (server/collab/)."""
    cfg = tiny_test()
    tokens, labels = random_batch(cfg, 4, 0)
    _, more_labels = random_batch(cfg, 4, 1)
    workers = [StageWorker(Stage(cfg, cfg.n_stages - 1), OptimizerConfig(), ComputeConfig(), CPU) for _ in range(2)]
    hidden = torch.randn(*tokens.shape, cfg.d_model, generator=torch.Generator().manual_seed(0))
    for w in workers:
        w.backward(hidden, labels=labels)
    workers[0].return_gradients(*workers[0].take_gradients())
    for w in workers:
        w.backward(hidden, labels=more_labels)
    (got, n_got), (want, n_want) = (w.take_gradients() for w in workers)
    assert n_got == n_want == 2 * tokens.shape[0]
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
    assert workers[0].param_version == 0


def test_the_admissions_behind_each_count_follow_it_from_epoch_to_epoch():
    """What a peer shows its stage to prove its weight in a round (server/collab/served.py): the admissions of the
    microbatches in that epoch's gradients, early ones (a later batch) with the next epoch, late ones (an ended batch)
    with this one, through a take (the round runs, its admissions still shown for it), a failed round's return, and
    a skip."""
    cfg = tiny_test()
    tokens, labels = random_batch(cfg, 2, 0)
    hidden = torch.randn(*tokens.shape, cfg.d_model, generator=torch.Generator().manual_seed(0))
    w = StageWorker(Stage(cfg, cfg.n_stages - 1), OptimizerConfig(), ComputeConfig(), CPU)
    w.epoch = 5
    for name, batch in [("now", 5), ("early", 6), ("late", 4), ("now2", 5)]:
        w.backward(hidden, labels=labels, global_batch=batch, admission=name)
    assert w.served_for(5) == ["now", "now2", "late"] and w.served_for(6) == []
    grads, n = w.take_gradients()  # synchronous: the epoch is still 5 while its round runs
    assert n == 6 and w.served_for(5) == ["now", "now2", "late"]
    w.return_gradients(grads, n)  # the round failed: the epoch goes on, the early microbatch moved in with it
    assert w.served_for(5) == ["now", "now2", "late", "early"]
    w.take_gradients(end_epoch=True)  # delayed: the epoch moves on at once, its round runs meanwhile
    assert w.epoch == 6 and w.served_for(5) == ["now", "now2", "late", "early"] and w.served_for(6) == []
    assert w.taken_before(6) == (5, ["now", "now2", "late", "early"]) and w.taken_before(5) == (None, [])
    w.backward(hidden, labels=labels, global_batch=6, admission="six")
    w.backward(hidden, labels=labels, global_batch=7, admission="seven")
    w.skip_to(9)  # the epochs in between had nothing here: what it holds goes on to 9
    assert w.served_for(9) == ["six", "seven"] and w.served_for(6) == []
    w.drop_gradients()
    assert w.served_for(9) == [] and w.served_for(5) == [] and w.taken_before(9) == (None, [])


def test_control_jobs_run_before_waiting_requests():
    """Ending an epoch must not wait behind a burst of queued backwards (they would all fold into the epoch)."""
    from server.compute import ComputeThread

    compute, order, gate = ComputeThread("test"), [], threading.Event()
    try:
        futures = [compute.submit(gate.wait, control=False)]  # running: holds the thread
        futures += [compute.submit(lambda i=i: order.append(f"request {i}"), control=False) for i in range(3)]
        futures.append(compute.submit(lambda: order.append("end epoch"), control=True))
        gate.set()
        for f in futures:
            f.result(timeout=5)
        assert order == ["end epoch", "request 0", "request 1", "request 2"]
    finally:
        compute.shutdown()


@pytest.mark.parametrize("stash_versions", [2, 0])
def test_backward_recomputes_the_forward_at_the_version_that_served_it(stash_versions):
    """A step between a microbatch's Forward and its Backward: the backward must use the parameters that produced the
    microbatch's outputs (a gradient of one model), not the stepped ones, as long as that version is stashed."""
    cfg = tiny_test()
    compute = ComputeConfig(stash_versions=stash_versions)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, cfg.max_seq_len, cfg.d_model, generator=gen)
    grad_out = torch.randn(2, cfg.max_seq_len, cfg.d_model, generator=gen)
    worker, reference = (StageWorker(Stage(cfg, 1), OptimizerConfig(), compute, CPU) for _ in range(2))  # same seed
    served_by = worker.param_version
    worker.apply_gradients([torch.randn_like(p, generator=gen) for p in worker.params])  # another epoch's step
    assert worker.param_version == served_by + 1
    result = worker.backward(x, grad_outputs=grad_out, forward_version=served_by)
    expected = reference.backward(x, grad_outputs=grad_out)  # the reference never stepped: version `served_by`
    same = all(torch.equal(p.grad, q.grad) for p, q in zip(worker.params, reference.params, strict=True))
    same = same and torch.equal(result.grad_inputs, expected.grad_inputs)
    if stash_versions:
        assert same and worker.backwards_at_stashed_version == 1
        assert not any(torch.equal(p, q) for p, q in zip(worker.params, reference.params, strict=True)), "restored"
    else:
        assert not same and worker.backwards_past_stash == 1


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_a_forward_in_pieces_is_the_whole_forward_bit_for_bit(which):
    """--forward-chunk-samples (16 on CPU by default): a Forward is computed a piece at a time, with the working
    memory of a piece, and its output is the whole batch's, bitwise (no layer mixes samples). 37 samples: 3 pieces."""
    cfg = tiny_test()
    index = {"first": 0, "middle": 1, "last": cfg.n_stages - 1}[which]
    tokens, _ = random_batch(cfg, 37, 0)
    hidden = torch.randn(*tokens.shape, cfg.d_model, generator=torch.Generator().manual_seed(0))
    inputs = tokens if index == 0 else hidden
    pieced = StageWorker(Stage(cfg, index), OptimizerConfig(), ComputeConfig(), CPU)
    whole = StageWorker(Stage(cfg, index), OptimizerConfig(), ComputeConfig(forward_chunk_samples=0), CPU)
    assert (pieced.forward_chunk, whole.forward_chunk) == (16, 0)
    whole.stage.load_state_dict(pieced.stage.state_dict())
    calls = []
    pieced.stage.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    out = pieced.forward(inputs)
    assert calls == [16, 16, 5]
    assert torch.equal(out, whole.forward(inputs))
