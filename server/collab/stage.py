"""Training semantics of a stage: when to step, with whom to average, and how a joiner catches up.

The peers of a stage accumulate gradients until *together* they have processed the global batch
(`--samples-per-step`), average them with compressed all-reduce (hivemind's DecentralizedAverager), and step together,
so the swarm trains one model per stage rather than one per peer. Progress is exact rather than estimated: after each
backward, before its reply, a peer sends its sample count to every peer of its stage (the `Progress` RPC; the DHT
tells who they are), so a trainer that waits for its replies sees epochs end exactly at the global batch. The peer
whose count completes the batch tells the others to join the all-reduce; peers that received nothing this epoch take
part with weight 0.

Synchronous mode averages and steps on the compute thread: requests queue (the event loop, Info and health stay live)
for the few hundred milliseconds of an all-reduce. `--delay-optimizer-step` instead averages in the background while
the stage keeps computing with the previous parameters (delayed parameter updates), and applies the step when ready.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionBase,
    Float16Compression,
    NoCompression,
    deserialize_tensor_stream,
)
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout

from dht.node import SwarmDHT
from server.config import ServerConfig
from server.worker import StageWorker, state_digest
from swarm.compression import get_codec
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import PROTOCOL_VERSION, StageStub, aio_channel

logger = logging.getLogger(__name__)

ALLREDUCE_COMPRESSION: dict[str, CompressionBase] = {
    "none": NoCompression(),
    "fp16": Float16Compression(),
    "blockwise8": BlockwiseQuantization(),
}
BYTES_PER_VALUE = {"none": 4.0, "fp16": 2.0, "blockwise8": 1.0 + 4 / 4096}


class LocalSteps:
    """No peers to average with (tests, a one-peer stage without a DHT): step once this peer has the global batch."""

    def __init__(self, worker: StageWorker, target: int):
        self.worker, self.target = worker, target
        self.allreduce_bytes = 0

    @property
    def epoch(self) -> int:
        return self.worker.param_version

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.worker.param_version = value

    async def launch(self) -> None:
        pass

    async def join(self) -> bool:
        return False

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def finish_epoch(self, timeout: float) -> int:
        return self.worker.samples_accumulated

    async def after_backward(self) -> None:
        if self.worker.samples_accumulated >= self.target:
            await self.worker.submit(self._step)

    def _step(self) -> None:
        grads, _ = self.worker.take_gradients()
        self.worker.apply_gradients(grads)


class StageAverager(DecentralizedAverager):
    """Averages a stage's gradients; serves the stage's parameters and optimizer state to peers that join."""

    def __init__(self, worker: StageWorker, epoch_fn, **kwargs):
        self._worker, self._epoch_fn = worker, epoch_fn  # before super().__init__: the state thread may ask at once
        super().__init__(averaged_tensors=[torch.zeros_like(p, device="cpu") for p in worker.params], **kwargs)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        """hivemind counts a round in which some reducers timed out as a success ("received 57% results"): the parts
        they held stay local, and peers silently disagree. So is a round in which we excluded a sender that timed out
        from the part we reduced. Make such a round fail, so that the caller retries it."""
        await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        runner = self._running_groups[group_info.group_id if group_id is None else group_id].result()
        if runner.tensor_part_container.failed_size:
            raise AllreduceException(f"{runner.tensor_part_container.failed_size} values were not averaged")
        if runner.banned_senders:  # their values are missing from the parts we reduced: other peers got them
            raise AllreduceException(f"{len(runner.banned_senders)} peers' values were left out of our part")

    def download_state(self, peer_id: str, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """Any thread. The state of one named peer of the stage, or None if it did not send one (it is not sharing,
        or it is gone). Unlike `load_state_from_peers`, which downloads from whichever peer the DHT lists as sharing
        with the highest priority: after a failed round only the peer that stepped has the right state, and the DHT
        record can lag behind (seen in CI: a peer found no sharing peer for 30 s while its reference was live)."""
        future = MPFuture()
        self._outer_pipe.send(("_download_state_from", [], dict(peer_id=peer_id, timeout=timeout, future=future)))
        try:
            return future.result(timeout=2 * timeout)
        except TimeoutError:  # the peer, or our averager process, hung: seen in CI after a hivemind step hung
            logger.warning("%s sent no state within %.0fs", peer_id[-6:], 2 * timeout)
            return None

    async def _download_state_from(self, peer_id: str, timeout: float, future: MPFuture) -> None:
        """The averager's process: hivemind's state download RPC, addressed to one peer."""
        metadata = None

        async def parts(stream):
            nonlocal metadata
            async for message in aiter_with_timeout(stream, timeout=timeout):
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                yield [message.tensor_part]

        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
            tensors = await deserialize_tensor_stream(
                parts(await stub.rpc_download_state(averaging_pb2.DownloadRequest()))
            )
            future.set_result((metadata, tensors) if metadata else None)
        except Exception as e:
            logger.warning("downloading the state of %s failed: %r", peer_id[-6:], e)
            if not future.done():
                future.set_result(None)

    def get_current_state(self):
        meta, tensors = self._worker.state_tensors()
        logger.info("sending state of epoch %d to a joining peer (digest %s)", self._epoch_fn(), state_digest(tensors))
        return {**meta, "epoch": self._epoch_fn()}, tensors, None


class StageCollaboration:
    """Build anywhere, then on the main thread `await launch()` (hivemind's averagers are forked processes), then
    `await join()` and `await start()` before serving; `await stop()` when done with the stage."""

    def __init__(self, worker: StageWorker, sdht: SwarmDHT, stage: int, cfg: ServerConfig):
        self.worker, self.sdht, self.stage, self.cfg = worker, sdht, stage, cfg
        self.epoch = 0  # global batches this peer has finished accumulating
        self.averager = StageAverager(
            worker,
            lambda: self.epoch,
            dht=sdht.dht,
            prefix=f"{sdht.swarm_name}_stage{stage}",
            start=False,
            # hivemind: a request_timeout above min_matchmaking_time can deadlock two peers that both lead
            min_matchmaking_time=cfg.matchmaking_time,
            request_timeout=cfg.matchmaking_time / 2,
            allreduce_timeout=cfg.averaging_timeout,
            next_chunk_timeout=cfg.averaging_timeout,
            compression=ALLREDUCE_COMPRESSION[cfg.allreduce_codec],
            state_compression=NoCompression(),
            declare_state_period=5.0,
            allow_state_sharing=True,
        )
        # hivemind's all-reduce hands each peer local + (average - local): equal up to rounding, which Adam can amplify
        # where the averaged gradient is near zero. Averaging the parameters every few epochs pulls peers back together.
        self.param_averager = DecentralizedAverager(
            [p.detach().cpu().clone() for p in worker.params],
            dht=sdht.dht,
            prefix=f"{sdht.swarm_name}_stage{stage}_params",
            start=False,
            min_matchmaking_time=cfg.matchmaking_time,
            request_timeout=cfg.matchmaking_time / 2,
            allreduce_timeout=cfg.averaging_timeout,
            next_chunk_timeout=cfg.averaging_timeout,
            compression=NoCompression(),
            allow_state_sharing=False,
        )
        self.allreduce_bytes = 0  # estimated: what a butterfly all-reduce of our gradients sends and receives
        self.address = ""  # our own host:port, set by the server once gRPC is bound
        self.peers: dict[str, str] = {}  # the stage's other live peers: peer id -> gRPC address
        self.view: dict[str, tuple[int, int]] = {}  # their latest progress: peer id -> (epoch, samples)
        self._busy = False
        self._stopped = False
        self._needs_resync = False
        self._counts: dict[int, dict[str, int]] = {}  # epoch -> peer id -> samples it reported for that epoch
        self._missed_once: set[str] = set()  # known peers the last DHT read did not list
        self._kick = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._averaging_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="allreduce")
        self._poller: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop's, for the compute thread

    # --- lifecycle -------------------------------------------------------------------------------------------------

    async def launch(self, timeout: float = 60.0) -> None:
        """Main thread (the event loop's): fork the averagers' processes, then wait for them off the loop.

        hivemind's `run_in_background` sets SIGINT to "ignore" in the calling process for good; put our handler back,
        or Ctrl+C would stop working after a peer's first stage.

        bitsandbytes is imported lazily, and importing it takes seconds on a loaded machine: initialise it here first,
        so that the averagers inherit it instead of each paying for it inside their first all-reduce, which then
        overruns --averaging-timeout (measured: the first round failed on every stage of a 3x2 local swarm)."""
        if self.cfg.allreduce_codec == "blockwise8":
            await asyncio.to_thread(get_codec("blockwise8").encode, torch.zeros(4096))
        for averager in (self.averager, self.param_averager):
            handler = signal.getsignal(signal.SIGINT)
            try:
                averager.run_in_background(await_ready=False)
            finally:
                signal.signal(signal.SIGINT, handler)
        for averager in (self.averager, self.param_averager):
            await asyncio.to_thread(averager.wait_until_ready, timeout)

    async def join(self) -> bool:
        """Download parameters, optimizer state and epoch from live peers of the stage. False when there are none or
        none answered: a new stage, whose first peers all start from the shared seed (or a checkpoint)."""
        await self._refresh_peers()
        if not self.peers:
            return False
        logger.info("stage %d has %d live peers: downloading their state", self.stage, len(self.peers))
        if await self._download_state():
            return True
        # hivemind chose no source: the DHT record of who shares state can lag behind (see `download_state`)
        for peer_id in sorted(self.peers):
            logger.info("stage %d: asking %s for its state by name", self.stage, peer_id[-6:])
            if await self._download_state(peer_id, attempts=1):
                return True
        logger.warning("stage %d: no peer sent its state", self.stage)
        return False

    async def start(self) -> None:
        """Start watching the stage. Call after `join` (and any checkpoint load)."""
        self.averager.state_sharing_priority = self.worker.param_version
        self._loop = asyncio.get_running_loop()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        self._stopped = True
        pending = [t for t in (self._poller, *self._tasks) if t is not None]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()
        self._averaging_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.gather(
            *(asyncio.to_thread(a.shutdown) for a in (self.averager, self.param_averager) if a.is_alive())
        )

    async def finish_epoch(self, timeout: float) -> int:
        """Before leaving the stage (no new work arrives): wait until our gradients went into an all-reduce, i.e. the
        stage's current epoch ended. Returns the samples whose gradients are dropped because it did not end in time."""
        deadline = time.monotonic() + timeout
        while (self.worker.samples_accumulated > 0 or self._busy) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self.worker.samples_accumulated

    # --- the epoch protocol ----------------------------------------------------------------------------------------

    async def after_backward(self) -> None:
        """Event loop, after every backward and before its reply: tell the stage, end the epoch if it is full."""
        await self._broadcast(end_epoch=False)
        await self._maybe_end_epoch()

    def on_progress(self, msg: pb.StageProgress) -> pb.ProgressAck:
        """A stage peer's count (validated by the service). Never blocks: the poller acts on it."""
        self.view[msg.peer_id] = (int(msg.epoch), int(msg.samples))
        counts = self._counts.setdefault(int(msg.epoch), {})
        counts[msg.peer_id] = max(counts.get(msg.peer_id, 0), int(msg.samples))
        if msg.address:
            self.peers[msg.peer_id] = msg.address  # a peer that joined since our last DHT lookup
        logger.debug(
            "progress from %s: epoch %d, %d samples%s (we are at %d, busy=%s)",
            msg.peer_id[-6:],
            msg.epoch,
            msg.samples,
            ", end of epoch" if msg.end_epoch else "",
            self.epoch,
            self._busy,
        )
        if msg.end_epoch and msg.epoch == self.epoch and not self._busy and not self._stopped:
            task = asyncio.get_running_loop().create_task(self._end_epoch_once(int(msg.epoch)))
            self._tasks.add(task)  # asyncio keeps only weak references to tasks
            task.add_done_callback(self._tasks.discard)
        self._kick.set()
        return pb.ProgressAck(epoch=self.epoch)

    async def _broadcast(self, end_epoch: bool) -> None:
        msg = pb.StageProgress(
            protocol_version=PROTOCOL_VERSION,
            stage=self.stage,
            peer_id=self.sdht.peer_id,
            epoch=self.epoch,
            samples=self.worker.samples_accumulated,
            end_epoch=end_epoch,
            address=self.address,
        )
        await asyncio.gather(*(self._send(peer_id, address, msg) for peer_id, address in list(self.peers.items())))

    async def _send(self, peer_id: str, address: str, msg: pb.StageProgress) -> None:
        if address not in self._channels:
            self._channels[address] = aio_channel(address)
        try:
            await StageStub(self._channels[address]).progress(msg, timeout=self.cfg.peer_timeout)
        except grpc.aio.AioRpcError as e:  # a dead peer: forget it until the DHT lists it again
            logger.info("stage peer %s unreachable (%s); dropping it from the group", address, e.code().name)
            self.peers.pop(peer_id, None)
            self.view.pop(peer_id, None)
            channel = self._channels.pop(address, None)
            if channel is not None:
                await channel.close()

    async def _refresh_peers(self) -> None:
        """The stage's peers as the DHT lists them. A peer we know that one read misses stays until a second read
        misses it too: under load a record can be briefly absent, and forgetting a live peer (and the samples it
        reported) stalls the stage until that peer next reports, which it does only after the epoch it waits for."""
        entries = await self.sdht.discover(self.stage)
        listed = {e.peer_id: e.record.address for e in entries if e.peer_id != self.sdht.peer_id}
        missed = {p: a for p, a in self.peers.items() if p not in listed and p not in self._missed_once}
        self._missed_once = set(missed)
        self.peers = {**missed, **listed}
        self.view = {p: v for p, v in self.view.items() if p in self.peers}

    async def _poll_forever(self) -> None:
        last_refresh = 0.0
        while True:
            try:
                await asyncio.wait_for(self._kick.wait(), self.cfg.progress_period)
            except TimeoutError:
                pass
            self._kick.clear()
            try:
                if time.monotonic() - last_refresh > self.cfg.announce_period:
                    last_refresh = time.monotonic()
                    await self._refresh_peers()
                    await self._broadcast(end_epoch=False)  # so joiners and restarted peers learn our count
                await self._maybe_end_epoch()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning("progress check failed: %r", e)

    async def _maybe_end_epoch(self) -> None:
        if self._busy:
            return
        mine = self.epoch
        ahead = max((e for e, _ in self.view.values()), default=mine)
        if ahead >= mine + 2 or self._needs_resync:
            await self._catch_up()
        elif ahead == mine + 1:  # peers just finished this epoch: join their all-reduce (or step alone, then resync)
            await self._end_epoch_once(mine)
        elif (
            self.worker.samples_accumulated + sum(s for e, s in self.view.values() if e == mine)
            >= self.cfg.samples_per_step
        ):
            await self._broadcast(end_epoch=True)
            await self._end_epoch_once(mine)

    async def _end_epoch_once(self, epoch: int) -> None:
        if self._busy or epoch != self.epoch:
            return
        logger.debug("ending epoch %d", epoch)
        self._busy = True
        for old in [e for e in self._counts if e < epoch]:
            del self._counts[old]
        n_peers = 1 + len(set(self.peers) | {p for p, (e, _) in self.view.items() if e == epoch})
        try:
            if not self.cfg.delay_optimizer_step:
                await self.worker.submit(lambda: self._average_and_step(n_peers))
            else:
                grads, n = await self.worker.submit(self.worker.take_gradients)
                self.epoch = epoch + 1
                loop = asyncio.get_running_loop()
                # epoch None: peers report the next epoch while this one is still being averaged in the background
                averaged = await loop.run_in_executor(self._averaging_pool, self._average, grads, n, n_peers, None)
                if averaged is None:
                    averaged, self._needs_resync = grads, True
                await self.worker.submit(lambda: self.worker.apply_gradients(averaged))
        finally:
            self._busy = False
        self.averager.state_sharing_priority = self.worker.param_version
        await self._broadcast(end_epoch=False)

    def _average_and_step(self, n_peers: int) -> None:
        """Compute thread (synchronous mode). Requests queue behind this, so none sees a half-finished epoch."""
        epoch = self.epoch
        grads, n = self.worker.take_gradients()
        if n == 0 and n_peers <= 1:  # our peers are gone (a count we were told died with them): nothing to step on
            return
        averaged = self._average(grads, n, n_peers, epoch)
        if averaged is None:
            averaged = self._after_failed_round(grads, n)
        if averaged is not None:
            self.worker.apply_gradients(averaged)
            self.epoch += 1
        if self.epoch == epoch:
            return
        if n_peers > 1 and self.cfg.param_average_every > 0 and self.epoch % self.cfg.param_average_every == 0:
            # tell the stage first: a peer copying our state after a failed round waits for our new epoch
            asyncio.run_coroutine_threadsafe(self._broadcast(end_epoch=False), self._loop)
            self._average_parameters()

    def _average_parameters(self) -> None:
        """Compute thread. Plain mean of the peers' parameters (weight 1 each); kept local if nobody answers."""
        with self.param_averager.get_tensors() as buffers:
            for buf, p in zip(buffers, self.worker.params, strict=False):
                buf.copy_(p.detach())
        control = self.param_averager.step(
            scheduled_time=get_dht_time() + self.cfg.matchmaking_time,
            timeout=self.cfg.averaging_timeout,
            allow_retries=True,
            wait=False,
        )
        try:
            result = control.result(timeout=2 * self.cfg.averaging_timeout)
        except Exception as e:
            control.cancel()
            logger.warning("parameter averaging raised %r", e)
            return
        if result is None:
            return
        group = len(result)  # estimated like the gradients' bytes: fp32, butterfly all-reduce over the actual group
        self.allreduce_bytes += int(2 * sum(p.numel() for p in self.worker.params) * 4 * (group - 1) / group)
        with self.worker.state_lock, torch.no_grad(), self.param_averager.get_tensors() as buffers:
            for buf, p in zip(buffers, self.worker.params, strict=False):
                p.copy_(buf)

    def _peers_ahead(self, epoch: int) -> list[str]:
        """Stage peers that have finished `epoch`, by peer id (any thread: copies the view the event loop updates)."""
        return sorted(p for p, (e, _) in dict(self.view).items() if e > epoch)

    def _all_peers_ahead(self, epoch: int | None) -> bool:
        """None: not known (delayed steps), so never."""
        return epoch is not None and set(self.peers) <= set(self._peers_ahead(epoch))

    def _average(
        self, grads: list[torch.Tensor], n_samples: int, n_peers: int, epoch: int | None
    ) -> list[torch.Tensor] | None:
        """Weighted all-reduce of mean gradients (weight: samples behind them). None if the round failed, or if every
        peer has already finished the epoch (a round that ended for them and not for us: nobody is left to retry with).
        """
        if n_peers <= 1:
            return grads
        started = time.monotonic()
        result = None
        while (
            result is None
            and time.monotonic() - started < self.cfg.averaging_timeout
            and not self._all_peers_ahead(epoch)
        ):
            with self.averager.get_tensors() as buffers:  # every attempt starts from our own gradients
                for buf, g in zip(buffers, grads, strict=True):
                    buf.copy_(g)
            control = self.averager.step(
                weight=float(n_samples),
                scheduled_time=get_dht_time() + self.cfg.matchmaking_time,
                timeout=self.cfg.averaging_timeout,
                allow_retries=False,
                wait=False,
            )
            try:  # the step's own timeout covers matchmaking only: bound the round, or a stuck peer stalls the stage
                result = control.result(timeout=2 * self.cfg.averaging_timeout)
            except Exception as e:
                control.cancel()
                logger.warning("all-reduce attempt failed: %r", e)
                # A round can end for our peers and fail for us. Their report of the next epoch arrives within a
                # round trip; a retry without them would wait the whole --averaging-timeout for a group (measured).
                # Do not start one and cancel it instead: hivemind may still run a cancelled step with a later group.
                grace = time.monotonic() + (self.cfg.matchmaking_time / 2 if epoch is not None else 0.0)
                while time.monotonic() < grace and not self._all_peers_ahead(epoch):
                    time.sleep(0.01)
        if result is None:
            logger.warning("stage %d epoch %d: all-reduce with %d peers failed", self.stage, self.epoch, n_peers)
            return None
        group = len(result)
        numel = sum(g.numel() for g in grads)
        self.allreduce_bytes += int(2 * numel * BYTES_PER_VALUE[self.cfg.allreduce_codec] * (group - 1) / group)
        logger.info(
            "stage %d epoch %d: averaged %d samples with %d peers in %.2fs",
            self.stage,
            self.epoch,
            n_samples,
            group,
            time.monotonic() - started,
        )
        with self.averager.get_tensors() as buffers:
            return [b.clone() for b in buffers]

    def _after_failed_round(self, grads: list[torch.Tensor], n_samples: int) -> list[torch.Tensor] | None:
        """Compute thread, after a failed round of `self.epoch`, before any request sees our parameters. Returns the
        gradients to step alone on, or None: we copied a peer's state (the epoch moved on) or the epoch stays open.

        One peer steps alone and the others copy it, so the stage stays one model. The reference is a peer that has
        finished the epoch (smallest peer id), else the live peer with the most samples behind its gradients (ties:
        the smallest peer id); every peer names the same one, because peers report their counts before they reply
        to a trainer, hence before the epoch can end. The reference steps alone on its own gradients; the others
        wait for it to step and copy its state; if it does not step in time we do not step at all: the epoch stays open, our
        gradients stay accumulated, and the next round, or a peer that finishes the epoch, closes it."""
        epoch, me = self.epoch, self.sdht.peer_id
        live = set(self.peers)  # a copy: the event loop's thread updates it
        counts = {p: n for p, n in dict(self._counts.get(epoch, {})).items() if p in live}
        counts[me] = n_samples
        ahead = self._peers_ahead(epoch)
        reference = ahead[0] if ahead else min(counts, key=lambda p: (-counts[p], p))
        if reference == me:
            logger.warning(
                "stage %d epoch %d: stepping alone with %d samples; the stage's peers will copy our state",
                self.stage,
                epoch,
                n_samples,
            )
            return grads
        logger.warning(
            "stage %d epoch %d: copying the state of %s (%s) once it has stepped",
            self.stage,
            epoch,
            reference[-6:],
            "finished the epoch" if ahead else f"{counts[reference]} samples",
        )
        self.averager.allow_state_sharing = False  # a peer that needs a state must not take our stale one
        try:
            deadline = time.monotonic() + 2 * self.cfg.averaging_timeout  # its round may have begun after ours
            while time.monotonic() < deadline:
                if self.view.get(reference, (epoch, 0))[0] <= epoch:
                    time.sleep(0.02)
                    continue
                loaded = self.averager.download_state(reference, timeout=self.cfg.averaging_timeout)
                if loaded is not None and int(loaded[0].get("epoch", -1)) > epoch:
                    self._load(*loaded)
                    return None
                time.sleep(0.2)  # it reported the next epoch but sent no state (yet): ask again
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # a state we could not load
            logger.warning("copying the state of the stage's reference peer failed: %r", e)
        finally:
            self.averager.allow_state_sharing = True
        logger.warning(
            "stage %d epoch %d: no state to copy; the epoch stays open, keeping our %d samples",
            self.stage,
            epoch,
            n_samples,
        )
        self.worker.return_gradients(grads, n_samples)
        return None

    async def _catch_up(self) -> None:
        """We missed an epoch, or stepped alone: take the state of the peer furthest ahead of (or beside) us."""
        others = {p: e for p, (e, _) in self.view.items()}
        ahead = max([self.epoch, *others.values()])
        source = min((p for p, e in others.items() if e == ahead), default=None) if ahead > self.epoch else None
        if self._needs_resync and source is None:
            if any(e < self.epoch for e in others.values()):
                return  # a peer is still finishing this epoch (it may step alone too): decide once it has
            # several peers stepped alone at the same epoch: the smallest peer id is the reference, the others copy it
            same = sorted(p for p, e in others.items() if e == self.epoch)
            if not same or self.sdht.peer_id < same[0]:
                self._needs_resync = False
                return
            source = same[0]
        logger.info(
            "stage %d: behind (epoch %d, swarm at %d) or diverged: downloading the state of %s",
            self.stage,
            self.epoch,
            ahead,
            source[-6:],
        )
        self._busy = True
        try:
            if await self._download_state(source):
                self._needs_resync = False
        finally:
            self._busy = False

    async def _download_state(self, source: str | None = None, attempts: int = 3) -> bool:
        """From `source` (a peer id), else from whichever peer the DHT lists as sharing its state."""
        loop = asyncio.get_running_loop()
        if source is not None:
            download = functools.partial(self.averager.download_state, source, self.cfg.averaging_timeout)
        else:
            download = functools.partial(self.averager.load_state_from_peers, timeout=self.cfg.averaging_timeout)
        for attempt in range(attempts):
            try:
                loaded = await loop.run_in_executor(self._averaging_pool, download)
            except TimeoutError:  # hivemind's load_state_from_peers raises it where download_state returns None
                loaded = None
            if loaded is not None:
                meta, tensors = loaded
                try:
                    await self.worker.submit(functools.partial(self._load, meta, tensors))
                    return True
                except (ValueError, KeyError, TypeError) as e:
                    logger.warning("downloaded state is unusable: %r", e)
            if attempt + 1 < attempts:
                await asyncio.sleep(1.0 + attempt)
        return False

    def _load(self, meta: dict, tensors: list[torch.Tensor]) -> None:
        """Compute thread: replaces parameters, optimizer state and epoch; drops gradients of the old epoch."""
        self.worker.take_gradients()
        self.worker.load_state(meta, tensors)
        self.epoch = int(meta.get("epoch", meta["param_version"]))
        logger.info("stage %d: loaded state at epoch %d (digest %s)", self.stage, self.epoch, state_digest(tensors))
