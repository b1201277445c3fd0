"""Hubs: how a stage of many peers shares its counts with a few messages per backward instead of one per peer.

With at most HUB_FROM - 1 other peers, a peer sends its `Progress` to each of them (progress.py `broadcast`). Past
that, each epoch has HUBS hubs, the stage peers whose hash with the epoch comes first (`hubs_for`: every peer that
lists the same peers names the same hubs, and they change with every epoch, so no peer carries the stage for long).
A peer sends its per-backward messages of epoch E to E's hubs alone (`via_hub`); a hub logs them with its own and
passes the log on to every peer it lists, at most one call to each peer every `period` (`passed_on`), at once for a
message that ends an epoch (`end_epoch`).

Nothing a hub passes on needs the hub's word: each message is signed by its own sender and checked by its receiver
exactly as if that sender had sent it (intake.py `on_progress`). A hub can only withhold or repeat: repeats change
nothing (a peer's progress only moves forward, each admission counts once), and a message withheld by one hub comes
through the other. A hub that does not answer is dropped like any unreachable peer and the next peer in hash order
takes its place (`hubs_for` over the peers still listed). If every hub of an epoch withholds, what still reaches
every peer directly bounds the stall: the heartbeats of a round, and each peer's count every --announce-period (every
N/8 periods in a stage of N > 8 peers: epoch.py `_refresh`).

Cost per peer: a backward sends HUBS messages; a peer takes at most HUBS calls per `period`; a hub makes at most
HUB_CALLS_PER_S calls a second up to HUB_CALLS_PER_S x PERIOD_S[1] peers (`period` grows with the peers up to
PERIOD_S[1]), (N - 1) / PERIOD_S[1] past that, plus one pass-on at once per sender and epoch that asks to end it
(`FirstEnds`), and is one only in the epochs the hash gives it.

Owned by the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

from swarm.protocol import wire_pb2 as pb

logger = logging.getLogger(__name__)
HUBS = 2  # per epoch: one that withholds leaves the other
HUB_FROM = 7  # other peers from which a peer's per-backward messages go through hubs (fewer: direct costs less)
HUB_CALLS_PER_S = 40.0  # the most calls a hub makes a second, to all of its peers together
PERIOD_S = (0.5, 2.0)  # the shortest and longest wait between a hub's calls to one peer
MAX_PASSED_ON = 256  # messages in one call; a peer further behind gets the rest in the next
KEPT_EPOCHS = 2  # a hub keeps the messages of its newest epoch and the one before (a joiner gets them all)
MAX_KEPT = 4096
SEEN_KEPT = 8192  # signatures of the messages a peer took lately (`Seen`)


def hubs_for(epoch: int, peer_ids: Iterable[str], k: int = HUBS) -> list[str]:
    """The `k` hubs of `epoch` among `peer_ids` (ourselves included): the peers of the smallest SHA-256 of epoch and
    peer id. A stranger cannot choose the epochs it is a hub for without grinding a key per epoch, and gains little
    if it does (see the module docstring)."""

    def rank(peer_id: str) -> bytes:
        return hashlib.sha256(f"{epoch}:{peer_id}".encode()).digest()

    return sorted(set(peer_ids), key=rank)[:k]


def period(n_peers: int) -> float:
    """Seconds between a hub's calls to one peer: its calls to all `n_peers` stay within HUB_CALLS_PER_S."""
    shortest, longest = PERIOD_S
    return min(max(n_peers / HUB_CALLS_PER_S, shortest), longest)


def is_hub(epoch: int, me: str, peer_ids: Iterable[str]) -> bool:
    """Whether we pass on the messages of `epoch` sent to us as a hub: we are one of its hubs, or would be one if
    the sender listed a peer or two fewer than we do. A sender that names everybody its hub is passed on by these
    peers alone, not by the whole stage."""
    return me in hubs_for(epoch, [*peer_ids, me], 2 * HUBS)


def seal(
    latest: pb.StageProgress, passed_on: list[pb.StageProgress], sign: Callable[[bytes], bytes]
) -> pb.StageProgress:
    """A hub's call: its own `latest` message carrying `passed_on`, signed anew. What only a message of its own may
    say (a claim, an epoch's end, the admissions behind it) is left out."""
    envelope = pb.StageProgress()
    envelope.CopyFrom(latest)
    for name in ("signature", "served", "taken", "taken_epoch", "claims", "end_epoch", "via_hub"):
        envelope.ClearField(name)
    envelope.passed_on.extend(passed_on)
    envelope.signature = sign(envelope.SerializeToString())
    return envelope


class Seen:
    """The signatures of the latest SEEN_KEPT messages a peer took: one that comes again (through the other hub) is
    skipped unchecked."""

    def __init__(self) -> None:
        self._signatures: dict[bytes, None] = {}  # oldest first

    def add(self, msg: pb.StageProgress) -> None:
        self._signatures[msg.signature] = None
        if len(self._signatures) > SEEN_KEPT:
            del self._signatures[next(iter(self._signatures))]

    def __call__(self, msg: pb.StageProgress) -> bool:
        return msg.signature in self._signatures


Send = Callable[[str, str, pb.StageProgress], Awaitable[pb.ProgressAck | None]]


class FirstEnds:
    """Which messages make a hub pass its log on at once: a sender's first `end_epoch` message of the hub's own
    epoch. An honest peer asks its stage to end an epoch once, the epoch the stage is in; a peer that marks every
    message as ending its epoch (a liar: its word ends nothing, rules.py `trusts`) gets one early pass-on per epoch,
    not one to every peer per message, and naming other epochs gets it none."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()
        self._newest = -1

    def __call__(self, sender: str, epoch: int, end_epoch: bool, current: int) -> bool:
        """`current`: the hub's epoch."""
        if not end_epoch or epoch != current or (sender, epoch) in self._seen:
            return False
        if epoch > self._newest:
            self._newest = epoch
            self._seen = {(p, e) for p, e in self._seen if e > epoch - KEPT_EPOCHS}
        if len(self._seen) >= MAX_KEPT:  # more senders than a stage has: the rest wait for the period
            return False
        self._seen.add((sender, epoch))
        return True


class Hub:
    """The messages this peer passes on as a hub, and the loop that passes them on. `send(peer_id, address, msg)`
    calls one peer (None: it did not take it); `peers()` the peers to pass on to (peer id -> address); `envelope()`
    our own latest message, signed over whatever `passed_on` it is given (`seal`)."""

    def __init__(
        self,
        send: Send,
        peers: Callable[[], Mapping[str, str]],
        seal: Callable[[list[pb.StageProgress]], pb.StageProgress | None],
    ):
        self._send, self._peers, self._seal = send, peers, seal
        self._log: list[pb.StageProgress] = []  # messages to pass on, oldest first
        self._first = 0  # the position of _log[0] among every message ever logged
        self._next: dict[str, int] = {}  # peer id -> the position of the first message it has not taken
        self._newest = -1  # the latest epoch of a logged message
        self._wake = asyncio.Event()
        self._urgent = False
        self._first_ends = FirstEnds()
        self._task: asyncio.Task | None = None
        self.calls = 0  # calls made passing messages on
        self.bytes_sent = 0

    def add(self, msg: pb.StageProgress, urgent: bool = False, current: int | None = None) -> None:
        """Pass `msg` on (checked by us, or our own); `urgent`: at once (it ends an epoch), if it is its sender's first
        such message of `current`, our epoch (None: the message's own, for ours) (`FirstEnds`)."""
        self._log.append(msg)
        self._newest = max(self._newest, int(msg.epoch))
        keep = [m for m in self._log if int(m.epoch) > self._newest - KEPT_EPOCHS][-MAX_KEPT:]
        self._first += len(self._log) - len(keep)
        self._log = keep
        epoch = int(msg.epoch)
        first = urgent and self._first_ends(msg.peer_id, epoch, True, epoch if current is None else current)
        self._urgent = self._urgent or first
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="hub")

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            if not self._urgent:
                await asyncio.sleep(period(len(self._peers())))
            self._wake.clear()
            self._urgent = False
            try:
                await self._pass_on()
            except Exception as e:  # the next message wakes us again
                logger.warning("passing stage peers' progress on failed: %r", e)

    async def _pass_on(self) -> None:
        """One call to every peer that lacks some logged message, with what it lacks (at most MAX_PASSED_ON: the
        rest follows at once). Peers that lack the same messages get the same envelope, signed once."""
        peers = dict(self._peers())
        end = self._first + len(self._log)
        self._next = {p: max(n, self._first) for p, n in self._next.items() if p in peers}
        by_start: dict[int, list[str]] = {}
        for peer_id in peers:
            start = self._next.get(peer_id, self._first)
            if start < end:
                by_start.setdefault(start, []).append(peer_id)
        calls = []
        for start, receivers in by_start.items():
            stop = min(start + MAX_PASSED_ON, end)
            envelope = self._seal(self._log[start - self._first : stop - self._first])
            if envelope is None:  # nothing of ours to carry them yet
                return
            self.bytes_sent += envelope.ByteSize() * len(receivers)
            calls += [(p, stop, self._send(p, peers[p], envelope)) for p in receivers]
        self.calls += len(calls)
        acks = await asyncio.gather(*(call for _, _, call in calls))
        for (peer_id, stop, _), ack in zip(calls, acks, strict=True):
            if ack is not None:
                self._next[peer_id] = max(self._next.get(peer_id, 0), stop)
        if any(stop < end for _, stop, _ in calls):
            self._urgent = True
            self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
