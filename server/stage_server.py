"""One peer of the swarm: serves a pipeline stage over gRPC, announces itself in the DHT, and moves to another stage
when the swarm needs it more (server/rebalancer.py, swarm/rebalance.py decide)."""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import threading
import time
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health, health_pb2
from hivemind.utils import get_dht_time

from dht.node import SwarmDHT
from dht.records import ServerRecord
from dht.relay import report as report_relays
from server.checkpoint import load_checkpoint, save_checkpoint
from server.collab import Collaboration, SoloSteps, StageCollaboration
from server.config import ServerConfig
from server.heap import settle, trim_forever
from server.metrics import fill_server_metrics
from server.reachability import self_test
from server.rebalancer import Rebalancer, sleep_unless
from server.schema import StageSchema
from server.service import StageService
from server.worker import StageWorker
from swarm import stacks
from swarm.config import ModelConfig
from swarm.metrics import serve_metrics
from swarm.model import Stage
from swarm.net import is_own_address, is_unspecified
from swarm.protocol import p2p as p2p_transport
from swarm.protocol.p2p import serve as serve_over_p2p
from swarm.protocol.reach import ReachResponder
from swarm.protocol.rpc import SERVICE, start_stage_server
from swarm.protocol.tls import ServerTls
from swarm.tasks import Overlapping

logger = logging.getLogger("swarm.server")
MAX_ANNOUNCES_IN_FLIGHT = 3  # announces still landing (announce_forever): the oldest has waited 3 periods
LAUNCH_TRIES = 3  # tries to start a stage's averager processes (`_launch`)
MOVE_GRACE_S = 15.0  # a move runs longer than its drains plus this: log what it waits on (swarm/stacks.py)
RELAY_SLOT_WAIT_S = 60.0  # a peer behind NAT waits this long for a relay slot before it serves anyway
RELAY_SLOT_POLL_S = 0.5


class PeerState(enum.Enum):
    STARTING = "starting"  # building its first stage and taking the stage's state: not serving yet
    SERVING = "serving"
    MOVING = "moving"  # leaving its stage for `StageServer.destination`, whose capacity it has committed to
    STOPPED = "stopped"


@dataclass(frozen=True)
class LoadSnapshot:
    """What a peer publishes for the rebalancer until its next snapshot."""

    throughput: float = 0.0  # samples/s it can sustain (measured)
    demand: float = 0.0  # samples/s it was sent since the previous snapshot
    queue_length: int = 0  # requests waiting or running


@dataclass
class Endpoint:
    """The peer's gRPC server: started with its first stage, the same port for its whole life."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service: StageService


@dataclass
class ActiveStage:
    """The stage the peer currently holds."""

    worker: StageWorker
    collab: Collaboration
    schema: StageSchema


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
        self.state = PeerState.STARTING
        self.destination = 0  # the stage a MOVING peer goes to
        self.joined_at = 0.0  # DHT time this peer took its current stage
        self.moves = 0
        self.load = LoadSnapshot()
        self.rebalancer = Rebalancer(self)
        self._active: ActiveStage | None = None
        self._endpoint: Endpoint | None = None
        self._counted = (time.monotonic(), 0)  # (when, samples processed) at the last snapshot
        self.seen_host: str | None = None  # where the swarm's peers see us (reachability self-test)
        self.p2p_only = False  # callers reach us over libp2p: the swarm cannot dial our gRPC port (--transport)
        self.behind_nat = False  # the swarm cannot dial us where it sees us, an address that is not ours
        self.tls = ServerTls.from_config(cfg.tls)
        self._relay_report: asyncio.Task | None = None  # the check of our relays, when we are reached through them

    @property
    def active(self) -> ActiveStage:
        assert self._active is not None, "the peer holds no stage yet"
        return self._active

    @property
    def endpoint(self) -> Endpoint:
        assert self._endpoint is not None, "the peer's gRPC server is not started yet"
        return self._endpoint

    @property
    def worker(self) -> StageWorker:
        return self.active.worker

    @property
    def collab(self) -> Collaboration:
        return self.active.collab

    @property
    def service(self) -> StageService:
        return self.endpoint.service

    @property
    def stage(self) -> int:
        return self.worker.stage.index

    @property
    def serving(self) -> bool:
        return self.state is PeerState.SERVING

    async def _libp2p_path(self) -> tuple[str, bool]:
        """How callers' libp2p daemons reach ours, as far as we can tell: directly at the addresses it listens on
        (when they can dial one), else through a relay (a public DHT node: swarm-dht --public). And whether that is
        through a relay only."""
        direct = [m for m in await self._our_maddrs() if "p2p-circuit" not in m]
        hint = "a public DHT node relays: swarm-dht --public"
        if not direct:
            return f"through a relay only: our DHT node listens on no address ({hint})", True
        return f"directly at {', '.join(direct)} where they can dial it, else through a relay ({hint})", False

    async def _our_maddrs(self, latest: bool = False) -> list[str]:
        """Our libp2p daemon's addresses as callers see them; `latest`: asked of the daemon now, not cached."""
        try:
            return [str(m) for m in await (await self.sdht.p2p()).get_visible_maddrs(latest=latest)]
        except ValueError:  # hivemind: "No multiaddrs found"
            return []

    async def _wait_for_relay_slot(self) -> None:
        """Behind NAT: wait until a relay holds a slot for us (our daemon lists a /p2p-circuit address), up to
        RELAY_SLOT_WAIT_S. Serving before that, callers' dials through the relay end in NO_RESERVATION: each call
        fails and the caller bans us (measured behind a masquerading router: the daemon reserved 13 s after our
        check, and the trainer's calls failed until then, then kept away for 30 s more)."""
        started = time.monotonic()
        while time.monotonic() - started < RELAY_SLOT_WAIT_S:
            if relays := [m for m in await self._our_maddrs(latest=True) if "p2p-circuit" in m]:
                logger.info("a relay holds a slot for us after %.1fs: %s", time.monotonic() - started, relays[0])
                return
            await asyncio.sleep(RELAY_SLOT_POLL_S)
        logger.warning(
            "no relay holds a slot for us after %.0fs: callers that cannot dial us fail until one does (a public DHT "
            "node relays: swarm-dht --public)",
            RELAY_SLOT_WAIT_S,
        )

    def record(self, ready: bool = True, stage: int | None = None) -> ServerRecord:
        return ServerRecord(
            host=self.cfg.network.announce_host or self.seen_host or self.cfg.network.host,
            port=self.cfg.network.announce_port or (self._endpoint.port if self._endpoint else 0),
            stage=self.stage if stage is None else stage,
            throughput=self.load.throughput,
            demand=self.load.demand,
            queue_length=self.load.queue_length,
            param_version=self.worker.param_version,
            joined_at=self.joined_at,
            ready=ready,
            tls_cert=self.tls.cert_pem if self.tls else "",
            p2p_id=self.sdht.p2p_id,
            p2p_only=self.p2p_only,
            allreduce_bytes=self.collab.allreduce_bytes,
            allreduce_fp32_bytes=self.collab.allreduce_fp32_bytes,
        )

    async def check_reachability(self) -> None:
        """Ask swarm peers to dial our Stage service; log what they say. Listening on 0.0.0.0 or :: with no
        --announce-host: announce the address they see us at."""
        net = self.cfg.network
        host = net.announce_host or net.host
        port = net.announce_port or self.endpoint.port
        cert = self.tls.cert_pem if self.tls else ""
        test = await self_test(self.sdht, net.initial_peers, self.model_cfg.n_stages, host, port, cert)
        if test.host and test.host != host:
            self.seen_host = test.host
            logger.info("announcing %s: the address the swarm's peers see us at", test.host)
        elif is_unspecified(host):
            logger.warning("announcing %s, which nobody can dial: pass --announce-host", host)
        report = test.report(port, "--announce-host/--announce-port")
        unreachable = test.result.answered and not test.result.ok
        (logger.warning if unreachable else logger.info)(report)
        # we asked where the swarm sees us: at an address no interface of ours holds, where it cannot dial us
        self.behind_nat = bool(unreachable and is_unspecified(host) and test.host and not is_own_address(test.host))
        if unreachable and net.transport == "auto":
            self.p2p_only = True
            logger.warning(
                "serving over libp2p instead (its address: p2p:%s): trainers and stage peers reach us through their "
                "DHT nodes, directly or relayed as libp2p manages; slower than direct gRPC",
                self.sdht.p2p_id,
            )

    async def announce(self, ready: bool = True, stage: int | None = None) -> None:
        await self._store(self.record(ready, stage))

    async def _store(self, record: ServerRecord) -> None:
        try:
            await self.sdht.announce(record, self.cfg.network.record_ttl)
        except Exception as e:  # the DHT may be briefly unreachable; the next period retries
            logger.warning("announce failed: %r", e)

    def take_snapshot(self) -> None:
        """Fix the load this peer publishes until the next snapshot."""
        now, n = time.monotonic(), self.worker.samples_processed
        then, before = self._counted
        demand = max(n - before, 0) / (now - then) if now > then else 0.0
        self._counted = (now, n)
        self.load = LoadSnapshot(self.worker.throughput, demand, self.worker.queue_length)

    async def enter(self, stage: int, prior_throughput: float = 0.0) -> None:
        """Build `stage`, take its state from its peers (or a checkpoint, or the shared seed), and serve it.
        `prior_throughput`: our speed on the stage we came from; 0: measure it on a random microbatch now."""
        cfg = self.cfg
        module = await asyncio.to_thread(Stage, self.model_cfg, stage)
        worker = StageWorker(module, cfg.optimizer, cfg.compute, self.device, prior_throughput, cfg.guard)
        if not prior_throughput:
            await worker.submit(lambda: worker.calibrate(min(cfg.compute.max_batch_size, 8)))
        collab = await self._launch(worker, stage)
        self._active = ActiveStage(
            worker, collab, StageSchema(self.model_cfg, stage, cfg.compute.max_batch_size, cfg.guard.max_activation)
        )
        if self.state is not PeerState.MOVING:  # a move took the stage when it committed to it, before the boundary
            self.joined_at = get_dht_time()
        self._counted = (time.monotonic(), 0)
        self.take_snapshot()  # a move keeps announcing its pending record meanwhile (`announce_forever`)
        joined = await collab.join()
        if not joined and cfg.checkpoint.checkpoint_dir:
            await asyncio.to_thread(load_checkpoint, worker, cfg.checkpoint.checkpoint_dir, collab.lowrank)
        if self._endpoint is None:
            service = StageService(worker, self.active.schema, collab, cfg.guard)
            server, health_servicer, port = await start_stage_server(
                service.handler(), cfg.network.host, cfg.network.port, self.tls, self.sdht.swarm_key
            )
            if self.tls is not None:
                logger.info(
                    "serving TLS; certificate sha256 %s (pinned by callers from our record)", self.tls.fingerprint
                )
            self._endpoint = Endpoint(server, health_servicer, port, service)
            service.p2p_id, service.peer_id = self.sdht.p2p_id, self.sdht.peer_id
            p2p = await self.sdht.p2p()
            # the same handlers over libp2p, for callers reaching us there (p2p_only: swarm/protocol/p2p.py)
            await serve_over_p2p(
                p2p, service.forward, service.backward, service.info, service.progress, self.sdht.swarm_key
            )
            await ReachResponder(p2p, self.sdht.swarm_key).start()  # every server checks others' reachability
            self.p2p_only = cfg.network.transport == "p2p"
            if cfg.network.check_reachability:
                await self.check_reachability()
            service.transport = "p2p" if self.p2p_only else "grpc+tls" if self.tls else "grpc"
            if self.p2p_only:
                if self.behind_nat:  # libp2p finds that out too, and reserves a slot on a relay: wait for it
                    await self._wait_for_relay_slot()
                path, relayed_only = await self._libp2p_path()
                logger.info("over libp2p, callers reach us %s", path)
                if relayed_only:  # what a caller can send through each relay
                    self._relay_report = asyncio.create_task(report_relays(list(p2p_transport.RELAYS)))
        collab.address = self.record().address
        await collab.start()
        self.service.attach(worker, self.active.schema, collab)
        self.state = PeerState.SERVING
        await self.endpoint.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.announce()
        n_params = sum(p.numel() for p in worker.params)
        logger.info(
            "stage %d/%d on %s: %.2fM parameters, epoch %d (%s), %.1f samples/s capacity, serving at %s; "
            "compression: %s",
            stage,
            self.model_cfg.n_stages,
            worker.device,
            n_params / 1e6,
            worker.param_version,
            "joined peers" if joined else "own start",
            worker.throughput,
            self.record().address,
            collab.compression,
        )

    async def _launch(self, worker: StageWorker, stage: int) -> Collaboration:
        """The stage's collaboration, its averagers' processes started. One that does not come up in time (seen once
        in CI, after a move; its process then writes its stacks to our log: averaging.py) is shut down and built anew,
        LAUNCH_TRIES times in all, instead of stopping the peer."""
        cfg, tries = self.cfg, 1
        while True:
            collab: Collaboration = (
                SoloSteps(worker, cfg.epochs.samples_per_step)
                if cfg.epochs.solo
                else StageCollaboration(worker, self.sdht, stage, cfg.epochs, cfg.averaging, cfg.network)
            )
            try:
                await collab.launch()
                return collab
            except TimeoutError as e:
                await collab.stop()
                if tries == LAUNCH_TRIES:
                    raise
                tries += 1
                logger.warning("stage %d: %s; starting its averagers again (try %d)", stage, e, tries)

    async def leave(self, reason: str) -> None:
        """Stop serving the current stage without losing work: see the class docstring."""
        worker, collab, service, cfg = self.worker, self.collab, self.service, self.cfg
        service.pause(reason)
        await collab.stop_admitting()
        await self.endpoint.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + cfg.network.drain_timeout
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
            await asyncio.wait_for(self.sdht.withdraw(self.record(), cfg.network.record_ttl), 3)
        except Exception as e:
            logger.warning("could not withdraw the DHT record: %r", e)
        await collab.stop()
        await asyncio.to_thread(worker.shutdown)

    async def move(self, dst: int, why: str) -> None:
        src, started = self.stage, time.monotonic()
        logger.info("moving from stage %d to stage %d: %s", src, dst, why)
        # commit our capacity to dst at once: the next period's view must not count the stage we leave as short of a
        # peer while dst still looks starved, or a second peer would follow us there
        self.joined_at, self.state, self.destination = get_dht_time(), PeerState.MOVING, dst
        await self.announce(ready=False, stage=dst)  # kept fresh by `announce_forever` until we serve dst
        throughput = self.worker.throughput
        bound = self.cfg.migration_drain_s + self.cfg.network.drain_timeout + MOVE_GRACE_S
        watchdog = threading.Timer(
            bound,
            stacks.dump,
            (f"the move from stage {src} to stage {dst} still runs after {bound:.0f}s", asyncio.get_running_loop()),
        )
        watchdog.daemon = True
        watchdog.start()
        try:
            await self.leave(f"this peer is moving from stage {src} to stage {dst}")
            await self.enter(dst, throughput)
        finally:
            watchdog.cancel()
        self.moves += 1
        self.service.moves = self.moves
        logger.info(
            "moved from stage %d to stage %d in %.1fs (move %d of this peer)",
            src,
            dst,
            time.monotonic() - started,
            self.moves,
        )

    async def announce_forever(self, stop: asyncio.Event, rebalancing: bool) -> None:
        """Keep our DHT record fresh (while moving: the record that commits our capacity to the destination), and
        log the stage's state. With rebalancing, the rebalancer takes the load snapshots, once per period.

        One announce every period, whether the last ones have landed or not (up to MAX_ANNOUNCES_IN_FLIGHT): while a
        peer's DHT node is frozen a store waits for it, 6-9 s each in the kill/freeze soak, and one after the other
        they left gaps longer than the record's lifetime, in which trainers found healthy stages empty. Each store
        carries the expiration of its own start, and the DHT keeps the latest."""
        announcing = Overlapping(MAX_ANNOUNCES_IN_FLIGHT)
        try:
            while not await sleep_unless(stop, self.cfg.network.announce_period):
                moving = self.state is PeerState.MOVING
                if not moving and not rebalancing:
                    self.take_snapshot()
                # the record is read now, in this order: a later store never carries an older record
                record = self.record(False, self.destination) if moving else self.record()
                announcing.start(functools.partial(self._store, record))
                if not moving:
                    self._log_status()
        finally:
            await announcing.close()

    def _log_status(self) -> None:
        w = self.worker
        logger.info(
            "stage %d: epoch %d, %d samples, %.1f samples/s capacity, %.1f sent (last snapshot), "
            "queue %d, rejected %d, all-reduce %.2f MB (fp32 %.2f MB)",
            self.stage,
            w.epoch,
            w.samples_processed,
            w.throughput,
            self.load.demand,
            w.queue_length,
            self.service.requests_rejected,
            self.collab.allreduce_bytes / 1e6,
            self.collab.allreduce_fp32_bytes / 1e6,
        )

    async def checkpoint_forever(self, stop: asyncio.Event, directory: str) -> None:
        while not await sleep_unless(stop, self.cfg.checkpoint.checkpoint_period):
            if self.serving:
                await asyncio.to_thread(save_checkpoint, self.worker, directory, self.collab.lowrank)

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.cfg
        metrics = serve_metrics(cfg.metrics, functools.partial(fill_server_metrics, self), "server")
        try:
            await self._run(stop)
        finally:
            if metrics is not None:
                metrics.close()

    async def _run(self, stop: asyncio.Event) -> None:
        cfg = self.cfg
        stage = await self.rebalancer.choose_stage() if cfg.stage == "auto" else int(cfg.stage)
        await self.enter(stage)
        settle()  # server/heap.py
        rebalancing = cfg.rebalance and not cfg.epochs.solo
        loops = [
            asyncio.create_task(self.announce_forever(stop, rebalancing)),
            asyncio.create_task(trim_forever(lambda: self.service.budget.arrived, stop)),  # server/heap.py
        ]
        if rebalancing:
            loops.append(asyncio.create_task(self.rebalancer.run(stop)))
        if cfg.checkpoint.checkpoint_dir:
            loops.append(asyncio.create_task(self.checkpoint_forever(stop, cfg.checkpoint.checkpoint_dir)))
        stopped = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([stopped, *loops], return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopped}:
                task.result()  # a loop that ended on its own raised: say so, and stop the peer
        finally:
            for task in (stopped, *loops):
                task.cancel()
            await asyncio.gather(stopped, *loops, return_exceptions=True)
            await self.rebalancer.close()
            await self.shutdown()

    async def shutdown(self) -> None:
        cfg = self.cfg
        if self._endpoint is None or self.state is PeerState.STOPPED:
            return
        was_serving, self.state = self.serving, PeerState.STOPPED
        if self._relay_report is not None:
            self._relay_report.cancel()  # its throwaway daemons end with it
        logger.info("stage %d: shutting down, draining up to %.0fs", self.stage, cfg.network.drain_timeout)
        await self.collab.stop_admitting()
        await self.endpoint.health.enter_graceful_shutdown()
        try:
            await asyncio.wait_for(self.sdht.withdraw(self.record(), cfg.network.record_ttl), 3)
        except Exception as e:
            logger.warning("could not withdraw the DHT record: %r", e)
        await self.endpoint.server.stop(grace=cfg.network.drain_timeout)
        if (
            cfg.checkpoint.checkpoint_dir and was_serving
        ):  # not a stage we were still joining: its checkpoint would be wrong
            await asyncio.to_thread(save_checkpoint, self.worker, cfg.checkpoint.checkpoint_dir, self.collab.lowrank)
        await self.collab.stop()
        self.worker.shutdown()
        await self.sdht.close_p2p()
