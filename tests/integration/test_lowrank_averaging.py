"""Low-rank averaging (ACP-SGD, PowerSGD) and parameter averaging on the real stage averager: two in-process peers of
one stage (real DHT, real hivemind averagers) average for real, end each round holding the same values, and a
joiner's download carries the factors."""

import asyncio
import time

import pytest
import torch

from server.collab.lowrank import LowRankState
from server.collab.rounds import ParameterAveraging
from server.stage_server import StageServer
from tests.peers import meet, stage_servers, start_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def gradients(shapes: list[torch.Size], basis: dict[int, torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Random gradients whose matrices share their column space with the other peer's (`basis`): two ACP rounds then
    send them whole."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(shapes):
        if i in basis:
            u = basis[i]
            out.append((u @ torch.randn(u.shape[1], shape[1:].numel(), generator=gen)).reshape(shape))
        else:
            out.append(torch.randn(shape, generator=gen))
    return out


async def two_peers(initial_peers: list[str], servers: list[StageServer], **averaging) -> tuple[StageServer, ...]:
    """Two peers of stage 0 with these AveragingConfig fields, once each lists the other."""
    pair = [await start_server(initial_peers, **averaging) for _ in range(2)]
    servers.extend(pair)
    a, b = pair
    await meet(a, b)
    return a, b


def shared_span_gradients(state: LowRankState, shapes: list[torch.Size]) -> tuple[list[list[torch.Tensor]], list]:
    """Both peers' gradients, whose matrices share a rank-2 column space, and their mean weighted 1 and 3."""
    gen = torch.Generator().manual_seed(0)
    basis = {
        i: torch.randn(n, 2, generator=gen)
        for i, (n, _, _) in zip(state.layout.matrices, state.layout.dims, strict=False)
    }
    grads = [gradients(shapes, basis, seed) for seed in (1, 2)]
    return grads, [(1 * ga + 3 * gb) / 4 for ga, gb in zip(*grads, strict=True)]


async def average_both(pair: tuple[StageServer, ...], grads: list[list[torch.Tensor]], epoch: int) -> list:
    """Both peers' gradient averaging of `epoch` at once, with 1 and 3 samples. No Backward brought those samples, so
    no admission proves them (server/collab/served.py): each peer is told the other's as proven."""
    for s, other, n_other in zip(pair, reversed(pair), (3, 1), strict=True):
        other_id = str(other.collab.averaging.gradients.averager.peer_id)
        s.collab.averaging.gradients.weight_caps = lambda _epoch, i=other_id, n=n_other: {i: float(n)}
    return await asyncio.gather(
        *(
            asyncio.to_thread(s.collab.averaging.gradients.average, g, n, f"test epoch {epoch}", epoch)
            for s, g, n in zip(pair, grads, (1, 3), strict=True)
        )
    )


async def test_two_stage_peers_average_acp_factors_for_real():
    async with stage_servers() as (peers, servers):
        a, b = await two_peers(peers, servers, allreduce_codec="acp", allreduce_rank=2, allreduce_warmup_epochs=0)
        acp = a.collab.averaging.gradients.lowrank
        shapes = [p.shape for p in a.worker.params]
        grads, mean = shared_span_gradients(acp, shapes)

        sent = []
        for epoch in (0, 1):  # a P round, then a Q round
            results = await average_both((a, b), grads, epoch)
            assert all(r is not None for r in results), "the round failed"
            for x, y in zip(*results, strict=True):
                assert torch.equal(x, y), "the peers hold different averages"
            sent.append(results[0])
        for i in acp.layout.whole:
            for r in sent:
                assert (r[i] - mean[i]).norm() / mean[i].norm() < 3e-2, f"tensor {i}: not the weighted mean"
        for i in acp.layout.matrices:
            first = (sent[0][i] - mean[i]).norm() / mean[i].norm()
            assert first > 0.05, f"tensor {i}: the P round sent it whole: nothing was compressed"
            both_rounds = (sent[0][i] + sent[1][i] - 2 * mean[i]).norm() / (2 * mean[i].norm())
            assert both_rounds < 5e-2, f"tensor {i}: two rounds with error feedback did not send it ({both_rounds})"
        full = sum(g.numel() for g in grads[0])
        assert a.collab.averaging.gradients.bytes < 2 * 2 * full, "sent more than two whole 8-bit rounds"
        shared = [s.collab.averaging.gradients.lowrank.shared_tensors() for s in servers]
        assert all(torch.equal(x, y) for x, y in zip(*shared, strict=True)), "the peers hold different factors"

        # a joiner's download: the worker's state and the factors, checked before anything changes
        meta, tensors, _ = a.collab.averaging.state.get_current_state()
        worker_tensors, factors = b.collab.averaging.state.split_state(meta, tensors)
        assert len(factors) == len(shared[0]) and len(worker_tensors) == len(tensors) - len(factors)
        bad_factor = [*tensors[:-1], torch.full_like(tensors[-1], float("nan"))]
        for bad_meta, bad_tensors in [
            ({**meta, "lowrank": -1}, tensors),
            ({**meta, "lowrank": "2"}, tensors),
            ({**meta, "lowrank": len(tensors) + 1}, tensors),
            ({**meta, "lowrank": 0}, tensors),
            ({**meta, "lowrank": len(factors) - 1}, tensors),
            (meta, bad_factor),
        ]:
            with pytest.raises(ValueError):
                b.collab.averaging.state.split_state(bad_meta, bad_tensors)


async def test_two_stage_peers_average_power_sgd_factors_for_real():
    """PowerSGD: one epoch is two real rounds (P with the whole tensors, then Q alone); both peers end it with the
    same values, and gradients whose weighted mean has rank <= r arrive whole after that one epoch."""
    async with stage_servers() as (peers, servers):
        pair = await two_peers(peers, servers, allreduce_codec="powersgd", allreduce_rank=2, allreduce_warmup_epochs=0)
        a = pair[0]
        shapes = [p.shape for p in a.worker.params]
        grads, mean = shared_span_gradients(a.collab.averaging.gradients.lowrank, shapes)
        results = await average_both(pair, grads, 0)
        assert all(r is not None for r in results), "the epoch failed"
        for x, y in zip(*results, strict=True):
            assert torch.equal(x, y), "the peers hold different averages"
        for i in range(len(shapes)):
            gap = (results[0][i] - mean[i]).norm() / mean[i].norm()
            assert gap < 3e-2, f"tensor {i}: not the weighted mean after one epoch ({gap})"
        gradient_averaging = a.collab.averaging.gradients
        assert gradient_averaging.rounds_ok == 2, "one PowerSGD epoch is two rounds"
        assert gradient_averaging.bytes < gradient_averaging.fp32_bytes / 4, "sent no fewer bytes than 8-bit whole"
        shared = [s.collab.averaging.gradients.lowrank.shared_tensors() for s in servers]
        assert all(torch.equal(x, y) for x, y in zip(*shared, strict=True)), "the peers hold different factors"


GATHER_S = 4.0


def parameter_averaging(server: StageServer) -> ParameterAveraging:
    averaging = server.collab.averaging.parameters
    assert averaging is not None, "built without --param-average-every"
    return averaging


async def test_parameter_averaging_runs_only_when_asked_and_only_where_the_peers_differ(caplog):
    """--param-average-every N averages parameters, on the gradient rounds' averager. Two stage peers
    with different parameters end a round holding their plain mean; peers that hold the same parameters learn it
    from a probe round of a few values and average nothing. In fixed groups (the default) and with matchmaking. In a
    fixed group, a probe that meets a member's other round gives way at once, and the parameter round that follows
    succeeds at its first attempt: refused by the member still in its probe, it failed attempt after attempt; held
    until that probe ended, it waited out the probe's gather time."""
    async with stage_servers() as (peers, servers):
        servers.append(await start_server(peers))
        assert servers[0].collab.averaging.parameters is None
        assert len(servers[0].collab.averaging.averagers()) == 1
        # members that have not all begun a fixed round within --matchmaking-time fail it: long enough here that a
        # probe which waited for that instead of giving way shows
        pair = await two_peers(
            peers, servers, param_average_every=1, matchmaking_time=GATHER_S, averaging_timeout=2 * GATHER_S
        )
        averaging = [parameter_averaging(s) for s in pair]
        assert len(pair[0].collab.averaging.averagers()) == 1, "parameter rounds need no process of their own"
        ids = [str(p.averager.peer_id) for p in averaging]

        def fill(values: tuple[float, float]) -> None:
            with torch.no_grad():
                for server, value in zip(pair, values, strict=True):
                    for p in server.worker.stage_params:
                        p.fill_(value)

        async def average_both(epoch: int, fixed: bool) -> None:
            await asyncio.gather(
                *(
                    asyncio.to_thread(
                        p.average,
                        s.worker,
                        epoch,
                        group_size=2,
                        group=lambda other=other: [other] if fixed else None,  # None: matchmaking
                    )
                    for p, s, other in zip(averaging, pair, reversed(ids), strict=True)
                )
            )

        n_values = sum(p.numel() for p in pair[0].worker.stage_params)
        for epoch, (fixed, values, mean, skipped) in enumerate(
            [
                (True, (2.0, 2.0), 2.0, 1),  # the same: probed, not averaged (also at the peers' first contact)
                (True, (1.0, 3.0), 2.0, 1),  # different: averaged
                (True, (1.0, 5.0), 3.0, 1),
                (False, (5.0, 5.0), 5.0, 2),
                (False, (1.0, 5.0), 3.0, 2),
            ],
            start=1,
        ):
            fill(values)
            sent = [p.bytes for p in averaging]
            caplog.clear()
            started = time.monotonic()
            await average_both(epoch, fixed)
            if fixed:  # (matchmade, a peer still in its second probe attempt may meet one that began the round)
                failed = [r.getMessage() for r in caplog.records if "attempt failed" in r.getMessage()]
                assert not failed, f"epoch {epoch}: {failed}"
                assert time.monotonic() - started < GATHER_S / 2, f"epoch {epoch}: a probe waited out the gather time"
            for server in pair:
                for p in server.worker.stage_params:
                    assert torch.equal(p, torch.full_like(p, mean)), (epoch, p.flatten()[:3])
            for p, before in zip(averaging, sent, strict=True):
                assert p.rounds_skipped == skipped, (epoch, p.rounds_skipped)
                if values[0] == values[1]:
                    assert p.bytes - before < 4096, f"epoch {epoch}: sent the parameters ({p.bytes - before} B)"
                else:
                    assert p.bytes - before >= 4 * n_values, f"epoch {epoch}: sent too little to average"
        assert [p.rounds_ok for p in averaging] == [3, 3] and [p.rounds_failed for p in averaging] == [0, 0]
