"""The averager of a stage: its rounds average gradients (whole, or as low-rank factors), parameters or a probe of
them, by the phase each round gathers, and it serves the stage's state to peers that join.
"""

from __future__ import annotations

import logging
import math

import torch
from hivemind.compression import CompressionBase, Float16Compression, NoCompression

from server.collab.compat.averager import StrictAverager
from server.collab.compat.codec import TorchBlockwiseQuantization
from server.collab.lowrank import PHASE_FULL, PHASE_P, PHASE_PSGD_P, PHASE_PSGD_Q, PHASE_Q, LowRankState
from server.worker import StageWorker
from swarm.compression import Codec

PHASE_PARAMS = "params"  # a parameter round
PHASE_DIGEST = "params-digest"  # its probe, whose round data names the digest of the peer's parameters
# a probe round averages this many tensors of one value each: hivemind gives each tensor smaller than its part size
# to one reducer, so one tensor would make one member the round's only reducer; then two members whose digests
# differ could each reduce all of their own round and send nothing to the other, which never learns that round is
# not its own. With as many as there are members (up to PROBE_TENSORS), each reduces one, and hears from every other.
PROBE_TENSORS = 16

logger = logging.getLogger(__name__)


def hivemind_compression(codec: Codec) -> CompressionBase:
    """hivemind's implementation of one of our codecs, for its all-reduce (which serializes tensors itself)."""
    return {"none": NoCompression, "fp16": Float16Compression, "blockwise8": TorchBlockwiseQuantization}[codec.name]()


class StageAverager(StrictAverager):
    """Averages a stage's gradients; serves the stage's parameters, optimizer state and epoch to peers that join.

    Every round gathers (epoch, phase, scheme) from each peer of its group, and runs only if they all agree: a group
    that met across epochs, or across averaging settings, fails before sending anything. The phase says what is
    averaged: the gradients whole; with ACP-SGD the P or Q factors of the low-rank tensors and the rest whole; with
    PowerSGD the P factors and the rest whole, then the Q factors alone; the parameters (ParameterAveraging: the
    buffers hold them for that round, sent with `param_compression`, each peer's weighing 1), or a probe of
    PROBE_TENSORS values whose scheme is the digest of the peer's parameters."""

    def __init__(
        self,
        worker: StageWorker,
        lowrank: LowRankState | None = None,
        param_compression: CompressionBase | None = None,
        **kwargs,
    ):
        self._worker, self.lowrank = worker, lowrank  # before super().__init__: the state thread may ask at once
        self.param_compression = param_compression or NoCompression()
        # a probe's values, of no use (whether its round succeeds is the answer): never read, so not shared
        self.probe = [torch.zeros(1) for _ in range(PROBE_TENSORS)]
        # shared memory, allocated before the averager's process forks: the round's factors travel through these
        self.factors = {
            phase: [torch.zeros(shape).share_memory_() for shape in lowrank.layout.factor_shapes(phase)]
            if lowrank
            else []
            for phase in (PHASE_P, PHASE_Q)
        }
        if lowrank is not None:  # a joiner copies the factors with the state, and the state's digest covers them
            worker.share_with_state(lowrank.shared_tensors)
        super().__init__(averaged_tensors=[torch.zeros_like(p, device="cpu") for p in worker.stage_params], **kwargs)

    def get_current_state(self):
        # the state with its low-rank factors, and the digest our Info gives: what a voucher compares
        meta, tensors, digest = self._worker.shared_state()
        logger.info("sending state of epoch %d to a joining peer (digest %s)", meta["epoch"], digest)
        return meta, tensors, None

    def shared_digest(self) -> tuple[int, str] | None:
        """Any thread. (epoch, digest) of the state we hold; None while we share none (our delayed step is pending,
        or we are about to load another state)."""
        return self._worker.digest() if self.allow_state_sharing else None

    @property
    def exact_states(self) -> bool:
        """Whether a peer that downloads our state gets it bitwise (--state-codec none): only then can the stage's
        peers vouch for a state by its digest. A lossy codec makes every joiner's state differ from its source's."""
        return isinstance(self.state_compression, NoCompression)

    def split_state(self, meta: dict, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A downloaded state's (worker tensors, low-rank factors), checked against ours; raises ValueError."""
        n = meta.get("lowrank", 0)
        if not isinstance(n, int) or not 0 <= n <= len(tensors) or (n > 0) != (self.lowrank is not None):
            raise ValueError(f"the state's low-rank factors ({n!r}) do not match this stage's --allreduce-codec")
        worker_tensors, factors = tensors[: len(tensors) - n], tensors[len(tensors) - n :]
        if self.lowrank is not None:
            self.lowrank.check_shared(factors)
        return worker_tensors, factors

    def round_tensors(self, gathered: object, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """The averager's process: an (epoch, phase, scheme) round averages the whole gradients (or the parameters
        they hold for a parameter round), the phase's factors, or the probe."""
        phase = str(_phase(gathered))
        if phase in (PHASE_FULL, PHASE_PARAMS):
            return local
        if phase == PHASE_DIGEST:
            return self.probe
        if self.lowrank is None or phase not in (PHASE_P, PHASE_Q, PHASE_PSGD_P, PHASE_PSGD_Q):
            raise ValueError(f"a round of phase {phase!r} on an averager without low-rank factors")
        if phase == PHASE_PSGD_Q:  # PowerSGD's second round: the tensors kept whole went in its first
            return list(self.factors[PHASE_Q])
        return [
            *self.factors[PHASE_P if phase == PHASE_PSGD_P else phase],
            *(local[i] for i in self.lowrank.layout.whole),
        ]

    def round_settings(self, gathered: object) -> dict:
        """Parameter rounds and their probes: a plain mean (weight 1 each, no robust clipping, no caps from the
        epoch's admissions) with `param_compression`."""
        if _phase(gathered) not in (PHASE_PARAMS, PHASE_DIGEST):
            return {}
        rules = dict(robust_clip=0.0, max_weight=1.0, max_total_weight=math.inf, weight_caps=None)
        probe = _phase(gathered) == PHASE_DIGEST  # (a codec's overhead on one value is larger than the value)
        return dict(compression=NoCompression() if probe else self.param_compression, **rules)

    def gives_way(self, gathered: object) -> bool:
        """A probe: a member that asks us for another round holds other parameters (or was not told of us)."""
        return _phase(gathered) == PHASE_DIGEST


def _phase(gathered: object) -> object:
    """The phase of what a round gathered ([epoch, phase, scheme])."""
    return gathered[1] if isinstance(gathered, list | tuple) and len(gathered) == 3 else PHASE_FULL
