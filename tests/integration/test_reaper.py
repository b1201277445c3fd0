"""No orphans: what a peer process started (hivemind's DHT child, its p2pd daemon, their sockets) ends with it."""

import contextlib
import glob
import os
import signal
import subprocess
import sys
import threading
import time

import hivemind
import pytest
import torch

from dht import node
from dht.forking import forking
from dht.reaper import _alive, _cmdline, _processes, client_sockets, daemon_sockets, descendants
from server.collab.compat.averager import StrictAverager
from tests.conftest import free_port, wait_for

PEER = """
import asyncio, os, sys
from dht.node import start_dht
dht = start_dht()

async def main():
    replica = await dht.replicate_p2p()  # a client socket of its own once it serves, as the peer's and each averager's
    async def handle(*args):
        pass
    await replica.add_binary_stream_handler("x", handle)
    print(dht.pid, flush=True)
    print(replica._client_listen_maddr["unix"], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    os._exit(0)  # no shutdown, no atexit: what a crash leaves

asyncio.run(main())
"""


def _is_daemon(pid: int) -> bool:
    return b"hivemind_cli/p2pd " in _cmdline(pid)


def _stat(pid: int) -> tuple[int, int] | None:
    return _processes().get(pid)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("end", ["SIGKILL", "exit"])
def test_a_dead_peer_takes_its_dht_child_p2pd_and_sockets_along(end):
    """Without the reaper, hivemind's DHT child and p2pd stayed alive for good after their parent's SIGKILL."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        child = int(parent.stdout.readline())
        replica_socket = parent.stdout.readline().strip()
        assert os.path.exists(replica_socket)
        below = wait_for(lambda: (d := descendants(parent.pid)) and any(map(_is_daemon, d)) and d, 30, "p2pd")
        assert not any(b"dht.reaper" in _cmdline(p) for p in below), "the reaper is not among what it reaps"
        (daemon,) = filter(_is_daemon, below)
        assert child in below
        sockets = daemon_sockets(_cmdline(daemon))
        assert os.path.exists(sockets[0])
        reaper = next(
            p for p, (ppid, _) in _processes().items() if ppid == parent.pid and b"-m dht.reaper " in _cmdline(p)
        )
        reaper_started = _stat(reaper)[1]
        time.sleep(1.5)  # a scan of the reaper's has seen them
        if end == "SIGKILL":
            parent.kill()
        else:
            parent.stdin.write("exit\n")
            parent.stdin.flush()
        parent.wait(10)
        wait_for(lambda: not any(_alive(p, s) for p, s in below.items()), 20, "the DHT child and p2pd to exit")
        wait_for(lambda: not _alive(reaper, reaper_started), 10, "the reaper to exit")
        assert not any(os.path.exists(path) for path in sockets)
        assert not os.path.exists(replica_socket), "the replica's client socket (P2P.replicate) is removed too"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(10)


def _hang_first(tmp_path, times: int):
    """hivemind.DHT.run, except that the first `times` children (forked: they run the patched class) never get ready:
    how a child forked from a multithreaded process hangs. Each writes its pid to a file first."""
    run = hivemind.DHT.run

    def run_or_hang(self):
        hung = sorted(tmp_path.glob("hung-*"))
        if len(hung) < times:
            (tmp_path / f"hung-{len(hung)}").write_text(str(os.getpid()))
            time.sleep(600)
        run(self)

    return run_or_hang


def _gone(tmp_path) -> bool:
    return all(not os.path.exists(f"/proc/{p.read_text()}") for p in tmp_path.glob("hung-*"))


def test_a_dht_child_that_hangs_before_it_is_ready_is_killed_and_started_again(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(hivemind.DHT, "run", _hang_first(tmp_path, 1))
    monkeypatch.setattr(node, "START_TIMEOUT_S", 2.0)
    with caplog.at_level("WARNING", logger="dht.node"):
        dht = node.start_dht()
    try:
        assert dht.is_alive() and len(list(tmp_path.glob("hung-*"))) == 1
        assert "the DHT node did not start within 2s (attempt 1)" in caplog.text
        assert _gone(tmp_path)
    finally:
        dht.shutdown()


def test_a_dht_child_that_never_gets_ready_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(hivemind.DHT, "run", _hang_first(tmp_path, node.START_ATTEMPTS))
    monkeypatch.setattr(node, "START_TIMEOUT_S", 1.0)
    with pytest.raises(RuntimeError, match=f"did not start within 1s, {node.START_ATTEMPTS} times"):
        node.start_dht()
    assert _gone(tmp_path)


def test_a_bootstrap_peer_that_answers_late_is_asked_again_and_one_that_never_does_is_a_clear_error(tmp_path, caplog):
    """A bootstrap node that is down for a moment (starting, restarting, loaded) when a peer starts: the peer asks it
    again 2 s later instead of exiting. One that never answers: the clear error, after 3 starts."""
    key, port = str(tmp_path / "boot.key"), free_port()
    boot = node.start_dht(identity_path=key, port=port)  # writes its libp2p key: the same peer id again below
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    boot.shutdown()
    started: list = []
    later = threading.Timer(1.0, lambda: started.append(node.start_dht(identity_path=key, port=port)))
    later.start()
    try:
        with caplog.at_level("WARNING", logger="dht.node"):
            peer = node.start_dht(maddrs)
        peer.shutdown()
        assert "no DHT peer of --initial-peers answered (attempt 1); asking again in 2s" in caplog.text
    finally:
        later.join()
        for dht in started:
            dht.shutdown()
    began, before = time.monotonic(), set(glob.glob("/tmp/hivemind-p2pd-*.sock"))
    with pytest.raises(RuntimeError, match="no DHT peer of --initial-peers answered, 3 times"):
        node.start_dht(maddrs)  # nobody there now
    assert time.monotonic() - began >= sum(node.BOOTSTRAP_PAUSES_S)
    # each start's daemon bound its socket and exited; hivemind leaves the socket (node.py removes it)
    assert not set(glob.glob("/tmp/hivemind-p2pd-*.sock")) - before


@pytest.mark.timeout(60)
def test_an_averager_that_ends_removes_its_client_socket():
    """hivemind's averager talks to its DHT's daemon through a handle of its own (`P2P.replicate`, a unix socket in
    /tmp that only the handle's shutdown removes) and never shuts that handle down. StrictAverager's process removes
    it as it ends."""
    dht = node.start_dht()
    try:
        averager = StrictAverager(averaged_tensors=[torch.zeros(4)], dht=dht, prefix="sockets", start=False)
        with forking():  # the child must not finalize what earlier tests left in this process (dht/forking.py)
            averager.run_in_background(await_ready=True)
        try:  # its own: not those it inherited from this process
            sockets: set[str] = set()

            def bound() -> bool:
                sockets.update(client_sockets([averager.pid]) - client_sockets([os.getpid()]))
                return bool(sockets)

            wait_for(bound, 10, "the averager's client socket")
            assert len(sockets) == 1 and all(map(os.path.exists, sockets)), sockets
        finally:
            averager.shutdown()
        averager.join(10)
        assert not averager.is_alive()
        wait_for(lambda: not any(map(os.path.exists, sockets)), 5, "the averager's socket to be removed")
    finally:
        dht.shutdown()
