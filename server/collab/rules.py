"""The epoch rules of a stage peer, as pure functions of a frozen view: when it ends its epoch, skips epochs, refuses
work as behind, or copies a peer's state.

Like `swarm/rebalance.py` `decide`, nothing here reads a clock, a socket or a lock: the collaboration (epoch.py)
takes an `EpochView` of what it knows and acts on the answer, and the tests call these functions case by case.

The facts a view holds, and what each proves:
- our epoch E and the samples we accumulated towards it (`held`);
- the samples of E's global batch our stage peers *proved* (stage 0's signed admissions of their microbatches,
  each microbatch once: served.py `distinct`): their counts alone are their word;
- `stage0_at`, the latest epoch of stage 0 verified admissions show: stage 0 at epoch A has finished every epoch
  before A, so every microbatch of those batches has passed every later stage. A signature proves who spoke, not
  that what it says is possible: any peer that announces itself on stage 0 can sign. So only signers holding at
  least half of the work this peer did lately move it (`frontier`);
- the epochs our stage peers report, and which of them we refused lately (a state we would not copy).

Invariants:
- A stage peer's word alone (its `end_epoch`, its report of a later epoch) ends none of our epochs (`may_end`),
  except where we trust it (`trusting`: stage 0, and the epoch we joined the stage in).
- A peer is believed at most as far as stage 0's admissions show it can be (`shown_limit`): a liar's far epoch
  makes us copy nothing, give up no round, refuse no work.
- A call whose admission is two or more epochs ahead of us means we missed epochs: we are behind if a peer of ours
  is ahead to copy from (or, on stage 0, the signer is a peer of ours); with nobody ahead the whole stage is behind
  stage 0, and we end our epoch and skip the rest (`on_call`).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

REFUSED_EPOCHS = 20  # how long a peer whose state we refused is no source of ours (`distrusted`)


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochView:
    """What a stage peer knows when it decides, frozen. Built by the event loop (epoch.py `view`)."""

    stage: int
    epoch: int
    quota: int  # --samples-per-step: one global batch
    lookahead: int  # --lookahead-samples: what stage 0 admits of the next batch early
    held: int = 0  # samples we accumulated towards `epoch`
    proven: int = 0  # samples of `epoch`'s global batch our peers proved, each microbatch once
    stage0_at: int = -1  # the latest epoch of stage 0 verified admissions show, as far as `frontier` confirms
    joined_at: int | None = None  # the epoch we started serving the stage in (None: not started)
    ending: int | None = None  # the epoch we last began to end
    accumulating: bool = True  # our phase: serving and accumulating (not ending, recovering or stopped)
    diverged: bool = False  # we stepped alone after a failed round: our parameters may differ from the stage's
    peer_epochs: Mapping[str, int] = field(default_factory=dict)  # the epoch each stage peer last reported
    refused_at: Mapping[str, int] = field(default_factory=dict)  # peer -> the latest epoch we refused its state
    established: frozenset[str] = frozenset()  # peers whose work we verified (a round with us, a state we loaded)


class Act(enum.Enum):
    WAIT = "wait"  # nothing to do yet
    END = "end"  # end `epoch` now (its round, or a lone step)
    ANNOUNCE_AND_END = "announce and end"  # tell the stage to end `epoch`, then end it
    CATCH_UP = "catch up"  # we missed epochs, or diverged: copy a peer's state
    BEHIND = "behind"  # (a call) refuse it as behind and catch up
    GO = "go"  # (a call) serve it


@dataclass(frozen=True, slots=True)
class Decision:
    act: Act
    epoch: int | None = None  # the epoch to end
    skip_to: int | None = None  # stage 0 is already there: epochs between are left without a step


def done(v: EpochView) -> int:
    """Samples of our epoch's global batch the stage holds, as far as we can tell: ours and those our peers proved."""
    return v.held + v.proven


def joining(v: EpochView) -> bool:
    """Whether we are still in the epoch we joined the stage in (or not serving yet): the proofs of its first
    samples came before we did (a restarted peer would wait for stage 0 to move on, and with tied embeddings stage 0
    waits in the tied round for it), and we have no progress of our own to hold a peer's word against."""
    return v.joined_at is None or v.epoch <= v.joined_at


def trusts(v: EpochView, sender: str | None) -> bool:
    """Whether stage peer `sender`'s word alone (its `end_epoch`, the epoch it reports) ends our epoch. While we
    join, any listed peer's. On stage 0, after that, an established peer's (one whose work we verified: a round that
    completed with us, a state of its we loaded): its peers sign the admissions anyway, and end an epoch whose
    microbatches were lost, which nothing proves; but any peer can announce itself on stage 0, and a stranger's
    `end_epoch` ended its epochs before their samples came. On later stages, nobody's: stage 0's admissions and the
    proofs of the stage's samples end epochs there."""
    if sender is None:
        return False
    return joining(v) or (v.stage == 0 and sender in v.established)


def trusting(v: EpochView) -> bool:
    """Whether some peer's word may be trusted now (`trusts`)."""
    return v.stage == 0 or joining(v)


def may_end(v: EpochView, sender: str | None = None) -> bool:
    """Whether the stage may have finished our epoch: stage 0 signed an admission of a later epoch, or what the stage
    holds of it makes the global batch, or `sender`, whom we trust, says so."""
    return trusts(v, sender) or v.stage0_at > v.epoch or done(v) >= v.quota


def shown_limit(v: EpochView, trusted: bool = False) -> int | None:
    """The latest epoch stage 0's admissions show a stage peer can be at (None: its word goes, `trusting`). A peer at
    epoch E has finished E - 1. Stage 0 at epoch A has finished the epochs before A, and a peer of a later stage may
    have finished A itself (on its count, before stage 0 did; and the epochs after A that stage 0 admitted early);
    our own epoch, once proven, and while we end it (its samples have left our count then: an honest peer that
    finished it must stay in view while our round runs). A peer that reports more is left out of our view rather
    than taken as far as it can be. `trusted`: the limit of an established peer's word."""
    if trusted and trusting(v):
        return None
    early = v.lookahead // v.quota  # whole epochs admitted early
    if v.stage0_at > v.epoch:
        return v.stage0_at + 1 + early
    proven = (v.ending is not None and v.ending >= v.epoch) or done(v) >= v.quota
    return v.epoch + 1 + early if proven else v.epoch


def shown(v: EpochView) -> dict[str, int]:
    """The peers' epochs we believe (`shown_limit`): an established peer's where we trust its word."""
    limits = shown_limit(v, trusted=True), shown_limit(v)
    return {
        p: e
        for p, e in v.peer_epochs.items()
        if (limit := limits[0] if trusts(v, p) else limits[1]) is None or e <= limit
    }


def distrusted(refused_at: Mapping[str, int], epoch: int) -> set[str]:
    """Peers whose state we refused within REFUSED_EPOCHS epochs before `epoch`: no state we copy, catch up from or
    adopt the lineage of. Not for ever: honest peers whose hardware rounds differently (a CPU and a GPU peer) may
    refuse each other's copies; each then steps alone, and the lineage rule makes the stage one model again once the
    refusal lapses. A liar refused again costs its stage one more copy every REFUSED_EPOCHS."""
    return {p for p, e in refused_at.items() if epoch - e < REFUSED_EPOCHS}


def lately_refused(v: EpochView) -> set[str]:
    """`distrusted` as the stage's epochs go on: at our epoch, or at the furthest a peer reports (as far as shown) if
    later. By ours only, a peer whose epoch stayed open distrusted the peer it refused, its one way on, for good."""
    return distrusted(v.refused_at, max([v.epoch, *shown(v).values()]))


def furthest(v: EpochView) -> int | None:
    """The latest epoch a peer we believe reports, leaving out those lately refused: a refused peer alone ahead is
    nobody to catch up from (counted, it held us behind it for good)."""
    refused = lately_refused(v)
    return max((e for p, e in shown(v).items() if p not in refused), default=None)


def on_poll(v: EpochView, lost: bool = False) -> Decision:
    """The poller's question, several times a second: must we do something about our epoch? `lost`: stage 0's batch
    is admitted but its Backwards stopped coming (`lost_microbatches`)."""
    if not v.accumulating:
        return Decision(Act.WAIT)
    ahead = furthest(v)
    ahead = v.epoch if ahead is None else ahead
    if ahead >= v.epoch + 2 or v.diverged:
        return Decision(Act.CATCH_UP)
    if ahead == v.epoch + 1:  # peers just finished this epoch: join their round (or step alone, then resync)
        return Decision(Act.END, v.epoch)
    if done(v) >= v.quota or lost:
        return Decision(Act.ANNOUNCE_AND_END, v.epoch)
    return Decision(Act.WAIT)


def on_end_message(v: EpochView, epoch: int, sender: str) -> bool:
    """Stage peer `sender` asks us to end `epoch`: whether we do now."""
    return epoch == v.epoch and v.accumulating and may_end(v, sender)


def on_call(v: EpochView, admitted_at: int, signer_is_peer: bool) -> Decision:
    """A call admitted by stage 0 at `admitted_at` (verified). `signer_is_peer`: on stage 0, the admission was signed
    by another peer of ours, which was at `admitted_at` then. Stage 0 had finished every epoch before `admitted_at`,
    so if we are still in one we end it before the call runs. Two or more epochs behind, we missed epochs if a peer
    of ours is ahead (copy it: BEHIND); with none ahead the whole stage is behind stage 0 (it ended epochs without
    us, on its admission timeout), and we end ours and skip the rest, as our peers do on their next call, rather than
    each wait for another to catch up from."""
    admitted_at = min(admitted_at, v.stage0_at)  # as far as the frontier confirms (`frontier`)
    if admitted_at >= v.epoch + 2 and (signer_is_peer or (furthest(v) or -1) > v.epoch):
        return Decision(Act.BEHIND)
    if admitted_at > v.epoch and v.accumulating:
        return Decision(Act.ANNOUNCE_AND_END, v.epoch, skip_to=admitted_at)
    return Decision(Act.GO)


def behind_for_admission(v: EpochView) -> bool:
    """Stage 0: whether a peer of ours is two or more epochs on, so that we must catch up before admitting."""
    return (furthest(v) or v.epoch) >= v.epoch + 2


def lost_microbatches(stage: int, admitted: int, quota: int, stalled_for: float, admission_timeout: float) -> bool:
    """Stage 0: the epoch's global batch is admitted (`admitted` samples of `quota`), but no Backward came for
    `stalled_for` seconds (a trainer died with microbatches in flight): past `admission_timeout`, the epoch ends
    without them so that admission goes on."""
    return stage == 0 and admitted >= quota and stalled_for >= admission_timeout


def catch_up_source(
    my_epoch: int, epochs: Mapping[str, int], me: str, diverged: bool, averaged: Collection[str] = ()
) -> tuple[str | None, bool]:
    """Whom to copy: the peer furthest ahead (smallest id among equals) when one is ahead of us; when we `diverged`
    (stepped alone after our round failed), a peer at our epoch whose round of that epoch ended (`averaged`: it holds
    the stage's model), the smallest; if none did, the smallest peer id among those at our epoch, unless that is us.
    Returns (source or None, whether we are still diverged): None and still diverged while a peer is behind us, since
    it may step alone too and the reference is decided once it has."""
    ahead = max([my_epoch, *epochs.values()])
    if ahead > my_epoch:
        return min(p for p, e in epochs.items() if e == ahead), diverged
    if not diverged:
        return None, False
    if held := sorted(p for p in averaged if epochs.get(p) == my_epoch and p != me):
        return held[0], True
    if any(e < my_epoch for e in epochs.values()):
        return None, True
    same = sorted(p for p, e in epochs.items() if e == my_epoch)
    if not same or me < same[0]:
        return None, False  # we are the reference: the others copy us
    return same[0], True


def frontier(at: Mapping[str, int], weight: Mapping[str, int]) -> int:
    """How far stage 0 is, as far as the work this peer did confirms: the latest epoch that stage-0 signers holding at
    least half of `weight` have shown (`at`: signer -> the latest `admitted_at` verified from it; `weight`: signer ->
    samples of its admissions we accumulated lately). So a signer whose admissions are less than half of what we
    computed lately (a stranger that announced itself on stage 0 and signs what it likes) moves no stage, however far
    it says stage 0 is, and signers holding half or more are never held back by the rest. With no weight at all (a
    peer that has computed nothing yet) the latest any signer shows (-1: none): a signed admission is all there is.
    What it costs an honest stage-0 peer that just joined: its admissions move nothing on their own until it has
    admitted half of what a later stage computed in its last epochs (worker.py RECENT_EPOCHS); its peers' do meanwhile."""
    total = sum(w for s, w in weight.items() if s in at and w > 0)
    if total == 0:
        return max(at.values(), default=-1)
    best, held = -1, 0
    for epoch in sorted({at[s] for s in weight if s in at and weight[s] > 0}, reverse=True):
        held = sum(w for s, w in weight.items() if s in at and at[s] >= epoch and w > 0)
        if 2 * held >= total:
            best = epoch
            break
    return best
