"""Shared test helpers. Every process a test starts carries SWARM_TEST_MARKER in its environment (inherited by the
DHT child and p2pd too), so a test can prove that nothing it started is still alive."""

import asyncio
import gc
import inspect
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from dht.reaper import ensure_reaper
from swarm.stacks import describe_tasks


def processes_with_marker(marker: str) -> list[tuple[int, str]]:
    found = []
    needle = f"SWARM_TEST_MARKER={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]))
        except OSError:
            continue
    return found


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    """Poll `predicate` until it returns something truthy (returned), or raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def free_port() -> int:
    """A port nothing listens on now, on 127.0.0.1 (for a process that must be told its port in advance)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, list]:
    """The samples of a Prometheus endpoint on 127.0.0.1, parsed by prometheus_client's own parser: family name ->
    [(sample name, labels, value)]."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


@pytest.fixture(autouse=True, scope="session")
def _watcher():
    """The DHT watcher of this process (dht/reaper.py) lives as long as pytest: start it before a test puts its marker
    in the environment, which the watcher would inherit and then outlive the test with."""
    ensure_reaper()


@pytest.fixture
def marker(monkeypatch):
    """A unique marker set in this test's environment; asserts at teardown that no marked process survived."""
    value = uuid.uuid4().hex
    monkeypatch.setenv("SWARM_TEST_MARKER", value)
    yield value
    deadline = time.monotonic() + 15  # torch_shm_manager (hivemind's file_system sharing) exits on its own, shortly
    while (leftovers := processes_with_marker(value)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid, _ in leftovers:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    assert not leftovers, f"processes outlived their test: {leftovers}"


@pytest.fixture(autouse=True)
def _asyncio_tasks_on_timeout(request):
    """pytest-timeout prints every thread's stack, but a coroutine test stuck on an await shows only its event loop
    polling. Shortly before the timeout, print the stack of every pending asyncio task too (found through the garbage
    collector: the timer thread has no handle on the test's loop)."""
    marker = request.node.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 0)
    if not inspect.iscoroutinefunction(request.function) or timeout <= 5:
        yield
        return

    def dump() -> None:
        tasks = [t for t in gc.get_objects() if isinstance(t, asyncio.Task) and not t.done()]
        tasks.sort(key=lambda t: "/tests/" not in getattr(getattr(t.get_coro(), "cr_code", None), "co_filename", ""))
        # to stdout, ahead of the threads pytest-timeout prints there: CI shows the head of a failure's report
        print(f"\n{timeout - 3:.0f}s into {request.node.nodeid}, {describe_tasks(tasks)}", file=sys.stdout)

    timer = threading.Timer(timeout - 3, dump)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


_EXIT_STATUS = [0]


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS[0] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """The run ends when pytest is done, whatever a failed test left behind: a thread of an averager it never shut
    down kept the interpreter alive after the summary once, and CI would have waited for its 90-minute cap. Children
    of such a test die with us (dht/reaper.py)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[0])
