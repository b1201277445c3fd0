"""What a stage server needs from its training semantics, and the simplest one: a peer that steps alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from server.collab.lowrank import LowRankState
from server.collab.tickets import Ticket
from server.worker import StageWorker
from swarm.compression import CompressionPolicy
from swarm.protocol import wire_pb2 as pb


class Collaboration(Protocol):
    """The stage's training semantics as the server drives them: `launch`, `join`, `start` before serving;
    `after_backward` after every backward (before its reply); `finish_epoch` and `stop` when leaving the stage."""

    address: str  # host:port of this peer's stage service, once it is bound
    policy: CompressionPolicy  # what the stage's averaging uses

    @property
    def epoch(self) -> int: ...

    def batch_done(self) -> float:
        """The share of the current global batch this stage has accumulated: this peer's samples and what its stage
        peers last reported. Any thread may ask (the answer may lag a message)."""
        ...

    @property
    def allreduce_bytes(self) -> int: ...

    @property
    def allreduce_fp32_bytes(self) -> int:
        """What the same rounds would have cost with whole fp32 tensors."""
        ...

    @property
    def rounds_ok(self) -> int:
        """The stage's all-reduce rounds this peer finished; `rounds_failed`: those that failed."""
        ...

    @property
    def rounds_failed(self) -> int: ...

    @property
    def state_downloads(self) -> int:
        """Stage states this peer loaded from its peers."""
        ...

    def shared_digest(self) -> tuple[int, str] | None:
        """Any thread. (epoch, digest) of the state a peer that downloads ours gets; None while we share none."""
        ...

    @property
    def progress_bytes(self) -> int:
        """Bytes of the Progress messages this peer sent its stage peers (times each peer it sent one to)."""
        ...

    @property
    def progress_calls(self) -> tuple[int, int]:
        """(Progress calls this peer made to its stage peers, Progress messages it took from them: relayed ones too)."""
        ...

    @property
    def epoch_end_s(self) -> list[float]:
        """Its latest epoch ends, seconds each from the start of the end to the step, oldest first."""
        ...

    @property
    def lowrank(self) -> LowRankState | None:
        """The stage's low-rank averaging state (ACP-SGD or PowerSGD), if it averages low-rank."""
        ...

    @property
    def compression(self) -> str:
        """The stage's compression policy, in words."""
        ...

    async def launch(self) -> None: ...

    async def join(self) -> bool:
        """Take the stage's state from its live peers; False if there are none."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def finish_epoch(self, timeout: float) -> int:
        """Wait for the current epoch to end; returns the samples whose gradients it could not average in time."""
        ...

    async def after_backward(self) -> None: ...

    async def admit(self, microbatch_id: str, n: int, deadline: float | None = None, caller: str = "") -> Ticket:
        """Stage 0, before a Forward of `n` samples from `caller` that a Backward will follow: wait for room in a
        global batch. Returns the global batch it joins and the epoch now, signed for the microbatch's later calls."""
        ...

    async def observe(
        self,
        meta: pb.CallMeta,
        samples: int,
        backward: bool,
        on_spent: Callable[[], None] | None = None,
        deadline: float | None = None,
    ) -> None:
        """Before every call but stage 0's admissions: check the admission the call carries (raises TicketRefused) and
        act on it. `on_spent`: called as soon as a Backward's admission is marked spent here, before anything else
        is awaited (a retry that comes meanwhile then waits for this attempt instead of being refused). `deadline`:
        the call's (a monotonic time): a call that must wait for the stage's step waits no longer."""
        ...

    def precheck(self, meta: pb.CallMeta, backward: bool) -> None:
        """As soon as a call's CallMeta arrives, before its payload is read: raises TicketRefused for an admission that
        `observe` would refuse whatever the payload (a Backward without one, one not signed)."""
        ...

    def release(self, ticket: Ticket, microbatch_id: str, n: int) -> None:
        """Stage 0: an admitted microbatch of `n` samples failed before it was computed."""
        ...

    def unobserve(self, meta: pb.CallMeta) -> None:
        """A Backward that `observe` let through failed before its gradient was accumulated: its admission may be
        used again (each pays for one Backward per server)."""
        ...

    async def stop_admitting(self) -> None:
        """Stage 0: this peer is leaving the stage; it admits no more Forwards."""
        ...

    async def on_progress(self, msg: pb.StageProgress) -> pb.ProgressAck | None:
        """A stage peer's progress; None if this collaboration has no stage peers."""
        ...


class SoloSteps:
    """No peers to average with (tests, a one-peer stage without a DHT): step once this peer has the global batch."""

    allreduce_bytes = allreduce_fp32_bytes = rounds_ok = rounds_failed = state_downloads = progress_bytes = 0
    progress_calls = (0, 0)
    lowrank = None

    @property
    def epoch_end_s(self) -> list[float]:
        return []  # a step here is one job on the compute thread

    @property
    def compression(self) -> str:
        return self.policy.describe()

    def __init__(self, worker: StageWorker, target: int):
        self.worker, self.target = worker, target
        self.address = ""
        self.policy = CompressionPolicy()

    def shared_digest(self) -> tuple[int, str] | None:
        return self.worker.digest()

    @property
    def epoch(self) -> int:
        return self.worker.epoch

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

    def batch_done(self) -> float:
        return self.worker.samples_accumulated / self.target

    async def after_backward(self) -> None:
        if self.worker.samples_accumulated >= self.target:
            await self.worker.submit(self._step)

    async def on_progress(self, msg: pb.StageProgress) -> pb.ProgressAck | None:
        return None

    async def admit(self, microbatch_id: str, n: int, deadline: float | None = None, caller: str = "") -> Ticket:
        return Ticket(self.epoch, self.epoch)  # one peer, stepping when it has the global batch: nothing to check

    async def observe(
        self,
        meta: pb.CallMeta,
        samples: int,
        backward: bool,
        on_spent: Callable[[], None] | None = None,
        deadline: float | None = None,
    ) -> None:
        pass

    def precheck(self, meta: pb.CallMeta, backward: bool) -> None:
        pass

    def release(self, ticket: Ticket, microbatch_id: str, n: int) -> None:
        pass

    def unobserve(self, meta: pb.CallMeta) -> None:
        pass

    async def stop_admitting(self) -> None:
        pass

    def _step(self) -> None:
        grads, _ = self.worker.take_gradients()
        self.worker.apply_gradients(grads, end_epoch=True)
