"""The trainer's loop: microbatches forward through every stage, loss at the last, gradients back in reverse.

Each stage call goes to the peer the stage's IWRR router picks, with a deadline from how long such calls have been
taking (trainer/deadlines.py). A failed or timed-out call bans that peer (until it re-announces) and is retried on
another peer of the same stage; a stage with no live peer makes the microbatch wait,
with a message, until discovery finds one. Several microbatches are in flight at once.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import math
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TypeGuard

import grpc
import torch

from dht.node import SwarmDHT
from dht.records import ServerRecord
from swarm.config import ModelConfig
from swarm.metrics import serve_metrics
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.tensors import EncodedTensor, WireError, WireStats
from swarm.tasks import Overlapping
from swarm.vetting import Vetting, answers_as
from trainer.client import Admission, StageClient, StageReply
from trainer.config import TrainerConfig
from trainer.deadlines import CallDeadlines
from trainer.metrics import fill_trainer_metrics
from trainer.routing import StageRouter
from trainer.schedule import MicrobatchResult, train_microbatch

logger = logging.getLogger("swarm.trainer")
ADMISSION_RETRY_S = 0.05  # after every peer of stage 0 refused a Forward for lack of room in the global batch
BEHIND_RETRY_S = 0.5  # after every peer of a stage refused, one or more of them because it was catching up
MAX_LOOKUPS_IN_FLIGHT = 3  # per stage (_discover_forever): the oldest has waited 3 discovery periods
PROBE_S = 2.0  # a peer whose call timed out gets this long to answer Info: then it was busy (an all-reduce), not gone
LOSS_WINDOW = 20  # microbatches averaged in the reported (recent) loss
INITIAL_WINDOW = 5  # the first microbatches, all computed with (nearly) initial parameters


def _admission_refused(e: Exception) -> bool:
    """Stage 0's admission turned the Forward away: it belongs on another peer of stage 0 (server/collab/admission.py)."""
    return (
        isinstance(e, grpc.aio.AioRpcError)
        and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and (e.details() or "").startswith("admission:")
    )


def _behind(e: Exception) -> TypeGuard[grpc.aio.AioRpcError]:
    """The peer is copying its stage's state, or catching up on epochs it missed (server/collab/epoch.py `Behind`): it
    serves again within seconds."""
    return (
        isinstance(e, grpc.aio.AioRpcError)
        and e.code() == grpc.StatusCode.UNAVAILABLE
        and (e.details() or "").startswith("behind:")
    )


class MicrobatchLost(Exception):
    """A stage call failed on `max_retries` peers."""


class Stopping(Exception):
    """The trainer is stopping and a microbatch still waits for a stage that has no live peer: it is given up, not
    lost (it never reached a peer that could have counted it)."""


class Trainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        model_cfg: ModelConfig,
        sdht: SwarmDHT,
        data: Iterator[tuple[torch.Tensor, torch.Tensor]],
    ):
        self.cfg, self.model_cfg, self.sdht, self.data = cfg, model_cfg, sdht, data
        self.n_stages = model_cfg.n_stages
        self.routers = [StageRouter() for _ in range(self.n_stages)]
        self.vetting = [Vetting() for _ in range(self.n_stages)]  # which listed peers answered as themselves
        self._listed: list[dict[str, float]] = [{} for _ in range(self.n_stages)]  # peer id -> record expiration
        self.deadlines = CallDeadlines(cap=cfg.request_timeout, floor=cfg.min_request_timeout)
        self.records: list[dict[str, ServerRecord]] = [{} for _ in range(self.n_stages)]
        self.versions = [0] * self.n_stages
        self.stats = WireStats()
        max_tensor_bytes = cfg.batch_size * model_cfg.max_seq_len * max(model_cfg.d_model, model_cfg.vocab_size) * 4
        self.client = StageClient(
            cfg.policy(), self.stats, max_tensor_bytes, cfg.max_activation, cfg.backward_epilogue, p2p=sdht.p2p
        )
        self.peers_changed = asyncio.Event()
        self.stopping = asyncio.Event()  # `run`'s stop: once set, no new microbatch starts and those that wait for
        # a live peer give up
        self.steps = self.samples = self.lost = self.retries = 0
        self.losses: list[float] = []
        self.recent: deque[float] = deque(maxlen=LOSS_WINDOW)
        self.started = time.monotonic()
        self.last_snapshot: dict = {}  # `snapshot()`, taken every second: what the metrics thread reads
        self._ids = itertools.count()
        self._probing: set[tuple[int, str]] = set()  # (stage, peer id) whose liveness we are asking after a timeout
        self._probes: set[asyncio.Task] = set()
        self._loss_log = open(cfg.loss_log, "a") if cfg.loss_log else None  # noqa: SIM115 (closed in run)

    async def run(self, stop: asyncio.Event) -> dict:
        """Train until `stop`, `max_steps` or `duration`. Returns the final stats."""
        background = [asyncio.create_task(self._discover_forever()), asyncio.create_task(self._report_forever())]
        metrics = serve_metrics(self.cfg.metrics, functools.partial(fill_trainer_metrics, self), "trainer")
        self.stopping = stop
        try:
            workers = [asyncio.create_task(self._work()) for _ in range(self.cfg.in_flight)]
            stopper = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([stopper, *workers], return_when=asyncio.FIRST_COMPLETED)
            stop.set()
            self.peers_changed.set()  # wakes the microbatches that wait for a live peer: they give up (`_call`)
            await asyncio.gather(*workers, return_exceptions=True)
            stopper.cancel()
            for task in done - {stopper}:
                if (error := task.exception()) is not None:
                    raise error
        finally:
            for task in (*background, *self._probes):
                task.cancel()
            await asyncio.gather(*background, *self._probes, return_exceptions=True)
            await self.client.close()
            if metrics is not None:
                metrics.close()
            self._write_stats()
            if self._loss_log is not None:
                self._loss_log.close()
        return self.snapshot()

    def _done(self) -> bool:
        elapsed = time.monotonic() - self.started
        return self.stopping.is_set() or (0 < self.cfg.max_steps <= self.steps) or (0 < self.cfg.duration <= elapsed)

    async def _work(self) -> None:
        while not self._done():
            tokens, labels = next(self.data)
            index = next(self._ids)  # the position of this microbatch in the trainer's data stream
            mb_id = f"{self.sdht.peer_id[-8:]}-{index}"
            try:
                result = await self.train_microbatch(mb_id, tokens, labels)
            except MicrobatchLost as e:
                self.lost += 1
                logger.error("microbatch %s lost: %s", mb_id, e)
                continue
            except Stopping as e:
                logger.info("microbatch %s given up: %s", mb_id, e)
                break
            loss = result.loss
            assert loss is not None  # train_microbatch checks it
            self.steps += 1
            self.samples += tokens.shape[0]
            self.losses.append(loss)
            if self._loss_log is not None:
                elapsed = round(time.monotonic() - self.started, 3)
                global_batch = result.admission.global_batch if result.admission else None
                record = dict(step=self.steps, index=index, t=elapsed, batch=tokens.shape[0], loss=loss)
                self._loss_log.write(
                    json.dumps({**record, "versions": result.forward_versions, "global_batch": global_batch}) + "\n"
                )
                self._loss_log.flush()
            self.recent.append(loss)
        self.stopping.set()

    async def train_microbatch(self, mb_id: str, tokens: torch.Tensor, labels: torch.Tensor) -> MicrobatchResult:
        """One microbatch through the pipeline. A stage's Backward goes to the peer that served its Forward while that
        peer is routable: its recompute then runs at the parameters that made the outputs the gradient came from (the
        version the call names is that peer's). With local steps (--local-batch) the peers of a stage hold parameters
        of their own between outer rounds, and another peer's recompute would differ from the forward; synchronous
        peers hold the same ones, and the choice costs nothing. A peer that fails or left: any other, as routed."""
        forward_peers: dict[int, str] = {}

        async def call(stage, method, tensors, expect_shape, forward_version, admission):
            prefer = forward_peers.get(stage) if method == "Backward" else None
            reply, peer_id = await self._call(
                stage, method, mb_id, tensors, expect_shape, forward_version, admission, prefer
            )
            if method == "Forward":
                forward_peers[stage] = peer_id
            return reply

        result = await train_microbatch(call, self.n_stages, self.model_cfg.boundary_width, tokens, labels)
        if result.loss is None or not math.isfinite(result.loss):
            raise MicrobatchLost(f"last stage returned loss {result.loss}")
        return result

    async def _call(
        self,
        stage: int,
        method: str,
        mb_id: str,
        tensors: dict[str, torch.Tensor | EncodedTensor],
        expect_shape: tuple[int, ...] | None,
        forward_version: int | None = None,
        admission: Admission | None = None,
        prefer: str | None = None,
    ) -> tuple[StageReply, str]:
        """-> (the reply, the peer that served it). `prefer`: the peer to try first if it is routable."""
        router, tried, last_error, attempts = self.routers[stage], set[str](), None, 0
        # peers that turned the call away without failing: stage 0 peers whose share of the global batch was full,
        # and peers catching up with their stage
        refused: set[str] = set()
        behind = False
        give_up = time.monotonic() + self.cfg.request_timeout  # bounds how long refusals may go on
        n = next(iter(tensors.values())).shape[0]
        waiting = False
        while attempts < self.cfg.max_retries:
            peer_id = router.choose(n, exclude=tried, prefer=prefer)
            if peer_id is None and router.available:
                if refused:  # every peer's share is full, or the counts were on their way: ask again shortly
                    if time.monotonic() > give_up:
                        raise MicrobatchLost(f"stage {stage} refused {method} for {self.cfg.request_timeout:.0f}s")
                    await asyncio.sleep(BEHIND_RETRY_S if behind else ADMISSION_RETRY_S)
                    refused.clear()
                tried.clear()  # every live peer failed once: try them again (attempts still bound the total)
                continue
            if peer_id is None:  # waiting for a peer costs no attempt: the stage may be refilled
                if self.stopping.is_set():  # ... unless we are stopping: SIGTERM waited for a swarm that had gone
                    raise Stopping(f"the trainer is stopping and stage {stage} has no live peer")
                if not waiting:
                    waiting = True
                    logger.warning(
                        "stage %d has no live peer; microbatch %s waits for one to announce itself", stage, mb_id
                    )
                self.peers_changed.clear()
                try:
                    await asyncio.wait_for(self.peers_changed.wait(), self.cfg.discovery_period)
                except TimeoutError:
                    pass
                continue
            record = self.records[stage].get(peer_id)
            if record is None:  # cannot happen while discovery updates both together; never spin on it
                router.report_failure(peer_id)
                continue
            start = time.monotonic()
            try:
                reply = await self.client.call(
                    record.address,
                    method,
                    stage,
                    mb_id,
                    tensors,
                    expect_shape,
                    self.deadlines.deadline(stage, method),
                    forward_version,
                    admission=admission,
                )
            except (TimeoutError, grpc.aio.AioRpcError, WireError) as e:
                if stage == 0 and method == "Forward" and _admission_refused(e):
                    # stage 0's admission: this peer's share of the global batch is full and another peer's is not;
                    # not a failure of the peer: no ban, no attempt
                    refused.add(peer_id)
                    tried.add(peer_id)
                    continue
                if _behind(e):  # the stage's other peers first, then this one again: no ban, no attempt
                    logger.info("stage %d %s: %s", stage, method, e.details())
                    refused.add(peer_id)
                    tried.add(peer_id)
                    behind = True
                    continue
                timed_out = isinstance(e, asyncio.TimeoutError) or (
                    isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                )
                router.report_failure(peer_id, timed_out=timed_out)
                if timed_out:
                    self.deadlines.timed_out(stage, method)
                    self._probe(stage, peer_id, record.address)
                tried.add(peer_id)
                attempts += 1
                self.retries += 1
                last_error = e
                detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else repr(e)
                logger.warning(
                    "stage %d %s on %s failed (%s); retrying on another peer", stage, method, record.address, detail
                )
                await asyncio.sleep(min(0.05 * 2**attempts, 2.0))
                continue
            router.report_success(peer_id, n, time.monotonic() - start)
            self.deadlines.succeeded(stage, method, time.monotonic() - start)
            self.versions[stage] = max(self.versions[stage], reply.param_version)
            return reply, peer_id
        raise MicrobatchLost(f"stage {stage} {method} failed {attempts} times; last error: {last_error!r}")

    def _route(self, stage: int) -> None:
        """Route to the listed peers of `stage` that answered as themselves (vetting.py)."""
        vetting = self.vetting[stage]
        self.routers[stage].update_peers({p: e for p, e in self._listed[stage].items() if vetting.vetted(p)})
        self.peers_changed.set()

    async def _vet(self, stage: int, peer_id: str, address: str) -> None:
        """Whether the server at `address` names `peer_id` and `stage` in its Info; routes to it if it does."""
        ok = await answers_as(self.client.channels, address, peer_id, stage, PROBE_S)
        self.vetting[stage].answered(peer_id, address, ok)
        if ok:
            self._route(stage)

    def _background(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._probes.add(task)  # asyncio keeps only weak references to tasks
        task.add_done_callback(self._probes.discard)

    def _probe(self, stage: int, peer_id: str, address: str) -> None:
        """A call to `peer_id` timed out and banned it; if it answers Info within PROBE_S it was busy (its compute
        thread held by a round with a peer that froze, say), not frozen itself: lift the ban (StageRouter.forgive)
        instead of leaving its stage short of a peer until it re-announces, seconds later."""
        if (stage, peer_id) in self._probing:
            return
        self._probing.add((stage, peer_id))

        async def probe() -> None:
            try:
                await self.client.channels.stub(address).info(pb.InfoRequest(), timeout=PROBE_S)
            except Exception:  # frozen, gone, or garbage: the ban stands
                return
            finally:
                self._probing.discard((stage, peer_id))
            if self.routers[stage].forgive(peer_id):
                logger.info("stage %d: %s answers after its call timed out: busy, not gone; unbanned", stage, address)
                self.peers_changed.set()

        self._background(probe())

    async def _discover_forever(self) -> None:
        """Every period, a lookup of each stage, whether the last ones have come back or not (up to
        MAX_LOOKUPS_IN_FLIGHT per stage); a result is applied unless a later lookup's came first. All stages at once,
        and not one after the other: a DHT node that stopped answering (a frozen peer's) makes each lookup wait for
        it, 6-9 s in the kill/freeze soak, and waits that added up left healthy stages' records expired in our view."""
        launched, applied = [0] * self.n_stages, [0] * self.n_stages
        lookups = [Overlapping(MAX_LOOKUPS_IN_FLIGHT) for _ in range(self.n_stages)]

        async def discover(stage: int, seq: int) -> None:
            try:
                entries = await self.sdht.lookup(stage)
            except Exception as e:
                logger.warning("discovery of stage %d failed: %r", stage, e)
                return
            # None: nothing came back; keep the peers we know until their records expire
            if entries is None or seq < applied[stage]:
                return
            applied[stage] = seq
            self.records[stage] = {e.peer_id: e.record for e in entries}
            self._listed[stage] = {e.peer_id: e.expiration for e in entries}
            self._route(stage)
            for peer_id in self.vetting[stage].listed({p: r.address for p, r in self.records[stage].items()}):
                self._background(self._vet(stage, peer_id, self.records[stage][peer_id].address))

        try:
            while True:
                for stage in range(self.n_stages):
                    if lookups[stage].start(functools.partial(discover, stage, launched[stage] + 1)):
                        launched[stage] += 1
                await asyncio.sleep(self.cfg.discovery_period)
        finally:
            await asyncio.gather(*(lookup.close() for lookup in lookups))

    async def _report_forever(self) -> None:
        last_log = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            self.last_snapshot = self.snapshot()
            self._write_stats()
            if time.monotonic() - last_log >= self.cfg.log_period:
                last_log = time.monotonic()
                s = self.last_snapshot
                logger.info(
                    "step %d | loss %.3f | %.1f samples/s | peers %s | versions %s | wire %.1f MB (%.2fx less "
                    "than fp32) | all-reduce %s MB (%.1fx less) | lost %d",
                    s["steps"],
                    s["recent_loss"] or float("nan"),
                    s["samples_per_second"],
                    "/".join(map(str, s["peers_per_stage"])),
                    "/".join(map(str, self.versions)),
                    s["wire_bytes"] / 1e6,
                    s["fp32_bytes"] / max(s["wire_bytes"], 1),
                    "/".join(f"{b / 1e6:.1f}" for b, _ in s["allreduce_bytes_per_stage"]),
                    sum(f for _, f in s["allreduce_bytes_per_stage"])
                    / max(sum(b for b, _ in s["allreduce_bytes_per_stage"]), 1),
                    s["lost_microbatches"],
                )

    def snapshot(self) -> dict:
        elapsed = time.monotonic() - self.started
        wire = self.stats.as_dict()
        head = self.losses[:INITIAL_WINDOW]
        return {
            "steps": self.steps,
            "samples": self.samples,
            "elapsed_s": elapsed,
            "samples_per_second": self.samples / elapsed if elapsed > 0 else 0.0,
            "initial_loss": sum(head) / len(head) if head else None,
            "recent_loss": sum(self.recent) / len(self.recent) if self.recent else None,
            "lost_microbatches": self.lost,
            "retries": self.retries,
            "peers_per_stage": [len(r.available) for r in self.routers],
            "banned_per_stage": [sum(p["banned"] for p in r.snapshot().values()) for r in self.routers],
            "call_deadlines_s": [
                {m: round(self.deadlines.deadline(s, m), 2) for m in ("Forward", "Backward")}
                for s in range(self.n_stages)
            ],
            "param_versions": list(self.versions),
            # (sent, fp32 equivalent) of each stage's all-reduces so far, summed over the peers its records list
            "allreduce_bytes_per_stage": [
                (
                    sum(r.allreduce_bytes for r in self.records[stage].values()),
                    sum(r.allreduce_fp32_bytes for r in self.records[stage].values()),
                )
                for stage in range(self.n_stages)
            ],
            **wire,
        }

    def _write_stats(self) -> None:
        if self.cfg.stats_file:
            path = Path(self.cfg.stats_file)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.snapshot()))
            tmp.replace(path)
