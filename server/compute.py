"""The thread that owns a stage's module and optimizer, and the clock of its work.

`ComputeThread` runs every job on the module in one thread, requests in arrival order and control jobs (ending an
epoch, loading a state) before any waiting request. `Timing` measures the work it runs (seconds per sample of each
kind, an EMA) and, with `--slowdown`, stretches it to emulate a slower device.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from swarm.devices import synchronize

R = TypeVar("R")


class DeadlineExpired(Exception):
    """The caller's deadline passed while the request waited in the queue: nothing was computed."""


class ComputeThread:
    """The one thread that runs every job on a stage's module and optimizer. Requests run in arrival order; control
    jobs (ending an epoch, loading a state) run before any request still waiting, so that an epoch holds the
    gradients of exactly the backwards that ran before it ended, not of a burst queued behind its end."""

    def __init__(self, name: str):
        self._ready = threading.Condition()
        self._control: deque[tuple[Future, Callable[[], Any]]] = deque()
        self._requests: deque[tuple[Future, Callable[[], Any]]] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], R], control: bool) -> Future[R]:
        future: Future[R] = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the stage's compute thread is shut down")
            (self._control if control else self._requests).append((future, fn))
            self._ready.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._ready:
                while not (self._control or self._requests or self._closed):
                    self._ready.wait()
                if not (self._control or self._requests):
                    return
                future, fn = (self._control or self._requests).popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)

    def shutdown(self) -> None:
        """Cancels jobs that have not started; waits for the running one."""
        with self._ready:
            self._closed = True
            for future, _ in (*self._control, *self._requests):
                future.cancel()
            self._control.clear()
            self._requests.clear()
            self._ready.notify()
        self._thread.join()


class Timing:
    """Compute thread only, but for `seconds_per_sample`'s readers. The seconds per sample of each kind of work
    ("forward", "backward"), an EMA over the work `timed` measured."""

    def __init__(self, device: torch.device, slowdown: float):
        self.device, self.slowdown = device, slowdown
        self.seconds_per_sample: dict[str, float] = {}  # EMA per kind of work
        self._fastest: dict[tuple[str, int], float] = {}  # (kind, samples) -> least seconds seen, for --slowdown

    @contextlib.contextmanager
    def timed(self, kind: str, n_samples: int) -> Iterator[None]:
        """Times one forward or backward of `n_samples` samples into the EMA.

        `--slowdown` s > 1 emulates a device s times slower than this one running alone: the work is made to last
        s x the least time this worker has taken for the same (kind, n_samples) so far, by sleeping the difference
        between that and the actual elapsed time (never negative). CPU contention only lengthens elapsed times, so the
        running minimum, and with it the emulated time, does not move with the load of other processes; sleeping,
        not computing, leaves the CPU to them, as a slower device on another machine would. The EMA records the
        emulated time even where contention made the work itself longer: the emulated device's speed does not depend
        on what else runs on this machine (the rebalancer must not chase the 2-core test machine's scheduling noise).
        s = 1 never sleeps.
        """
        start = time.perf_counter()
        yield
        synchronize(self.device)  # kernels run asynchronously: time them, not their launches
        elapsed = time.perf_counter() - start
        if self.slowdown > 1.0:
            key = (kind, n_samples)
            fastest = self._fastest[key] = min(elapsed, self._fastest.get(key, elapsed))
            emulated = self.slowdown * fastest
            if emulated > elapsed:
                time.sleep(emulated - elapsed)
            elapsed = emulated
        per_sample = elapsed / max(n_samples, 1)
        old = self.seconds_per_sample.get(kind)
        self.seconds_per_sample[kind] = per_sample if old is None else 0.9 * old + 0.1 * per_sample
