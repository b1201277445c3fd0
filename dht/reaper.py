"""No orphans: a small watcher process that ends whatever a peer process leaves behind when it dies.

hivemind runs its DHT (and each averager) in a forked child, and that child starts a `p2pd` daemon. When the peer
process dies without shutting them down (SIGKILL, a crash, SIGTERM to a test runner), they are re-parented and run on,
holding ports, the parent's open files and unix sockets in /tmp. A thread inside the forked child cannot watch for
this safely (forking a multithreaded process and adding a thread there crashed hivemind's child), and hivemind offers
no hook to set PR_SET_PDEATHSIG in its children. So `ensure_reaper()` starts this module as a fresh process (exec'd,
not forked; its own session, so a terminal's Ctrl-C and the peer's process group signals do not reach it) that:

- every `SCAN_INTERVAL_S` notes the peer's descendants (pid and start time, so a reused pid is never signalled),
- once the peer is gone, sends them SIGTERM, then SIGKILL to those still alive after `GRACE_S`, removes the unix
  sockets of the p2pd daemons among them and the p2p client sockets that it and they had bound, and exits.

A descendant started less than a scan before the peer died can be missed; hivemind's children start with the peer.
Other reapers among the descendants are left alone: each cleans up after its own peer.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

SCAN_INTERVAL_S = 1.0
GRACE_S = 5.0
_SOCKET = re.compile(rb"-listen=/unix(/\S*/hivemind-p2pd-([A-Za-z0-9_-]+)\.sock)")

_lock = threading.Lock()
_started_for: int | None = None  # the pid whose reaper we started (a forked child is another peer process)


def ensure_reaper() -> None:
    """Starts this process's reaper unless it has one. Cheap after the first call; call it before forking children."""
    global _started_for
    with _lock:
        if _started_for == os.getpid():
            return
        _started_for = os.getpid()
        subprocess.Popen(
            [sys.executable, "-m", "dht.reaper", str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks since boot), from /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces and parentheses
        out[int(name)] = (int(fields[1]), int(fields[19]))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ")
    except OSError:
        return b""


def descendants(root: int, table: dict[int, tuple[int, int]] | None = None) -> dict[int, int]:
    """pid -> start time of every process below `root`, except reapers and what is below them."""
    table = _processes() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if b"-m dht.reaper " in _cmdline(pid):
            continue
        found[pid] = table[pid][1]
        todo += children.get(pid, [])
    return found


def _alive(pid: int, started: int) -> bool:
    """`pid` is still the process that started at `started` and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19]) == started and fields[0] != b"Z"


def _signal_all(tracked: dict[int, int], sig: int) -> None:
    for pid, started in tracked.items():
        if _alive(pid, started):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def daemon_sockets(cmdline: bytes) -> list[str]:
    """The unix sockets of a hivemind p2pd daemon (its own and its Python client's), from its command line."""
    match = _SOCKET.search(cmdline)
    if match is None:
        return []
    path = match.group(1).decode()
    return [path, path.replace("hivemind-p2pd-", "hivemind-p2pclient-")]


_CLIENT = re.compile(r"/hivemind-p2pclient-[A-Za-z0-9_-]+\.sock$")


def client_sockets(pids: list[int]) -> set[str]:
    """The hivemind p2p client sockets (`P2P.replicate`'s, in the peer and in each averager: one per process, named
    apart from its daemon's) that `pids` have bound, from their open files and /proc/net/unix."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed since the listing: the others still count
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    if not inodes:
        return set()
    found = set()
    try:
        with open("/proc/net/unix") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and fields[6] in inodes and _CLIENT.search(fields[7]):
                    found.add(fields[7])
    except OSError:
        pass
    return found


def reap(tracked: dict[int, int], sockets: list[str], grace: float = GRACE_S) -> None:
    """SIGTERM to every tracked process still alive, SIGKILL after `grace` s to those left, then remove `sockets`."""
    _signal_all(tracked, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p, s) for p, s in tracked.items()):
        time.sleep(0.1)
    _signal_all(tracked, signal.SIGKILL)
    for path in sockets:
        try:
            os.remove(path)
        except OSError:
            pass


def watch(parent: int, interval: float = SCAN_INTERVAL_S) -> None:
    """Until `parent` is gone: note its descendants every `interval` s; then `reap` them."""
    table = _processes()
    if parent not in table:
        return
    parent_started = table[parent][1]
    tracked: dict[int, int] = {}
    sockets: set[str] = set()  # of every daemon seen: one that died with the peer may have left its files
    while _alive(parent, parent_started):
        table = _processes()
        tracked = {pid: started for pid, started in tracked.items() if pid in table and table[pid][1] == started}
        for pid, started in descendants(parent, table).items():
            if pid not in tracked:
                tracked[pid] = started
                sockets.update(daemon_sockets(_cmdline(pid)))
        # and the client sockets of hivemind's replicas: removed only by a P2P.shutdown(), which a child ended by a
        # signal never runs (the 2-core machine's /tmp held ~10,000 of them; a test run left ~200)
        sockets.update(client_sockets([parent, *tracked]))
        time.sleep(interval)
    reap(tracked, sorted(sockets))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the peer; we clean up after it
    watch(int(sys.argv[1]))


if __name__ == "__main__":
    main()
