"""What a stage peer's part may weigh in the stage's round: the samples it proves it holds, not the samples it says.

A peer's Progress says how many samples it accumulated towards an epoch, and its part in the round declares a weight;
both are its own word. Bounded only by what one epoch can hold (epoch.py `_most_samples`), a listed peer that says it
holds the whole global batch ends the stage's epochs before its peers have their samples, and its part, weighing
nearly all of the group's weight, becomes the stage's step: one peer steers the stage.

So a Progress also carries stage 0's signed admissions of the microbatches whose gradients the sender holds for the
epoch (`StageProgress.served`; the worker keeps them beside its counts), less those its receivers said they hold
(`ProgressAck.served_held`, progress.py: one new admission per backward, not all of the epoch's each time), and a
peer's part in the parts we reduce weighs at most what its admissions prove (compat/averager.py `cap_weights`).
An admission proves its samples for one peer and one epoch when:
- a stage-0 peer signed it, over its microbatch, samples and batch (tickets.py);
- its microbatch's Backward was not served here: a peer relaying the admissions we sent it proves nothing;
- the peer did not name it before: an admission counts once per peer, for the first epoch it names it for (no
  replay into a later epoch). Two peers may both name one: a Backward retried on another peer after its reply was
  lost is in both peers' gradients; and a peer that saw an admission (in the Forward it served, or in another
  peer's Progress) can name it without holding its gradient. Counting it for the first peer alone would let such a
  peer take the proofs of the peer that did the Backward; counting it for neither would let it strike them out.
  Counted for each, a copy gains its sender weight, but the group's weights together are bounded by one epoch's
  samples (epoch.py `_epoch_total`): copies beyond that fail the round for every peer;
- its global batch is not after the epoch. One of a later batch (admitted early) is left unclaimed: a peer reports
  it for its own epoch (a Progress sent while the peer's round runs can name the next epoch's admissions under the
  epoch it ends). One of an earlier batch is a late Backward, which joins the current epoch's gradients whatever its
  age: a stage-0 peer thawed after a 30 s freeze sent Backwards 40 epochs late in a soak, and a window of 2 epochs
  capped their servers' weights at half.
An honest peer whose admissions reach us late (its last Progress still in flight when the round starts) weighs a
microbatch less in our parts for that round: every peer still ends it with the same average (the reducer sends one),
weighted a little differently from the others' parts. A liar's part weighs what it served, plus the admissions it
copied, within the epoch's bound.

The same proofs say when the stage may end an epoch without stage 0's word (epoch.py `_may_end`): once the samples
proven for it, each microbatch of its global batch once (`distinct`), make the global batch. A peer's count, its
`end_epoch` and its report of a later epoch are its word: a listed liar ended the stage's epochs before their samples
came, and copying the honest peers' admissions then made its part weigh as much as all of theirs. Copied, replayed,
late and misdated admissions add nothing to `distinct`; what a liar can still do is name the admissions of the
microbatches it forwarded before their Backwards come, so that the epoch ends once they have all passed it (those
Backwards then join the next epoch, as late ones do).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from server.collab.tickets import Tickets, ticket_key
from swarm.protocol import wire_pb2 as pb

logger = logging.getLogger(__name__)
KEEP_EPOCHS = 2  # the epochs before the current one whose proofs are kept (a delayed round's is the one before)
SIGNER_READ_S = 1.0  # the longest a Progress waits for a read of stage 0's keys
MAX_CLAIMED = 1 << 16  # admissions remembered as claimed (a global batch of 1024 microbatches, 64 times over)
MAX_UNCHECKED = 4096  # admissions of unknown signers kept to check again, per peer and epoch
MAX_UNCHECKED_PROGRESS = 256  # (peer, epoch) pairs with such admissions (a liar may name far epochs)
MAX_HELD = 1 << 14  # admissions a peer sent us for one epoch that we remember holding (`held`)
MAX_HELD_PROGRESS = 256  # (peer, epoch) pairs we remember them for


class ForgedAdmission(Exception):
    """A Progress naming an admission no stage-0 peer signed: refused (epoch.py answers PERMISSION_DENIED)."""


class Served:
    """Event loop. The samples each stage peer proved it holds, by epoch."""

    def __init__(self, tickets: Tickets):
        self.tickets = tickets
        self._claimed: OrderedDict[tuple, int] = OrderedDict()  # (admission, peer id) -> the epoch it counted for
        self._proven: dict[int, dict[str, int]] = {}  # epoch -> peer id -> samples its admissions proved
        self._heard: dict[int, set[str]] = {}  # epoch -> peers whose Progress of that epoch reached us
        # (epoch, peer id) -> (when we last looked for their signers, its admissions whose signer we did not know)
        self._unchecked: OrderedDict[tuple[int, str], tuple[float, dict[tuple, pb.Admission]]] = OrderedDict()
        # (epoch, peer id) -> the keys of every admission of that epoch it sent us (`held`)
        self._held: OrderedDict[tuple[int, str], set[tuple]] = OrderedDict()
        # epoch -> the admissions of its own global batch our peers proved -> their samples (`distinct`)
        self._distinct: dict[int, dict[tuple, int]] = {}
        self.forged = 0  # admissions whose signature did not verify

    async def prove(self, msg: pb.StageProgress, current: int) -> None:
        """Count the admissions of an authentic Progress (its signature checked) towards its sender and epoch, and
        those of the round it is in towards that round's epoch (`taken`: its steps are delayed). Raises
        ForgedAdmission for one whose signature does not verify (a stage-0 key signed no such admission: the sender
        made it up): the Progress is refused, and none of its admissions counts. Only epochs whose round we may still
        weigh them in count: from KEEP_EPOCHS before our `current` one to the next (a peer further on is copied from,
        not averaged with; and a liar naming far epochs would otherwise fill our memory)."""
        lists = [(int(msg.epoch), msg.served)]
        if msg.HasField("taken_epoch"):
            lists.append((int(msg.taken_epoch), msg.taken))
        lists = [(epoch, served) for epoch, served in lists if current - KEEP_EPOCHS <= epoch <= current + 1]
        peer, arrived = msg.peer_id, time.monotonic()
        moved_on = [msg.moved_on] if msg.HasField("moved_on") else []
        if any(a.admitted_by not in self.tickets.signers for _, served in [*lists, (0, moved_on)] for a in served):
            # a stage-0 peer we have not heard of: read stage 0's records, but not for long: the sender waits for our
            # answer. An admission still unknown proves nothing now; it is checked again before the round (`settle`)
            await self.tickets.read_signers_since(arrived, SIGNER_READ_S)
        checked = [self._check(peer, epoch, served) for epoch, served in lists]  # raises before anything counts
        # how far stage 0 is, from a message of an epoch outside our window too (a peer far ahead of us: we catch up
        # once stage 0's admissions show it can be there), at one signature check a message
        latest = max([*moved_on, *msg.served, *msg.taken], key=lambda a: a.admitted_at, default=None)
        if latest is not None and latest.admitted_at > self.tickets.latest_at and self._verify(latest):
            self.tickets.witness(latest)  # unknown still: proves nothing (the sender's next one may)
        if lists and lists[0][0] == msg.epoch:  # what it sent us of `served`, but those we could not check yet: it
            # sends them again until we can (a recheck that `_unchecked` lost is not a proof lost)
            held = self._held.pop((int(msg.epoch), peer), set())  # to the end: the latest
            unknown = checked[0][1]
            new = {key for key in map(ticket_key, msg.served) if key not in held and key not in unknown}
            held.update(list(new)[: max(MAX_HELD - len(held), 0)])
            self._held[int(msg.epoch), peer] = held
            while len(self._held) > MAX_HELD_PROGRESS:
                self._held.popitem(last=False)
        for (epoch, _), (valid, unknown) in zip(lists, checked, strict=True):
            self._count(peer, epoch, valid)
            if unknown:
                pending = self._unchecked.pop((epoch, peer), (0.0, {}))[1]  # to the end: the latest
                pending.update(list(unknown.items())[: MAX_UNCHECKED - len(pending)])
                self._unchecked[epoch, peer] = time.monotonic(), pending
                while len(self._unchecked) > MAX_UNCHECKED_PROGRESS:
                    self._unchecked.pop(next(iter(self._unchecked)))
            else:
                self._recheck(peer, epoch)  # an earlier message's signer may be known now
                self._heard.setdefault(epoch, set()).add(peer)

    async def settle(self, epoch: int) -> None:
        """Event loop, before `epoch`'s round: check the admissions of `epoch` whose signer we did not know when their
        Progress came (a stage-0 peer whose record our read did not see yet, or a read that took longer than the
        sender could wait) against a read of stage 0 begun after we last looked, waited for SIGNER_READ_S at most.
        Without this an honest peer's last admissions counted for nothing in our parts, and the round weighed its
        part below its samples (likely how the tied swarm test left one process by 1.5e-2 in CI)."""
        pending = {key: value for key, value in self._unchecked.items() if key[0] == epoch}
        if not pending:
            return
        await self.tickets.read_signers_since(max(since for since, _ in pending.values()), SIGNER_READ_S)
        for _, peer in pending:
            self._recheck(peer, epoch)

    def _recheck(self, peer: str, epoch: int) -> None:
        """Count the admissions of `peer` at `epoch` whose signer we did not know, for those we know now; once none
        is left, its count is heard. A signer stage 0 does not list stays unknown: its admissions prove nothing, and
        its sender is heard once a Progress of its names only signers we know."""
        entry = self._unchecked.get((epoch, peer))
        if entry is None:
            return
        try:
            valid, unknown = self._check(peer, epoch, list(entry[1].values()))
        except ForgedAdmission as e:  # its Progress was taken then; none of its unchecked admissions counts
            logger.warning("stage peer %s: %s; its part weighs what it proved otherwise", peer[-6:], e)
            valid, unknown = {}, {}
        self._count(peer, epoch, valid)
        entry[1].clear()
        entry[1].update(unknown)
        if not unknown:
            del self._unchecked[epoch, peer]
            self._heard.setdefault(epoch, set()).add(peer)

    def _count(self, peer: str, epoch: int, valid: dict[tuple, int]) -> None:
        for key, samples in valid.items():
            self._claimed[key, peer] = epoch
            proven = self._proven.setdefault(epoch, {})
            proven[peer] = proven.get(peer, 0) + samples
            _, _, global_batch, _ = key
            batch = self._distinct.setdefault(epoch, {})
            if global_batch == epoch and len(batch) < MAX_HELD:
                batch[key] = samples
        while len(self._claimed) > MAX_CLAIMED:
            self._claimed.popitem(last=False)

    def _check(self, peer: str, epoch: int, served) -> tuple[dict[tuple, int], dict[tuple, pb.Admission]]:
        """(the samples of the admissions `served` proves for `peer` at `epoch` that it has not named before, those
        whose signer we do not know)."""
        valid: dict[tuple, int] = {}
        unknown: dict[tuple, pb.Admission] = {}
        for a in served:
            key = ticket_key(a)
            if key in valid or (key, peer) in self._claimed or key in self.tickets.spent:
                continue
            if a.global_batch > epoch:
                continue  # a later batch's is claimed when it is counted for its own epoch
            if not self._verify(a):
                unknown[key] = a
                continue
            valid[key] = int(a.samples)
            self.tickets.witness(a)
        return valid, unknown

    def _verify(self, a: pb.Admission) -> bool:
        """Whether a stage-0 peer signed `a` (False: a signer we do not know); raises ForgedAdmission if its signer's
        key did not sign it."""
        verified = self.tickets.verified(a)
        if verified is None:
            return False
        if not verified:
            self.forged += 1
            raise ForgedAdmission(f"progress: admission {a.microbatch_id[:40]!r} does not verify")
        return True

    def held(self, peer_id: str, epoch: int) -> int:
        """How many distinct admissions of `epoch` `peer_id` sent us (ProgressAck.served_held): it leaves them out of
        its later messages. A peer we forgot them for (we restarted) says fewer than it sent, and it sends them all
        again."""
        return len(self._held.get((epoch, peer_id), ()))

    def proven(self, peer_id: str, epoch: int) -> int:
        """Samples `peer_id` proved it holds for `epoch` (any thread: reads a copy)."""
        return dict(self._proven.get(epoch, {})).get(peer_id, 0)

    def distinct(self, epoch: int) -> int:
        """Samples of `epoch`'s global batch our stage peers proved they hold, each microbatch once, less those whose
        Backward was served here (the worker counts ours). Admissions of other batches add nothing: a late Backward's
        samples join the epoch's gradients but not its global batch (the worker does not count its own either), and
        a peer that names the admissions it saw in other peers' messages, replays those of ended epochs, or names
        this epoch's under the next adds nothing to either epoch."""
        spent = self.tickets.spent
        return sum(n for key, n in dict(self._distinct.get(epoch, {})).items() if key not in spent)

    def cap(self, peer_id: str, epoch: int, unheard: float) -> float:
        """Any thread: the most `peer_id`'s part weighs in our parts of `epoch`'s round: what it proved, or `unheard`
        (a microbatch) if no Progress of that epoch reached us from it. A peer that joined while the others took the
        epoch's last samples heard none of their counts for it, and a cap of 0 for each made its parts 0/0 (seen
        twice in a soak, after restarts); a liar that tells only some peers it ends an epoch weighs at most
        `unheard` in the others' parts."""
        if peer_id not in set(self._heard.get(epoch, ())):
            return unheard
        return float(self.proven(peer_id, epoch))

    def forget_before(self, epoch: int) -> None:
        for old in [e for e in self._proven if e < epoch]:
            del self._proven[old]
        for old in [e for e in self._heard if e < epoch]:
            del self._heard[old]
        for old in [e for e in self._distinct if e < epoch]:
            del self._distinct[old]
        for key in [k for k in self._unchecked if k[0] < epoch]:
            del self._unchecked[key]
        for key in [k for k in self._held if k[0] < epoch]:
            del self._held[key]
