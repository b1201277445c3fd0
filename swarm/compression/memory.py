"""What a stateful codec remembers between tensors: compression errors (lazy error propagation) and warm starts.

The memory belongs to the sender (a server, for the gradients it computes) and is passed to the codec through
`CodecContext.memory`. Errors are kept per stream (role, key, shape) *and* global batch: the error of one microbatch's
compression is added to the next microbatch of the same stream before it is compressed (Optimus-CC §5, lazy error
propagation), and never crosses an optimizer step, because a later batch's parameters differ. Warm starts (a
low-rank codec's last query) carry across batches: they are only a starting point, never part of the value sent.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

StreamKey = tuple[str, str, tuple[int, ...]]  # role, key, shape


class ErrorMemory:
    """Errors and warm starts of at most `max_streams` streams each (least recently used dropped first), so a sender's
    memory is bounded whatever shapes its callers send. Any thread may use it: one lock guards everything."""

    def __init__(self, max_streams: int = 8):
        self.max_streams = max_streams
        self._errors: OrderedDict[StreamKey, tuple[int, torch.Tensor]] = OrderedDict()
        self._warm: OrderedDict[StreamKey, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.carried = 0  # errors added to a later tensor of their batch
        self.dropped = 0  # errors left behind when their batch ended (or evicted)

    def take_error(self, stream: StreamKey, batch: int) -> torch.Tensor | None:
        """The error left by the last tensor of `stream` in global batch `batch`, removed from the memory; None if
        there is none (an error of an earlier batch is dropped)."""
        with self._lock:
            kept = self._errors.pop(stream, None)
            if kept is None:
                return None
            if kept[0] != batch:
                self.dropped += 1
                return None
            self.carried += 1
            return kept[1]

    def put_error(self, stream: StreamKey, batch: int, error: torch.Tensor) -> None:
        with self._lock:
            if self._errors.pop(stream, None) is not None:
                self.dropped += 1  # two tensors of one stream compressed at once: the other's error is lost
            self._errors[stream] = (batch, error)
            while len(self._errors) > self.max_streams:
                self._errors.popitem(last=False)
                self.dropped += 1

    def warm_start(self, stream: StreamKey) -> torch.Tensor | None:
        with self._lock:
            q = self._warm.get(stream)
            if q is not None:
                self._warm.move_to_end(stream)
            return q

    def put_warm_start(self, stream: StreamKey, q: torch.Tensor) -> None:
        with self._lock:
            self._warm[stream] = q
            self._warm.move_to_end(stream)
            while len(self._warm) > self.max_streams:
                self._warm.popitem(last=False)

    def held_bytes(self) -> int:
        with self._lock:
            tensors = [e for _, e in self._errors.values()] + list(self._warm.values())
        return sum(t.numel() * t.element_size() for t in tensors)
