"""Averaging within a stage, on hivemind's DecentralizedAverager: the gradient all-reduce that every epoch ends with,
the periodic plain mean of parameters, and state sharing with joining peers.

`build_averaging` is the one place that decides how a stage averages (the seam where other schemes, e.g. low-rank
averaging with error feedback, plug in): it returns the `Averaging` bundle the epoch protocol drives, of the stage's
averager (stage_averager.py) and the rounds run on it (rounds.py). Every method that blocks is called on the stage's
compute thread or the collaboration's averaging pool, never on the event loop.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hivemind.averaging import DecentralizedAverager

from dht.node import SwarmDHT
from dht.records import stage_key
from server.collab.compat.process import start_in_background
from server.collab.lowrank import (
    AcpState,
    Layout,
    LowRankState,
    PowerSgdState,
)
from server.collab.rounds import GradientAveraging, LowRankGradientAveraging, ParameterAveraging
from server.collab.stage_averager import StageAverager, hivemind_compression
from server.config import LOW_RANK_CODECS, AveragingConfig
from server.worker import StageWorker
from swarm.compression import CompressionPolicy, TensorRole
from swarm.protocol.rpc import PROTOCOL_VERSION

logger = logging.getLogger(__name__)


@dataclass
class Averaging:
    """How one stage averages: its gradient all-reduce, parameter averaging (None unless --param-average-every; its
    rounds are the gradient averager's), and the averager that shares state."""

    gradients: GradientAveraging
    parameters: ParameterAveraging | None
    state: StageAverager  # also the gradient averager: its DHT prefix is the stage's
    # tied embeddings, on stage 0 and the last stage: the tied weight's round over both stages (tied.py), whose
    # members are its own
    tied: GradientAveraging | None = None

    def _parts(self) -> list:
        return [part for part in (self.gradients, self.parameters, self.tied) if part is not None]

    @property
    def bytes(self) -> int:
        return sum(part.bytes for part in self._parts())

    @property
    def fp32_bytes(self) -> int:
        return sum(part.fp32_bytes for part in self._parts())

    def restrict_to(self, members: Callable[[], Iterable[str]]) -> None:
        """Rounds hold only us and the peers whose libp2p ids `members()` returns at the time (any thread)."""
        self.gradients.members = members
        if self.parameters is not None:
            self.parameters.members = members

    def cap_weights(self, caps: Callable[[int], dict[str, float]]) -> None:
        """The stage's gradient rounds (any thread): the most each peer's part weighs in the parts we reduce is what
        `caps(epoch)` gives for its libp2p id at the time (server/collab/served.py). Tied rounds hold the other
        stage's peers, whose admissions we do not see: their weights keep the epoch's bounds only."""
        self.gradients.weight_caps = caps

    def averagers(self) -> tuple[DecentralizedAverager, ...]:
        """Each process once (parameter rounds run on the gradient averager)."""
        return tuple(dict.fromkeys(part.averager for part in self._parts()))

    def launch(self) -> None:
        """Main thread: fork the averagers' processes (wait for them with `wait_until_ready`)."""
        for averager in self.averagers():
            start_in_background(averager)

    def wait_until_ready(self, timeout: float) -> None:
        """Raises TimeoutError for an averager whose process is not ready within `timeout`, after asking that process
        to write its threads' stacks to our log (it inherits our faulthandler's SIGUSR1: swarm/stacks.py)."""
        for averager in self.averagers():
            try:
                averager.wait_until_ready(timeout)
            except TimeoutError:
                if averager.pid is not None and averager.is_alive():
                    os.kill(averager.pid, signal.SIGUSR1)
                    time.sleep(0.5)  # its stacks land in the log before our error does
                raise TimeoutError(
                    f"the averager process {averager.pid} ({type(averager).__name__}) was not ready in {timeout:.0f}s"
                ) from None

    def shutdown(self) -> None:
        for averager in self.averagers():
            averager.shutdown()  # also one whose process is gone: it takes no round afterwards


def averager_options(sdht: SwarmDHT, cfg: AveragingConfig) -> dict:
    """What every averager of a stage peer is built with."""
    return dict(
        dht=sdht.dht,
        start=False,
        # hivemind: a request_timeout above min_matchmaking_time can deadlock two peers that both lead
        min_matchmaking_time=cfg.matchmaking_time,
        request_timeout=cfg.matchmaking_time / 2,
        allreduce_timeout=cfg.averaging_timeout,
        next_chunk_timeout=cfg.averaging_timeout,
    )


def build_averaging(
    worker: StageWorker, sdht: SwarmDHT, stage: int, cfg: AveragingConfig, policy: CompressionPolicy
) -> Averaging:
    """Build anywhere; `Averaging.launch` on the main thread (hivemind's averagers are forked processes). The stage's
    own rounds average every parameter but a tied weight (`worker.stage_params`)."""
    prefix = f"{sdht.swarm_name}_v{PROTOCOL_VERSION}_stage{stage}"  # peers of another protocol never average with us
    common = averager_options(sdht, cfg)
    grad_codec = policy.codec(TensorRole.ALLREDUCE_GRADIENTS)
    lowrank: LowRankState | None = None
    if cfg.allreduce_codec in LOW_RANK_CODECS:  # every peer of the stage starts from the same factors
        layout = Layout.of([p.shape for p in worker.stage_params], cfg.allreduce_rank)
        kind = AcpState if cfg.allreduce_codec == "acp" else PowerSgdState
        lowrank = kind(layout, stage + 1, cfg.allreduce_error_feedback, cfg.allreduce_query_reuse)
    param_codec = policy.codec(TensorRole.PARAMETERS)
    averager = StageAverager(
        worker,
        lowrank,
        param_compression=hivemind_compression(param_codec),
        prefix=prefix,
        compression=hivemind_compression(grad_codec),
        state_compression=hivemind_compression(policy.codec(TensorRole.STATE)),
        declare_state_period=5.0,
        allow_state_sharing=True,
        **common,
    )
    averager.robust_clip = cfg.robust_clip
    averager.fixed_groups = cfg.fixed_groups
    # parameter rounds are rounds of the same averager (phases of their own): no second process per peer
    parameters = ParameterAveraging(averager, cfg, param_codec) if cfg.param_average_every > 0 else None
    if sdht.swarm_key is not None:  # private swarm: only listed peers take our state or join our groups
        averager.listed_under = stage_key(sdht.swarm_name, stage)
    return Averaging(
        gradients=LowRankGradientAveraging(averager, cfg, grad_codec, lowrank)
        if lowrank
        else GradientAveraging(averager, cfg, grad_codec),  # fmt: skip
        parameters=parameters,
        state=averager,
    )
