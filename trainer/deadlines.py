"""How long the trainer waits for one stage call: long enough for what calls of that kind have been taking, short
enough that a frozen peer (alive, connected, answering nothing) costs a few seconds, not the fixed --request-timeout.

Pure and synchronous: no I/O, no asyncio.
"""

from __future__ import annotations

from collections import deque


class CallDeadlines:
    """Per (stage, method): `factor` x the slowest of the last `window` successful calls, within [floor, cap]; `cap`
    until `warmup` calls have succeeded. Each timeout doubles the next deadline of its kind (up to `cap`), so a slowdown
    of the whole stage (a failed all-reduce, stage 0 holding Forwards while a batch steps) costs one retry, not every
    call; each success halves the extra again. Timed-out calls never enter the window: a frozen peer cannot teach the
    trainer to wait for it."""

    def __init__(self, cap: float, floor: float, factor: float = 4.0, window: int = 64, warmup: int = 8):
        if not 0 < floor <= cap or factor < 1 or window < warmup or warmup < 1:
            raise ValueError(f"bad deadlines: cap {cap}, floor {floor}, factor {factor}, window {window}")
        self.cap, self.floor, self.factor, self.warmup = cap, floor, factor, warmup
        self._seconds: dict[tuple[int, str], deque[float]] = {}
        self._backoff: dict[tuple[int, str], float] = {}
        self._window = window

    def deadline(self, stage: int, method: str) -> float:
        seen = self._seconds.get((stage, method))
        if seen is None or len(seen) < self.warmup:
            return self.cap
        base = max(self.floor, self.factor * max(seen))
        return min(self.cap, base * self._backoff.get((stage, method), 1.0))

    def succeeded(self, stage: int, method: str, seconds: float) -> None:
        key = (stage, method)
        self._seconds.setdefault(key, deque(maxlen=self._window)).append(seconds)
        self._backoff[key] = max(1.0, self._backoff.get(key, 1.0) / 2)

    def timed_out(self, stage: int, method: str) -> None:
        key = (stage, method)
        self._backoff[key] = min(self._backoff.get(key, 1.0) * 2, self.cap / self.floor)
