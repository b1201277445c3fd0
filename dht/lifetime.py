"""hivemind's child processes (the DHT node's, each averager's) and their p2pd daemons outlive a parent that is killed:
nothing tells them. `exit_with_parent`, called first thing in such a child, watches for that and then stops the
daemons the child started, removes their unix sockets and exits. Linux only (it reads /proc); elsewhere it does
nothing."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

POLL_S = 1.0


def own_daemons(pid: int) -> Iterator[tuple[int, str]]:
    """(pid, unix socket path) of each p2pd daemon whose parent is `pid`."""
    with contextlib.suppress(OSError):
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
        for entry in entries:
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid != pid:
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            for arg in args:
                if arg.startswith(b"-listen=/unix/"):
                    yield int(entry), arg.split(b"=", 1)[1].decode()[len("/unix") :]


def _clean_up_and_exit() -> None:
    for pid, socket in list(own_daemons(os.getpid())):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        # hivemind names a daemon's socket and its client's alike: hivemind-p2pd-X.sock, hivemind-p2pclient-X.sock
        for path in (socket, socket.replace("hivemind-p2pd-", "hivemind-p2pclient-")):
            with contextlib.suppress(OSError):
                os.remove(path)
    os._exit(0)


def exit_with_parent() -> None:
    """In a child process: a daemon thread that, once the parent is gone (we were re-parented), stops our p2pd
    daemons, removes their sockets and ends this process."""
    if not os.path.isdir("/proc"):
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        _clean_up_and_exit()

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
