"""Stage 0's admission: which global batch a microbatch belongs to, decided when stage 0 admits its Forward.

Stage 0 admits `quota` (--samples-per-step) samples per epoch, plus at most `lookahead` samples of the next epoch,
and holds further Forwards until the epoch has stepped. Its peers split that quota without waiting for each other:
- each admits microbatches while its own total stays within an equal share, and the batch's total, as far as it
  knows, within the quota (a peer that admitted alone before the others were listed may hold more than its share);
- one of them, the smallest peer id among those admitting (the remainder's holder), also takes what the shares leave
  (they rarely divide into whole microbatches), as long as the batch is not complete counting every other peer at its
  share, or at what it admitted if that is more or if no further microbatch fits in its share;
- the last microbatch may overfill the batch by less than its own size: the batch must reach the quota to end.
Peers that trainers stopped sending Forwards to, and peers that said they no longer admit (leaving the stage), hold
no share. So before a peer admits towards an epoch, every other peer must have answered its claim (a Progress message
with `claims`) of that epoch or the one before: the claim makes the receiver count the claimant's share of both, and
the answer says what the receiver had admitted until then (StagePeers.claim). A peer idle for two epochs that admitted
its share unannounced overfilled the batch by that share, since the others had split it without it.
When our share is full but the batch, as far as we know, is not, the Forward belongs on another peer: `place` says so
and the trainer retries there at once.

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

    def place(self, epoch: int, n: int) -> int | Decision:
        """For a microbatch of `n` samples while stage 0 is at `epoch`: the global batch it joins (this epoch's, or
        the next one's within the lookahead), or what to do instead."""
        if self._has_room(epoch, self.quota, n):
            return epoch
        if self._has_room(epoch + 1, self.lookahead, n):
            return epoch + 1
        if self._full(epoch, self.quota) and self._full(epoch + 1, self.lookahead):
            return Decision.WAIT
        return Decision.REFUSE

    def record(self, batch: int, n: int, epoch: int) -> None:
        """We admitted `n` samples into global `batch` while at `epoch`."""
        self.admitted[batch] = self.admitted.get(batch, 0) + n
        for old in [e for e in self.admitted if e < epoch]:
            del self.admitted[old]

    def release(self, batch: int, n: int) -> None:
        """An admitted microbatch failed before it was computed (refused, expired): it will not come back."""
        if batch in self.admitted:
            self.admitted[batch] = max(self.admitted[batch] - n, 0)

    def counts(self, epoch: int) -> tuple[int, int]:
        """What our progress messages report: samples we admitted towards `epoch` and towards the next one."""
        return self.admitted.get(epoch, 0), self.admitted.get(epoch + 1, 0)

    def total(self, epoch: int) -> int:
        """Samples admitted towards `epoch` by us and, as far as we know, by the other peers."""
        return self.admitted.get(epoch, 0) + sum(self.peers.admitted_by(p, epoch) for p in self.peers.peers)

    def _full(self, epoch: int, limit: int) -> bool:
        return self.total(epoch) >= limit

    def _has_room(self, epoch: int, limit: int, n: int) -> bool:
        claimants = self.peers.admitting(epoch)
        fits = self.total(epoch) + n <= limit
        # what peers that no longer admit did admit stays counted; the rest is split
        limit -= sum(self.peers.admitted_by(p, epoch) for p in self.peers.peers if p not in claimants)
        if limit <= 0:
            return False
        share = limit / (1 + len(claimants))
        own = self.admitted.get(epoch, 0)
        if own + n <= share and fits:
            return True
        if min([*claimants, self.peers.sdht.peer_id]) != self.peers.sdht.peer_id:
            return False  # the remainder is another peer's

        def reserved(peer: str) -> float:
            known = self.peers.admitted_by(peer, epoch)
            return known if known + n > share else max(known, share)

        return own + sum(reserved(p) for p in claimants) < limit
