"""swarm-monitor: what it believes of other peers (unit), and the page in a real headless browser against a real
swarm-local, whose Ctrl-C then has to stop every process (both tests share that one swarm)."""

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.request import urlopen

import pytest

from dht.records import PeerEntry, ServerRecord
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import PROTOCOL_VERSION
from swarm.tools.monitor import MAX_TEXT, PeerView, SwarmView, peer_view
from tests.conftest import processes_with_marker, wait_for

SCREENSHOT_ENV = "SWARM_DASHBOARD_PNG"  # also save the browser test's screenshot here (the README's picture)


def entry(peer: str, stage: int, ready: bool = True, host: str = "127.0.0.1") -> PeerEntry:
    return PeerEntry(peer, ServerRecord(host=host, port=4000, stage=stage, throughput=10.0, ready=ready), 0.0)


def info(stage: int, **fields) -> pb.InfoReply:
    base = dict(protocol_version=PROTOCOL_VERSION, stage=stage, epoch=3, samples_processed=100, recent_loss=2.5)
    return pb.InfoReply(**{**base, **fields})


def test_info_replies_are_checked_and_a_bad_one_shows_the_peer_as_not_answering():
    good = peer_view(entry("k1", 1), info(1, traffic=[pb.Traffic(role="activations", wire_bytes=10, fp32_bytes=40)]))
    assert (good.status, good.epoch, good.loss, good.samples) == ("serving", 3, 2.5, 100)
    assert good.traffic["activations"] == (10, 40)
    assert peer_view(entry("k1", 1), info(1, recent_loss=math.nan)).loss is None
    bad = [
        info(1, protocol_version=PROTOCOL_VERSION + 1),
        info(2),  # listed under stage 1, serves stage 2
        info(1, throughput=math.inf),
        info(1, throughput=-1.0),
        info(1, recent_loss=math.inf),
        info(1, recent_loss=-3.0),
        info(1, epoch=-1),
        info(1, samples_processed=2**63 - 1),
        info(1, rounds_failed=-5),
        info(1, traffic=[pb.Traffic(role=f"r{i}", wire_bytes=1, fp32_bytes=1) for i in range(17)]),
        info(1, traffic=[pb.Traffic(role="activations", wire_bytes=-1, fp32_bytes=1)]),
    ]
    for reply in bad:
        view = peer_view(entry("k1", 1), reply)
        assert (view.status, view.epoch, view.loss) == ("no answer", None, None), reply
    assert peer_view(entry("k1", 1), None).status == "no answer"
    assert peer_view(entry("k1", 1, ready=False), None).status == "joining"
    long = peer_view(entry("k1", 1), info(1, compression="x" * 10_000, transport="<b>" * 1000))
    assert len(long.compression) == len(long.transport) == MAX_TEXT
    odd_role = peer_view(entry("k1", 1), info(1, traffic=[pb.Traffic(role="<img src=x>", wire_bytes=1, fp32_bytes=1)]))
    assert set(odd_role.traffic) == {"allreduce_gradients"}, "roles that are not plain names are dropped"


def view(peer: str, stage: int, samples: int, loss: float | None = None, **kw) -> PeerView:
    fields = dict(address="a", status="serving", throughput=1.0, demand=0.0, queue=0, version=0)
    return PeerView(peer_id=peer, stage=stage, samples=samples, loss=loss, **{**fields, **kw})


def test_the_view_keeps_history_events_and_the_bytes_of_peers_that_left():
    v = SwarmView(history=100)
    v.update(0.0, 2, [view("a", 0, 0), view("b", 1, 0, traffic={"activations": (10, 40)})])
    assert v.state()["history"]["t"] == [], "a rate needs two polls"
    v.update(2.0, 2, [view("a", 0, 40), view("b", 1, 40, loss=3.0, traffic={"activations": (20, 80)})])
    v.update(4.0, 2, [view("a", 1, 80), view("c", 1, 10, loss=2.0, rounds_failed=0)])
    v.update(6.0, 2, [view("a", 1, 80, status="no answer"), view("c", 1, 30, loss=1.0, rounds_failed=2)])
    state = v.state()
    assert state["history"]["samples_per_s"] == [20.0, 0.0, 10.0]  # b left; a moved (no rate on its first poll)
    assert state["history"]["loss"] == [3.0, 2.0, 1.0]
    assert state["traffic"] == {"activations": {"wire": 20, "fp32": 80}}, "b's bytes stay after it left"
    kinds = [e["kind"] for e in reversed(state["events"])]
    assert kinds == ["joined", "joined", "moved", "joined", "left", "unreachable", "failed"]
    assert [p["peer_id"] for p in state["stages"][1]["peers"]] == ["a", "c"]
    json.dumps(state)  # what /api/state serves


def _browser():
    """Headless Chromium from the system packages, driven by Selenium; skips with the reason if there is none."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e .[test])")
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no chromium/chromedriver on this machine (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(driver))


@pytest.fixture(scope="module")
def local_swarm(tmp_path_factory):
    """swarm-local with its defaults but 2 stages of 2 servers and 1 trainer, until it has trained: (process, log
    folder, marker). Every process it starts carries the marker; whatever a test leaves running is killed."""
    log_dir = tmp_path_factory.mktemp("swarm-local")
    marker = uuid.uuid4().hex
    args = ["--duration", "0", "--stages", "2", "--servers-per-stage", "2", "--trainers", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarm.tools.local", *args, "--log-dir", str(log_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "SWARM_TEST_MARKER": marker},
        start_new_session=True,
    )
    try:
        stats = log_dir / "trainer-0.json"
        wait_for(lambda: stats.exists() and json.loads(stats.read_text())["steps"] > 0, 150, "training")
        yield proc, log_dir, marker
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid, _ in processes_with_marker(marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_the_dashboard_shows_every_stage_and_peer_and_the_loss_chart_grows(local_swarm, tmp_path):
    proc, log_dir, _ = local_swarm
    url = (log_dir / "monitor.url").read_text()
    browser = _browser()
    try:
        browser.get(url)

        def stage_map() -> list:
            """[(stage, [peer row texts])], read in one script: the page redraws the map every poll, so elements
            found in one call can be gone by the next."""
            return browser.execute_script(
                "return [...document.querySelectorAll('div.stage')].map(s => [s.dataset.stage, "
                "[...s.querySelectorAll('tr.peer')].map(r => r.innerText)])"
            )

        wait_for(lambda: sum(len(rows) for _, rows in stage_map()) == 4, 60, "4 peers on the page")
        shown = stage_map()
        assert [stage for stage, _ in shown] == ["0", "1"]
        assert all(len(rows) == 2 for _, rows in shown)
        assert all("serving" in row for _, rows in shown for row in rows), shown

        def points() -> int:
            return int(browser.execute_script("return document.getElementById('loss-chart').dataset.points"))

        first = wait_for(points, 60, "a first loss point")
        wait_for(lambda: points() >= first + 3, 60, "the loss chart to gain points")
        bars = browser.execute_script("return document.querySelectorAll('#traffic-chart .bars path').length")
        assert bars > 0, "the bytes chart has bars"
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        shot = tmp_path / "dashboard.png"
        browser.save_screenshot(str(shot))
        if os.environ.get(SCREENSHOT_ENV):
            Path(os.environ[SCREENSHOT_ENV]).write_bytes(shot.read_bytes())
    finally:
        browser.quit()
    with urlopen(url + "api/state", timeout=10) as reply:
        api = json.loads(reply.read())
    assert [len(s["peers"]) for s in api["stages"]] == [2, 2]


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_process(local_swarm):
    proc, _, marker = local_swarm
    assert len(processes_with_marker(marker)) >= 8  # launcher, dht, monitor, 4 servers, trainer, their DHT children
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "dashboard: http://127.0.0.1:" in out
    wait_for(lambda: not processes_with_marker(marker), 10, "every process to exit")
