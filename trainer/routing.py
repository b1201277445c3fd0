"""Trainer-side stochastic wiring for one stage: interleaved weighted round-robin (IWRR) over the stage's peers.

Each peer has a *virtual finish time* (its key). ``choose`` picks the available peer with the smallest key and
charges it ``task_size × ema``, where ``ema`` is an exponential moving average of the seconds per sample the trainer
observed from that peer. In steady state every peer's key advances at the same rate, so each peer receives work in
proportion to ``1 / ema``, i.e. to its measured throughput. Keys are virtual (not wall-clock), so only their order and
differences matter; a peer that joins or returns from a ban starts at the current minimum key so that it is probed
soon but cannot catch up on a backlog of "missed" work and get flooded.

Pure and synchronous: no I/O, no asyncio. Peer expirations come from DHT records, so ``clock`` must read the same time
base as they do (``hivemind.get_dht_time`` is ``time.time``).
"""

import dataclasses
import statistics
import time
from collections.abc import Callable, Collection, Mapping


@dataclasses.dataclass(slots=True)
class _Peer:
    expiration: float  # expiration time of the peer's latest DHT record
    key: float  # virtual finish time; only compared with other peers' keys
    ema: float | None  # seconds per sample; None until anything is known about this stage's speed
    measured: bool = False  # False while ema is only a prior borrowed from other peers
    chosen: int = 0
    last_chosen: int = -1  # sequence number of the latest choice; breaks ties least-recently-chosen first


class StageRouter:
    """IWRR router for the peers of one stage.

    Invariants: ``available`` holds exactly the peers listed by the last ``update_peers`` whose record has not expired
    and that are not banned; ``choose`` returns only such peers; a ban on a peer lifts only when the peer is listed
    with an expiration newer than the one it had when banned (it re-announced), even if it vanished meanwhile, and
    not before ``min_ban_s`` x 2^(k-1) seconds (at most ``max_ban_s``) after its k-th failure in a row: a record
    re-stored every few seconds for a server that never answers (or answers garbage) draws a few calls a minute,
    not one per re-store. A success resets k; failures reported while a ban stands do not count.
    """

    def __init__(
        self,
        alpha: float = 0.1,
        timeout_penalty: float = 2.0,
        clock: Callable[[], float] = time.time,
        min_ban_s: float = 1.0,
        max_ban_s: float = 60.0,
    ):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if timeout_penalty < 1.0:
            raise ValueError(
                f"timeout_penalty must be >= 1 (a timeout never makes a peer look faster), got {timeout_penalty}"
            )
        self.alpha, self.timeout_penalty, self.clock = alpha, timeout_penalty, clock
        self.min_ban_s, self.max_ban_s = min_ban_s, max_ban_s
        self._peers: dict[str, _Peer] = {}
        self._bans: dict[str, tuple[float, float]] = {}  # peer_id -> (its record's expiration when banned, until)
        self._strikes: dict[str, int] = {}  # peer_id -> failures since its last success
        self._choices = 0

    def update_peers(self, peers: Mapping[str, float]) -> None:
        """Replace the peer set with ``peers`` (peer_id -> expiration of its current DHT record).

        A peer that becomes available (new, unbanned, or re-listed after its record expired) starts at the minimum key
        of the peers that stay available: it is chosen soon, but its stale or zero key cannot pull in a flood of work.
        A new peer's EMA prior is the median of the measured EMAs (None while nothing is measured)."""
        before = set(self.available)
        for peer_id in self._peers.keys() - peers.keys():
            del self._peers[peer_id]
        now = self.clock()
        # a ban outlives the peer's disappearance, but once the banned record expired any listing of it is newer
        self._bans = {
            i: (exp, until)
            for i, (exp, until) in self._bans.items()
            if now < until or (peers[i] <= exp if i in peers else exp > now)
        }
        self._strikes = {i: k for i, k in self._strikes.items() if i in peers or i in self._bans}
        measured = [p.ema for p in self._peers.values() if p.measured and p.ema is not None]
        prior = statistics.median(measured) if measured else None
        added = peers.keys() - self._peers.keys()
        for peer_id, expiration in peers.items():
            if peer_id in added:
                self._peers[peer_id] = _Peer(expiration=expiration, key=0.0, ema=prior)
            self._peers[peer_id].expiration = expiration
        live = dict(self._live_items())
        entering = [i for i in live if i not in before]
        steady = [p.key for i, p in live.items() if i in before]
        floor = min(steady) if steady else min((live[i].key for i in entering if i not in added), default=0.0)
        for peer_id in (*entering, *added):
            self._peers[peer_id].key = floor

    def choose(self, task_size: int, exclude: Collection[str] = (), prefer: str | None = None) -> str | None:
        """Peer with the smallest key among available, non-excluded peers (ties: least recently chosen); charge it
        ``task_size × ema``. None when no peer is available. `prefer`: that peer if it is available and not
        excluded, whatever its key (a Backward goes to the peer that served its Forward: trainer.py)."""
        if task_size <= 0:
            raise ValueError(f"task_size must be positive, got {task_size}")
        candidates = [(p.key, p.last_chosen, peer_id) for peer_id, p in self._live_items() if peer_id not in exclude]
        if not candidates:
            return None
        peer_id = next((c[2] for c in candidates if c[2] == prefer), None) or min(candidates)[2]
        peer = self._peers[peer_id]
        peer.key += task_size * self._cost(peer)
        peer.chosen += 1
        peer.last_chosen, self._choices = self._choices, self._choices + 1
        return peer_id

    def report_success(self, peer_id: str, task_size: int, seconds: float) -> None:
        """Fold ``seconds / task_size`` into the peer's EMA; the first measurement replaces the borrowed prior.
        Reports about peers that are no longer listed are ignored (they may vanish while a task is in flight)."""
        if task_size <= 0 or seconds < 0:
            raise ValueError(f"need task_size > 0 and seconds >= 0, got {task_size=}, {seconds=}")
        if (peer := self._peers.get(peer_id)) is None:
            return
        self._strikes.pop(peer_id, None)
        per_sample = seconds / task_size
        if peer.measured and peer.ema is not None:
            peer.ema = (1.0 - self.alpha) * peer.ema + self.alpha * per_sample
        else:
            peer.ema, peer.measured = per_sample, True

    def report_failure(self, peer_id: str, timed_out: bool = False) -> None:
        """Ban the peer until it re-announces, and for at least its ban's minimum (see the class); a timeout also
        multiplies its EMA by ``timeout_penalty``. A banned peer is chosen for no call: a failure reported while its
        ban stands is of a call that was in flight when it began, the same outage, and counts nothing more (three
        microbatches in flight on a peer behind NAT whose relay slot was not yet reserved made three strikes at once,
        and two such rounds kept the trainer away from it for 32 s)."""
        if (peer := self._peers.get(peer_id)) is None or peer_id in self._bans:
            return
        strikes = self._strikes[peer_id] = self._strikes.get(peer_id, 0) + 1
        hold = min(self.max_ban_s, self.min_ban_s * 2 ** min(strikes - 1, 32))
        self._bans[peer_id] = (peer.expiration, self.clock() + hold)
        if timed_out and peer.ema is not None:
            peer.ema *= self.timeout_penalty

    def forgive(self, peer_id: str, max_strikes: int = 2) -> bool:
        """Lift the ban of a peer that timed out but proved alive since (it was busy, not gone), unless it has failed
        more than `max_strikes` times in a row: one that answers probes but never serves stays banned. Its strikes
        and EMA penalty stay. Returns whether the ban was lifted."""
        if peer_id not in self._bans or self._strikes.get(peer_id, 0) > max_strikes:
            return False
        del self._bans[peer_id]
        if (peer := self._peers.get(peer_id)) is not None:
            live = [p.key for i, p in self._live_items() if i != peer_id]
            peer.key = max(peer.key, min(live, default=peer.key))  # back at the current minimum, like a returning peer
        return True

    @property
    def available(self) -> list[str]:
        """Listed, unexpired, unbanned peers."""
        return [peer_id for peer_id, _ in self._live_items()]

    def snapshot(self) -> dict[str, dict[str, float | int | bool | None]]:
        """Per-peer state for logs and stats: ema (s/sample), key, banned, chosen, expiration."""
        return {
            peer_id: dict(ema=p.ema, key=p.key, banned=peer_id in self._bans, chosen=p.chosen, expiration=p.expiration)
            for peer_id, p in self._peers.items()
        }

    def _live_items(self) -> list[tuple[str, _Peer]]:
        now = self.clock()
        return [(i, p) for i, p in self._peers.items() if i not in self._bans and p.expiration > now]

    def _cost(self, peer: _Peer) -> float:
        """Seconds per sample to charge. An unknown peer is assumed as fast as the fastest known one, so it is probed;
        while nothing is known at all every charge is 0 and the least-recently-chosen tie-break makes it round-robin."""
        if peer.ema is not None:
            return peer.ema
        return min((p.ema for p in self._peers.values() if p.ema is not None), default=0.0)
