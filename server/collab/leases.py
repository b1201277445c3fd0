"""Stage 0: how long an admitted microbatch may stay away, and how much of a global batch one caller may hold.

Stage 0 admits a global batch and its epoch ends only once every admitted microbatch came back. A trainer that dies
with microbatches in flight, or a hostile caller that takes admissions and never sends their Backwards, would hold
the batch (and so the whole swarm) until --admission-timeout. So each admission is a *lease*:
- it lasts LEASE_FACTOR x the round trips its caller has shown (admission to its Backward at stage 0; the 90th
  percentile of its last ROUND_TRIPS), or, for a caller with none yet, of what the stage's other callers show; at
  least MIN_LEASE_S, at most --admission-timeout. A lease that runs out is released: its samples are admitted again
  (to whoever asks next), and the batch is complete without it;
- while another caller waits for room (it found the open batches full lately), a caller holds at most its share of
  them (split evenly among the callers that asked lately), halved for each of its leases that ran out in the last
  PENALTY_S beyond those of the least penalized caller that waits, less one for each FORGIVEN_AFTER of its
  admissions that came back since: one that takes admissions and walks away gets a microbatch now and then, and
  costs the batch a lease's wait each time, and one that completes two for each it drops does no better
  (`python -m tests.benchmarks.soak_hostile`: such a caller kept its whole share when a completed admission wiped
  its record, and got 22 walk-aways in 5 minutes with a 60 s memory and no forgiving); an honest trainer whose
  microbatches ran out behind a frozen peer earns its share back within a few dozen microbatches. The penalty is
  relative: when a frozen peer made every trainer's leases run out alike, they share the batch evenly (an absolute
  one would hold them all back at once, and nobody would be admitted). With nobody waiting, a caller may take the
  whole batch whatever ran out (a lone trainer whose microbatches were stuck behind a frozen peer must not lock
  itself out).
A Backward that comes after its lease ran out is computed as any late microbatch is; the lease's length (a multiple of
its caller's own slowest round trips) makes that rare.

Pure and synchronous, clock injected (`now` arguments): the collaboration (epoch.py) calls it on the event loop.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

LEASE_FACTOR = 4.0  # a lease lasts this many times its caller's slow round trips
MIN_LEASE_S = 1.0  # what a lease lasts at least: a walk-away costs the batch this long at the least
ROUND_TRIPS = 32  # round trips kept per caller
ACTIVE_S = 10.0  # a caller that asked (or waited) for an admission this recently shares the batch (or waits)
PENALTY_S = 600.0  # a lease that ran out counts against its caller this long, unless it earns it back:
FORGIVEN_AFTER = 16  # ... one of them is forgiven for each so many of its admissions that came back since
MAX_PENALTY = 30  # run-out leases remembered per caller: its share is halved so many times at most
MAX_CALLERS = 1024  # callers remembered (the least recent forgotten first)
MAX_LEASES = 1 << 16


@dataclass(slots=True)
class _Lease:
    caller: str
    batch: int
    samples: int
    granted: float
    until: float


@dataclass(slots=True)
class _Caller:
    round_trips: deque[float]
    asked: float = -math.inf  # when it last asked for an admission
    waited: float = -math.inf  # when it last found the open batches full
    expired: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_PENALTY))  # when its leases ran out
    credit: int = 0  # its admissions that came back since a run-out was last forgiven


class Leases:
    def __init__(self, admission_timeout: float):
        self.admission_timeout = admission_timeout
        self._leases: OrderedDict[tuple, _Lease] = OrderedDict()  # admission key -> its lease
        self._callers: OrderedDict[str, _Caller] = OrderedDict()

    def lease_for(self, caller: str) -> float:
        """Seconds an admission of `caller` may stay away."""
        own = self._callers.get(caller)
        if own is not None and len(own.round_trips) >= 4:
            basis = _p90(own.round_trips)
        else:
            known = [_p90(c.round_trips) for c in self._callers.values() if len(c.round_trips) >= 4]
            basis = statistics.median(known) if known else self.admission_timeout
        return min(max(LEASE_FACTOR * basis, MIN_LEASE_S), self.admission_timeout)

    def share(self, caller: str, quota: int, now: float, n: int = 1) -> int:
        """The samples of the open batches `caller` may hold now, asking for `n` more (see the module)."""
        own = self._callers.get(caller)
        waiting = [c for c in self._callers.values() if c is not own and now - c.waited <= ACTIVE_S]
        if not waiting:
            return quota
        active = sum(1 for c in self._callers.values() if now - c.asked <= ACTIVE_S)
        worse = 0 if own is None else _penalty(own, now) - min(_penalty(c, now) for c in waiting)
        return quota // max(active, 1) >> max(worse, 0)

    def holds(self, caller: str) -> int:
        """Samples of `caller`'s admissions out now."""
        return sum(lease.samples for lease in self._leases.values() if lease.caller == caller)

    def asked(self, caller: str, now: float) -> None:
        self._caller(caller).asked = now

    def waited(self, caller: str, now: float) -> None:
        """`caller` found the open batches full."""
        self._caller(caller).waited = now

    def grant(self, key: tuple, caller: str, batch: int, samples: int, now: float) -> None:
        """`caller` was admitted `samples` into `batch` under admission `key`."""
        self._leases[key] = _Lease(caller, batch, samples, now, now + self.lease_for(caller))
        while len(self._leases) > MAX_LEASES:
            self._leases.popitem(last=False)

    def returned(self, key: tuple, now: float) -> None:
        """The Backward of admission `key` reached stage 0 (here, or at a peer that proved it)."""
        lease = self._leases.pop(key, None)
        if lease is None:
            return
        caller = self._caller(lease.caller)
        caller.round_trips.append(now - lease.granted)
        caller.credit += 1
        if caller.credit >= FORGIVEN_AFTER and caller.expired:
            caller.expired.popleft()
            caller.credit = 0

    def released(self, key: tuple) -> None:
        """Admission `key` failed before it was computed (its Forward): no lease."""
        self._leases.pop(key, None)

    def run_out(self, now: float) -> list[tuple[int, int]]:
        """Leases past their end, removed: [(batch, samples)] to admit again."""
        out = [key for key, lease in self._leases.items() if now >= lease.until]
        gone = []
        for key in out:
            lease = self._leases.pop(key)
            caller = self._caller(lease.caller)
            caller.expired.append(now)
            caller.credit = 0  # what came back before does not pay for it
            gone.append((lease.batch, lease.samples))
        return gone

    def forget_before(self, batch: int) -> None:
        """Leases of batches before `batch` (they stepped) are over."""
        for key in [k for k, lease in self._leases.items() if lease.batch < batch]:
            del self._leases[key]

    def next_end(self) -> float | None:
        """When the next lease runs out (None: no lease)."""
        return min((lease.until for lease in self._leases.values()), default=None)

    def _caller(self, caller: str) -> _Caller:
        c = self._callers.pop(caller, None) or _Caller(deque(maxlen=ROUND_TRIPS))
        self._callers[caller] = c  # the most recent last
        while len(self._callers) > MAX_CALLERS:
            self._callers.popitem(last=False)
        return c


def _penalty(caller: _Caller, now: float) -> int:
    return sum(1 for t in caller.expired if now - t <= PENALTY_S)


def _p90(values: deque[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
