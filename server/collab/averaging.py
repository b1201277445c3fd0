"""Averaging within a stage, on hivemind's DecentralizedAverager: the gradient all-reduce that every epoch ends with,
the periodic plain mean of parameters, and state sharing with joining peers.

`build_averaging` is the one place that decides how a stage averages (the seam where other schemes, e.g. low-rank
averaging with error feedback, plug in): it returns the `Averaging` bundle the epoch protocol drives. Every method
that blocks is called on the stage's compute thread or the collaboration's averaging pool, never on the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import BlockwiseQuantization, CompressionBase, Float16Compression, NoCompression
from hivemind.utils import get_dht_time

from dht.node import SwarmDHT
from server.collab.hivemind_compat import StrictAverager, start_in_background
from server.config import AveragingConfig
from server.worker import StageWorker, state_digest
from swarm.compression import Codec, CompressionPolicy, TensorRole
from swarm.protocol.rpc import PROTOCOL_VERSION

logger = logging.getLogger(__name__)


def hivemind_compression(codec: Codec) -> CompressionBase:
    """hivemind's implementation of one of our codecs, for its all-reduce (which serializes tensors itself)."""
    return {"none": NoCompression, "fp16": Float16Compression, "blockwise8": BlockwiseQuantization}[codec.name]()


def butterfly_bytes(codec: Codec, numel: int, dtype: torch.dtype, group: int) -> int:
    """Bytes one peer sends and receives in a butterfly all-reduce of `numel` values over `group` peers: it sends
    (group-1)/group of its tensor to the other reducers and gets as much back."""
    return int(2 * codec.encoded_bytes(numel, dtype) * (group - 1) / group)


class StageAverager(StrictAverager):
    """Averages a stage's gradients; serves the stage's parameters, optimizer state and epoch to peers that join."""

    def __init__(self, worker: StageWorker, **kwargs):
        self._worker = worker  # before super().__init__: the state thread may ask at once
        super().__init__(averaged_tensors=[torch.zeros_like(p, device="cpu") for p in worker.params], **kwargs)

    def get_current_state(self):
        meta, tensors = self._worker.state_tensors()
        logger.info("sending state of epoch %d to a joining peer (digest %s)", meta["epoch"], state_digest(tensors))
        return meta, tensors, None


class GradientAveraging:
    """A weighted all-reduce of one epoch's mean gradients (weight: samples behind them), retried within
    --averaging-timeout. Compute thread or averaging pool."""

    def __init__(self, averager: StageAverager, cfg: AveragingConfig, codec: Codec):
        self.averager, self.cfg, self.codec = averager, cfg, codec
        self.bytes = 0  # what this peer sent and received, estimated from the codec's encoded size

    def average(
        self,
        grads: list[torch.Tensor],
        n_samples: int,
        label: str,
        round_tag: int,
        finished_without_us: Callable[[], bool] = lambda: False,
        retry_grace: float = 0.0,
    ) -> list[torch.Tensor] | None:
        """The group's average, or None if the round failed, or if `finished_without_us()` (a round that ended for
        every other peer and not for us: nobody is left to retry with). After a failed attempt, wait up to
        `retry_grace` seconds for that to become known before retrying. `round_tag` (the epoch) travels with our
        part: hivemind's matchmaking groups whoever is looking at the time, so with delayed steps one peer's round
        for epoch e could meet another's for e + 1; a group whose tags differ is a failed round for all of them."""
        started = time.monotonic()
        result = None
        while result is None and time.monotonic() - started < self.cfg.averaging_timeout and not finished_without_us():
            with self.averager.get_tensors() as buffers:  # every attempt starts from our own gradients
                for buf, g in zip(buffers, grads, strict=True):
                    buf.copy_(g)
            control = self.averager.step(
                weight=float(n_samples),
                scheduled_time=get_dht_time() + self.cfg.matchmaking_time,
                timeout=self.cfg.averaging_timeout,
                allow_retries=False,
                gather=round_tag,
                wait=False,
            )
            try:  # the step's own timeout covers matchmaking only: bound the round, or a stuck peer stalls the stage
                result = control.result(timeout=2 * self.cfg.averaging_timeout)
            except Exception as e:
                control.cancel()
                logger.warning("all-reduce attempt failed: %r", e)
                # A round can end for our peers and fail for us. Their report of the next epoch arrives within a
                # round trip; a retry without them would wait the whole --averaging-timeout for a group.
                # Do not start one and cancel it instead: hivemind may still run a cancelled step with a later group.
                grace = time.monotonic() + retry_grace
                while time.monotonic() < grace and not finished_without_us():
                    time.sleep(0.01)
        if result is None:
            logger.warning("%s: all-reduce failed", label)
            return None
        tags = sorted({tag for tag in result.values()}, key=repr)
        if tags != [round_tag]:
            logger.warning("%s: the group averaged rounds %s together: treated as a failed round", label, tags)
            return None
        numel = sum(g.numel() for g in grads)
        self.bytes += butterfly_bytes(self.codec, numel, torch.float32, len(result))
        with self.averager.get_tensors() as buffers:
            averaged = [b.clone() for b in buffers]
        if not all(bool(torch.isfinite(a).all()) for a in averaged):
            # a group whose weights sum to 0 (nobody had samples) averages 0/0; anything else non-finite is garbage
            logger.warning("%s: the all-reduce returned non-finite values: treated as a failed round", label)
            return None
        logger.info(
            "%s: averaged %d samples with %d peers in %.2fs", label, n_samples, len(result), time.monotonic() - started
        )
        return averaged


class ParameterAveraging:
    """A plain mean of the peers' parameters (weight 1 each), every --param-average-every epochs: pulls together peers
    whose optimizers round differently (devices of different kinds), which identical averaged gradients alone do not
    keep equal. Compute thread."""

    def __init__(self, averager: StrictAverager, cfg: AveragingConfig, codec: Codec):
        self.averager, self.cfg, self.codec = averager, cfg, codec
        self.bytes = 0

    def average(self, worker: StageWorker) -> None:
        """Replaces the worker's parameters with the group's mean; keeps them if nobody answers."""
        with self.averager.get_tensors() as buffers:
            for buf, p in zip(buffers, worker.params, strict=False):
                buf.copy_(p.detach())
        control = self.averager.step(
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
        numel = sum(p.numel() for p in worker.params)
        self.bytes += butterfly_bytes(self.codec, numel, torch.float32, len(result))
        with worker.state_lock, torch.no_grad(), self.averager.get_tensors() as buffers:
            for buf, p in zip(buffers, worker.params, strict=False):
                p.copy_(buf)


@dataclass
class Averaging:
    """How one stage averages: its gradient all-reduce, parameter averaging, and the averager that shares state."""

    gradients: GradientAveraging
    parameters: ParameterAveraging
    state: StageAverager  # also the gradient averager: its DHT prefix is the stage's

    @property
    def bytes(self) -> int:
        return self.gradients.bytes + self.parameters.bytes

    def averagers(self) -> tuple[DecentralizedAverager, ...]:
        return (self.gradients.averager, self.parameters.averager)

    def launch(self) -> None:
        """Main thread: fork the averagers' processes (wait for them with `wait_until_ready`)."""
        for averager in self.averagers():
            start_in_background(averager)

    def wait_until_ready(self, timeout: float) -> None:
        for averager in self.averagers():
            averager.wait_until_ready(timeout)

    def shutdown(self) -> None:
        for averager in self.averagers():
            if averager.is_alive():
                averager.shutdown()


def build_averaging(
    worker: StageWorker, sdht: SwarmDHT, stage: int, cfg: AveragingConfig, policy: CompressionPolicy
) -> Averaging:
    """Build anywhere; `Averaging.launch` on the main thread (hivemind's averagers are forked processes)."""
    prefix = f"{sdht.swarm_name}_v{PROTOCOL_VERSION}_stage{stage}"  # peers of another protocol never average with us
    common = dict(
        dht=sdht.dht,
        start=False,
        # hivemind: a request_timeout above min_matchmaking_time can deadlock two peers that both lead
        min_matchmaking_time=cfg.matchmaking_time,
        request_timeout=cfg.matchmaking_time / 2,
        allreduce_timeout=cfg.averaging_timeout,
        next_chunk_timeout=cfg.averaging_timeout,
    )
    grad_codec = policy.codec(TensorRole.ALLREDUCE_GRADIENTS)
    averager = StageAverager(
        worker,
        prefix=prefix,
        compression=hivemind_compression(grad_codec),
        state_compression=hivemind_compression(policy.codec(TensorRole.STATE)),
        declare_state_period=5.0,
        allow_state_sharing=True,
        **common,
    )
    param_codec = policy.codec(TensorRole.PARAMETERS)
    param_averager = StrictAverager(
        averaged_tensors=[p.detach().cpu().clone() for p in worker.params],
        prefix=f"{prefix}_params",
        compression=hivemind_compression(param_codec),
        allow_state_sharing=False,
        **common,
    )
    return Averaging(
        gradients=GradientAveraging(averager, cfg, grad_codec),
        parameters=ParameterAveraging(param_averager, cfg, param_codec),
        state=averager,
    )
