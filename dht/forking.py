"""Forking a process that has run gRPC: hivemind's DHT node and averagers are forked children of our peer process.

A forked child inherits a copy of every Python object of its parent, the gRPC channels, calls and servers of our
stage RPC included. When the child's garbage collector frees those copies, gRPC's finalizers run in a process where
gRPC was never set up: seen in CI, an averager's child spun at 100% CPU for minutes inside such a finalizer (called
from `gc_collect_main`), so the stage's all-reduces failed and the test hung. The child never uses them; it must
never collect them either. `gc.freeze()` right before the fork moves every object the parent has to a generation
the collector ignores, in the child for good (it never unfreezes) and in the parent until `gc.unfreeze()` right
after: the fix Python's documentation of `gc.freeze` describes for forked workers.

A child also inherits its parent's signal handlers. Ours turn SIGTERM and SIGINT into "stop the event loop" (an
`asyncio` handler, or `swarm-dht`'s Event), which in the child stops nothing: a DHT child that got the SIGTERM meant
for its process group, and then the SIGTERM of hivemind's own `shutdown`, ignored both, and its parent waited for it
forever. On the main thread (the only one that may set handlers) the fork happens with the default handlers, so the
child dies of those signals; the parent's come back right after.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_lock = threading.Lock()  # one fork at a time: another thread's unfreeze must not land between our freeze and fork


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Wrap the call that forks (hivemind's `DHT(start=True)`, `run_in_background`) in this."""
    with _lock:
        main = threading.current_thread() is threading.main_thread()
        handlers = {sig: signal.signal(sig, signal.SIG_DFL) for sig in STOP_SIGNALS} if main else {}
        settled = gc.get_freeze_count() > 0  # frozen for good (server/heap.py `settle`): stays frozen
        gc.freeze()
        try:
            yield
        finally:
            if not settled:
                gc.unfreeze()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
