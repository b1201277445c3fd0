"""Stage 0's admission: which global batch a microbatch belongs to, decided when stage 0 admits its Forward.

Stage 0 admits `quota` (--samples-per-step) samples per epoch, plus at most `lookahead` samples of the next epoch,
and holds further Forwards until the epoch has stepped. Its peers split that quota: each admits up to an equal
share, and reserves a share for every other peer that admits work, unless that peer's messages say it admitted more
(a peer that trainers stopped sending Forwards to stops reserving after an epoch). So simultaneous admissions on
several peers never overfill an epoch. When our share is full but the epoch, as far as we know, is not, the Forward
belongs on another peer: `place` says so and the trainer retries there at once.

Event loop only: it reads the peers' counts that StagePeers keeps and keeps our own.
"""

from __future__ import annotations

import enum

from server.collab.progress import StagePeers


class Decision(enum.Enum):
    WAIT = "wait"  # every peer's share of the batches open to admission is taken: wait for the epoch to step
    REFUSE = "refuse"  # ours is taken, another peer's is not: the microbatch belongs there


class Admission:
    def __init__(self, peers: StagePeers, quota: int, lookahead: int):
        self.peers, self.quota, self.lookahead = peers, quota, lookahead
        self.admitted: dict[int, int] = {}  # epoch -> samples we admitted towards it

    def place(self, epoch: int) -> int | Decision:
        """For a new microbatch while stage 0 is at `epoch`: the global batch it joins (this epoch's, or the next one's
        within the lookahead), or what to do instead."""
        if self._has_room(epoch, self.quota):
            return epoch
        if self._has_room(epoch + 1, self.lookahead):
            return epoch + 1
        if self._full(epoch, self.quota) and self._full(epoch + 1, self.lookahead):
            return Decision.WAIT
        return Decision.REFUSE

    def record(self, batch: int, n: int, epoch: int) -> None:
        """We admitted `n` samples into global `batch` while at `epoch`."""
        self.admitted[batch] = self.admitted.get(batch, 0) + n
        for old in [e for e in self.admitted if e < epoch]:
            del self.admitted[old]

    def counts(self, epoch: int) -> tuple[int, int]:
        """What our progress messages report: samples we admitted towards `epoch` and towards the next one."""
        return self.admitted.get(epoch, 0), self.admitted.get(epoch + 1, 0)

    def total(self, epoch: int) -> int:
        """Samples admitted towards `epoch` by us and, as far as we know, by the other peers."""
        return self.admitted.get(epoch, 0) + sum(self.peers.admitted_by(p, epoch) for p in self.peers.peers)

    def _full(self, epoch: int, limit: int) -> bool:
        return self.total(epoch) >= limit

    def _has_room(self, epoch: int, limit: int) -> bool:
        claimants = self.peers.admitting(epoch)
        share = limit / (1 + len(claimants))
        reserved = sum(max(self.peers.admitted_by(p, epoch), share) for p in claimants)
        return self.admitted.get(epoch, 0) + reserved < limit
