"""One peer of the swarm: serves a pipeline stage over gRPC, announces itself in the DHT, and moves to another stage
when the swarm needs it more (swarm/rebalance.py decides)."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc
import torch
from grpc_health.v1 import health, health_pb2
from hivemind.utils import get_dht_time

from dht.node import SwarmDHT
from dht.records import PeerEntry, ServerRecord
from server.checkpoint import load_checkpoint, save_checkpoint
from server.collab import Collaboration, LocalSteps, StageCollaboration
from server.config import ServerConfig
from server.service import StageSchema, StageService
from server.worker import StageWorker
from swarm.config import ModelConfig
from swarm.model import Stage
from swarm.protocol.rpc import SERVICE, start_stage_server
from swarm.rebalance import PeerLoad, StageLoad, SwarmView, choose_stage, decide, next_decision_time, stage_loads

logger = logging.getLogger("swarm.server")
# Every period: each peer publishes its load SNAPSHOT_LEAD seconds before the boundary, then reads everyone's
# READ_DELAY seconds after it, so all peers decide on the same numbers.
SNAPSHOT_LEAD, READ_DELAY = 1.5, 0.5


def read_view(per_stage: list[list[PeerEntry]], as_of: float) -> SwarmView:
    """The rebalancer's view from the stages' DHT records, as they stood at DHT time `as_of` (the period's boundary):
    a peer that joined or moved after it counts where it was before, or not at all, so that every peer reading a
    moment later sees the same swarm whichever of those records it already finds. A peer listed under two stages
    (a move whose tombstone has not reached every DHT node yet) counts where its freshest record puts it."""
    newest: dict[str, tuple[int, PeerEntry]] = {}
    for stage, entries in enumerate(per_stage):
        for e in entries:
            if e.record.joined_at > as_of:
                continue
            if e.peer_id not in newest or e.expiration > newest[e.peer_id][1].expiration:
                newest[e.peer_id] = (stage, e)
    peers: list[list[PeerLoad]] = [[] for _ in per_stage]
    for peer_id, (stage, e) in sorted(newest.items()):
        r = e.record
        peers[stage].append(
            PeerLoad(
                peer_id,
                throughput=r.throughput,
                queue_len=r.queue_length,
                demand=r.demand,
                last_move_s=r.joined_at or -math.inf,
                ready=r.ready,
            )
        )
    return SwarmView(tuple(StageLoad(i, tuple(p)) for i, p in enumerate(peers)))


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` or until `stop`; True if stopped."""
    try:
        await asyncio.wait_for(stop.wait(), max(seconds, 0.0))
    except TimeoutError:
        pass
    return stop.is_set()


class StageServer:
    """One peer: a gRPC endpoint (fixed for its lifetime) serving one stage at a time.

    Moving to another stage (the rebalancer, `--stage auto`) keeps the process, the DHT node, the port and the peer
    id: the peer turns new work away (trainers retry elsewhere), finishes accepted calls, waits for its stage's epoch
    so that its gradients are averaged in, withdraws its record, then enters the new stage the way a new peer does:
    build the module, commit its capacity there (a record with ready=False), download the stage's state from its
    peers, announce itself ready.
    """

    def __init__(self, cfg: ServerConfig, model_cfg: ModelConfig, sdht: SwarmDHT, device: torch.device):
        self.cfg, self.model_cfg, self.sdht, self.device = cfg, model_cfg, sdht, device
        self.worker: StageWorker | None = None
        self.collab: Collaboration | None = None
        self.service: StageService | None = None
        self.grpc_server: grpc.aio.Server | None = None
        self.health: health.aio.HealthServicer | None = None
        self.port = 0
        self.joined_at = 0.0  # DHT time this peer took its current stage
        self.moves = 0
        self.moving_to: int | None = None
        self.serving = False  # the current stage's state is complete (joined or loaded) and served
        # published load: throughput, demand (samples/s sent to us since the previous snapshot), queue length
        self.load = (0.0, 0.0, 0)
        self._counted = (time.monotonic(), 0)

    @property
    def stage(self) -> int:
        return self.worker.stage.index

    def record(self, ready: bool = True, stage: int | None = None) -> ServerRecord:
        w = self.worker
        return ServerRecord(
            host=self.cfg.announce_host or self.cfg.host,
            port=self.cfg.announce_port or self.port,
            stage=w.stage.index if stage is None else stage,
            throughput=self.load[0],
            demand=self.load[1],
            queue_length=self.load[2],
            param_version=w.param_version,
            joined_at=self.joined_at,
            ready=ready,
        )

    async def announce(self, ready: bool = True, stage: int | None = None) -> None:
        try:
            await self.sdht.announce(self.record(ready, stage), self.cfg.record_ttl)
        except Exception as e:  # the DHT may be briefly unreachable; the next period retries
            logger.warning("announce failed: %r", e)

    async def view(self, as_of: float) -> SwarmView:
        stages = range(self.model_cfg.n_stages)
        return read_view(await asyncio.gather(*(self.sdht.discover(i, include_pending=True) for i in stages)), as_of)

    def take_snapshot(self) -> None:
        """Fix the load this peer publishes until the next snapshot."""
        now, n = time.monotonic(), self.worker.samples_processed
        then, before = self._counted
        demand = max(n - before, 0) / (now - then) if now > then else 0.0
        self._counted = (now, n)
        self.load = (self.worker.throughput, demand, self.worker.queue_length)

    async def choose_stage(self) -> int:
        """`--stage auto`: the stage whose reinforcement raises the pipeline's throughput most (swarm.rebalance)."""
        view = await self.view(as_of=get_dht_time())
        known = sorted(p.throughput for s in view.stages for p in s.peers if p.throughput > 0)
        estimate = known[len(known) // 2] if known else 1.0  # our speed on a stage we have not built: the median peer
        stage = choose_stage(view, self.sdht.peer_id, estimate)
        logger.info(
            "--stage auto: peers per stage %s, capacity %s samples/s: joining stage %d",
            "/".join(str(len(s.peers)) for s in view.stages),
            "/".join(f"{s.capacity:.1f}" for s in view.stages),
            stage,
        )
        return stage

    async def enter(self, stage: int, prior_throughput: float = 0.0) -> None:
        """Build `stage`, take its state from its peers (or a checkpoint, or the shared seed), and serve it.
        `prior_throughput`: our speed on the stage we came from; 0: measure it on a random microbatch now."""
        cfg = self.cfg
        module = await asyncio.to_thread(Stage, self.model_cfg, stage)
        self.worker = worker = StageWorker(module, cfg, self.device, prior_throughput)
        if not prior_throughput:
            await worker.submit(lambda: worker.calibrate(min(cfg.max_batch_size, 8)))
        self.collab = collab = (
            LocalSteps(worker, cfg.samples_per_step) if cfg.solo else StageCollaboration(worker, self.sdht, stage, cfg)
        )
        await collab.launch()
        if self.moving_to is None:  # a move took the stage when it committed to it, before the period's boundary
            self.joined_at = get_dht_time()
        self._counted = (time.monotonic(), 0)
        self.take_snapshot()  # a move keeps announcing its pending record meanwhile (`run`)
        joined = await collab.join()
        if not joined and cfg.checkpoint_dir:
            await asyncio.to_thread(load_checkpoint, worker, cfg.checkpoint_dir)
        schema = StageSchema(self.model_cfg, stage, cfg.max_batch_size)
        if self.service is None:
            self.service = StageService(worker, schema, collab)
            self.grpc_server, self.health, self.port = await start_stage_server(
                self.service.handler(), cfg.host, cfg.port
            )
        if isinstance(collab, StageCollaboration):
            collab.address = self.record().address
        await collab.start()
        self.service.attach(worker, schema, collab)
        self.serving = True
        await self.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.announce()
        n_params = sum(p.numel() for p in worker.params)
        logger.info(
            "stage %d/%d on %s: %.2fM parameters, epoch %d (%s), %.1f samples/s capacity, serving at %s",
            stage,
            self.model_cfg.n_stages,
            worker.device,
            n_params / 1e6,
            worker.param_version,
            "joined peers" if joined else "own start",
            worker.throughput,
            self.record().address,
        )

    async def leave(self, reason: str) -> None:
        """Stop serving the current stage without losing work: see the class docstring."""
        worker, collab, service, cfg = self.worker, self.collab, self.service, self.cfg
        service.pause(reason)
        self.serving = False
        await self.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + cfg.drain_timeout
        while service.active_calls and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        dropped = await collab.finish_epoch(cfg.migration_drain_s)
        if dropped:
            logger.warning(
                "stage %d: epoch %d did not end within %.0fs; the gradients of %d samples are dropped",
                worker.stage.index,
                collab.epoch,
                cfg.migration_drain_s,
                dropped,
            )
        try:
            await asyncio.wait_for(self.sdht.withdraw(self.record(), cfg.record_ttl), 3)
        except Exception as e:
            logger.warning("could not withdraw the DHT record: %r", e)
        await collab.stop()
        await asyncio.to_thread(worker.shutdown)

    async def move(self, dst: int, why: str) -> None:
        src, started = self.stage, time.monotonic()
        logger.info("moving from stage %d to stage %d: %s", src, dst, why)
        # commit our capacity to dst at once: the next period's view must not count the stage we leave as short of a
        # peer while dst still looks starved, or a second peer would follow us there
        self.joined_at, self.moving_to = get_dht_time(), dst
        await self.announce(ready=False, stage=dst)  # kept fresh by `run` until we serve dst
        throughput = self.worker.throughput
        try:
            await self.leave(f"this peer is moving from stage {src} to stage {dst}")
            await self.enter(dst, throughput)
        finally:
            self.moving_to = None
        self.moves += 1
        logger.info(
            "moved from stage %d to stage %d in %.1fs (move %d of this peer)",
            src,
            dst,
            time.monotonic() - started,
            self.moves,
        )

    async def rebalance_forever(self, stop: asyncio.Event) -> None:
        """Every period, at the same wall-clock moment as every other peer, decide on the same view whether to move."""
        rb = self.cfg.rebalancing
        while True:
            at = next_decision_time(get_dht_time() + SNAPSHOT_LEAD, rb)
            if await _sleep_unless(stop, at - SNAPSHOT_LEAD - get_dht_time()):
                return
            if not self.service.paused:
                self.take_snapshot()
                await self.announce()
            if await _sleep_unless(stop, at + READ_DELAY - get_dht_time()):
                return
            try:
                view = await self.view(as_of=at)
            except Exception as e:
                logger.warning("rebalancing skipped: could not read the swarm's load: %r", e)
                continue
            if all(p.peer_id != self.sdht.peer_id for s in view.stages for p in s.peers):
                continue  # our record is not visible yet: the others do not count us either
            move = decide(view, self.sdht.peer_id, at, rb)
            if move is None:
                continue
            loads = "/".join(f"{x:.2f}" for x in stage_loads(view))
            peers = "/".join(str(len(s.peers)) for s in view.stages)
            # a record can be missing only because its peer's last announce was late (a loaded machine, a slow DHT):
            # read once more an announce period later, and move only if the same records still call for it
            if await _sleep_unless(stop, self.cfg.announce_period):
                return
            try:
                confirmed = decide(await self.view(as_of=at), self.sdht.peer_id, at, rb)
            except Exception as e:
                logger.warning("rebalancing skipped: could not re-read the swarm's load: %r", e)
                continue
            if confirmed != move:
                logger.info(
                    "not moving to stage %d: a second read of the swarm (peers per stage %s at the first) no "
                    "longer calls for it",
                    move.dst,
                    peers,
                )
                continue
            await self.move(move.dst, f"peers per stage {peers}, load (demand/capacity) {loads}")

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.cfg
        stage = await self.choose_stage() if cfg.stage == "auto" else int(cfg.stage)
        await self.enter(stage)
        rebalancing = cfg.rebalance and not cfg.solo
        rebalancer = asyncio.create_task(self.rebalance_forever(stop)) if rebalancing else None
        last_checkpoint = time.monotonic()
        try:
            while not await _sleep_unless(stop, cfg.announce_period):
                if self.moving_to is not None:  # our capacity stays committed to where we go
                    await self.announce(ready=False, stage=self.moving_to)
                    continue
                if not rebalancing:  # otherwise the rebalancer takes them, once per period
                    self.take_snapshot()
                await self.announce()
                w = self.worker
                logger.info(
                    "stage %d: epoch %d, %d samples, %.1f samples/s capacity, %.1f sent (last snapshot), "
                    "queue %d, rejected %d, all-reduce %.1f MB",
                    self.stage,
                    w.param_version,
                    w.samples_processed,
                    w.throughput,
                    self.load[1],
                    w.queue_length,
                    self.service.requests_rejected,
                    self.collab.allreduce_bytes / 1e6,
                )
                if cfg.checkpoint_dir and time.monotonic() - last_checkpoint > cfg.checkpoint_period:
                    last_checkpoint = time.monotonic()
                    await asyncio.to_thread(save_checkpoint, w, cfg.checkpoint_dir)
        finally:
            if rebalancer is not None:
                rebalancer.cancel()
                await asyncio.gather(rebalancer, return_exceptions=True)
            await self.shutdown()

    async def shutdown(self) -> None:
        cfg = self.cfg
        if self.grpc_server is None:
            return
        logger.info("stage %d: shutting down, draining up to %.0fs", self.stage, cfg.drain_timeout)
        await self.health.enter_graceful_shutdown()
        try:
            await asyncio.wait_for(self.sdht.withdraw(self.record(), cfg.record_ttl), 3)
        except Exception as e:
            logger.warning("could not withdraw the DHT record: %r", e)
        await self.grpc_server.stop(grace=cfg.drain_timeout)
        if cfg.checkpoint_dir and self.serving:  # not a stage we were still joining: its checkpoint would be wrong
            await asyncio.to_thread(save_checkpoint, self.worker, cfg.checkpoint_dir)
        await self.collab.stop()
        self.worker.shutdown()
