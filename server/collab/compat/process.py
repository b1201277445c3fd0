"""An averager's process: forked without losing our SIGINT handler (start_in_background), and ended without leaving
its handle on the DHT's daemon behind (ClosesReplica, the base of every averager of ours)."""

from __future__ import annotations

import signal

from hivemind.averaging import DecentralizedAverager

from dht.forking import forking
from server.collab.compat import install


def start_in_background(averager: DecentralizedAverager) -> None:
    """Fork the averager's process (frozen: dht/forking.py) without losing our SIGINT handler (hivemind sets it to
    "ignore")."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        with forking():  # the child must not finalize our gRPC objects (dht/forking.py)
            averager.run_in_background(await_ready=False)
    finally:
        signal.signal(signal.SIGINT, handler)


class ClosesReplica(DecentralizedAverager):
    """A DecentralizedAverager whose process, as it ends, closes its handle on the DHT's daemon (a `P2P.replicate`
    that hivemind never closes: each averager that ended left its unix socket in /tmp)."""

    def __init__(self, *args, **kwargs):
        install()  # before the process forks: it, and this one, encode and decode through hivemind's codec table
        super().__init__(*args, **kwargs)

    async def _shutdown(self, timeout: float | None) -> None:
        """The averager's process: hivemind's shutdown, then the replica's (which closes our client and removes its
        socket, not the daemon: that is the DHT's)."""
        try:
            await super()._shutdown(timeout)
        finally:
            p2p = getattr(self, "_p2p", None)
            if p2p is not None:
                await p2p.shutdown()
