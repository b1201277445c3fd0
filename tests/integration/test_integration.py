"""Real swarms on 127.0.0.1: separate OS processes for the DHT, every server and every trainer."""

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.request import urlopen

import pytest

from tests.conftest import free_port, processes_with_marker, scrape, wait_for
from tools.processes import LocalSwarm

pytestmark = pytest.mark.integration

SCREENSHOT_ENV = "SWARM_DASHBOARD_PNG"  # also save the browser test's screenshot here (the README's picture)
DEFAULTS_DURATION = 120


def trainer_stats(swarm: LocalSwarm) -> dict:
    stats = swarm.trainer_stats()
    return stats[0] if stats else {}


@dataclasses.dataclass
class DefaultsRun:
    proc: subprocess.Popen
    log_dir: Path
    out: Path  # its standard output and error
    summary: Path
    marker: str
    started: float


@pytest.fixture(scope="module")
def defaults_run(tmp_path_factory):
    """The README's first command, swarm-local with its defaults, for DEFAULTS_DURATION of its 180 s: the dashboard
    test looks at it while it trains, the defaults test at how it ended. Every process it starts carries the marker;
    whatever is left when the module ends is killed."""
    folder = tmp_path_factory.mktemp("swarm-local-defaults")
    marker, log_dir, summary, out_path = uuid.uuid4().hex, folder / "logs", folder / "summary.json", folder / "out.txt"
    started = time.monotonic()
    with out_path.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.local", "--duration", str(DEFAULTS_DURATION)]
            + ["--summary-json", str(summary), "--log-dir", str(log_dir)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SWARM_TEST_MARKER": marker},
            start_new_session=True,
        )
    run = DefaultsRun(proc, log_dir, out_path, summary, marker, started)
    try:
        yield run
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait(10)
        for pid, _ in processes_with_marker(marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


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


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_the_dashboard_shows_every_stage_and_peer_and_the_loss_chart_grows(defaults_run, tmp_path):
    """The page swarm-local's dashboard serves, in headless Chromium, while the defaults run trains: its 3 stages of
    2 serving peers each, a loss chart that grows, the bytes chart, no errors in the browser's console."""
    url_file = defaults_run.log_dir / "monitor.url"
    wait_for(url_file.exists, 90, "swarm-local's dashboard")
    url = url_file.read_text()
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

        wait_for(lambda: sum(len(rows) for _, rows in stage_map()) == 6, 90, "6 peers on the page")
        shown = stage_map()
        assert [stage for stage, _ in shown] == ["0", "1", "2"]
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
    assert [len(s["peers"]) for s in api["stages"]] == [2, 2, 2]
    assert defaults_run.proc.poll() is None, "the run ended before the page was seen whole"


@pytest.mark.timeout(420)
def test_swarm_local_defaults_train_and_leave_nothing(defaults_run):
    """The README's first command: with defaults on 2 cores, loss falls to <= 60% of initial within 5 minutes. It
    trains for 2 of its 3 minutes here to keep CI short: on the 2-core VM the defaults reached 52% of the initial loss
    at 120 s and 44% at 183 s (5.135 -> 2.281, 20.9 samples/s). The dashboard test watched it meanwhile."""
    run = defaults_run
    try:
        run.proc.wait(timeout=max(1.0, run.started + 300 - time.monotonic()))
    finally:
        wall = time.monotonic() - run.started
        print(run.out.read_text()[-3000:])
    assert run.proc.returncode == 0
    summary = json.loads(run.summary.read_text())
    print(
        f"wall {wall:.0f}s: loss {summary['initial_loss']:.3f} -> {summary['final_loss']:.3f}, "
        f"{summary['samples_per_second']:.1f} samples/s, fp32/wire {summary['fp32_bytes'] / summary['wire_bytes']:.2f}"
    )
    for key in ("steps", "samples", "initial_loss", "final_loss", "samples_per_second", "wire_bytes", "fp32_bytes"):
        assert key in summary
    assert wall < 300
    assert summary["final_loss"] <= 0.6 * summary["initial_loss"]
    assert summary["lost_microbatches"] == 0
    assert summary["fp32_bytes"] / summary["wire_bytes"] >= 3.5
    # the launcher has exited; the DHT watchers (dht/reaper.py) notice within a scan and exit
    wait_for(lambda: not processes_with_marker(run.marker), 10, "every process swarm-local started to exit")


def longest_stall(swarm: LocalSwarm, seconds: float) -> tuple[float, int]:
    """Watch the trainer for `seconds`: (the longest time without a finished microbatch, microbatches finished)."""
    started = last_change = time.monotonic()
    steps = first = trainer_stats(swarm)["steps"]
    longest = 0.0
    while (now := time.monotonic()) - started < seconds:
        current = trainer_stats(swarm).get("steps", steps)
        if current != steps:
            steps, last_change = current, now
        longest = max(longest, now - last_change)
        time.sleep(0.2)
    return longest, steps - first


def check_scrapes(server: dict, trainer: dict) -> None:
    """A last-stage server's and a trainer's Prometheus metrics, as parsed, after >= 20 microbatches of 4 samples."""

    def value(metrics: dict, family: str, **labels) -> float:
        found = [v for name, ls, v in metrics[family] if not name.endswith("_created") and labels.items() <= ls.items()]
        assert len(found) == 1, (family, labels, metrics.get(family))
        return found[0]

    assert value(server, "swarm_server_stage") == 2
    assert value(server, "swarm_server_state", state="serving") == 1
    assert value(server, "swarm_server_samples") > 0
    assert value(server, "swarm_server_throughput_samples_per_second") > 0
    assert 0 < value(server, "swarm_server_loss") < 10
    assert value(server, "swarm_server_pipeline_bytes", role="activations", form="wire") > 0
    assert value(server, "swarm_server_pipeline_bytes", role="activations", form="fp32") > value(
        server, "swarm_server_pipeline_bytes", role="activations", form="wire"
    )
    grads = {
        form: value(server, "swarm_server_pipeline_bytes", role="activation_gradients", form=form)
        for form in ("wire", "fp32")
    }
    assert grads["fp32"] / grads["wire"] > 5, "the last stage's grad_inputs travel low-rank (6.4x at rank 8 here)"
    assert value(trainer, "swarm_trainer_microbatches") >= 20
    assert value(trainer, "swarm_trainer_samples") >= 80
    assert value(trainer, "swarm_trainer_lost_microbatches") == 0
    assert 0 < value(trainer, "swarm_trainer_loss") < 10
    for stage in range(3):
        assert value(trainer, "swarm_trainer_stage_peers", stage=str(stage)) == 2
    sent = value(trainer, "swarm_trainer_pipeline_bytes", role="activations", form="wire")
    assert 3 < value(trainer, "swarm_trainer_pipeline_bytes", role="activations", form="fp32") / sent < 4.5


@pytest.mark.timeout(300)
def test_a_killed_server_and_a_frozen_one_lose_no_microbatch(tmp_path, marker):
    """SIGKILL of one stage-1 server: nothing lost. Then SIGSTOP of one stage-2 server for 20 s (alive, connected,
    answering nothing), then SIGCONT: nothing lost, and training goes on. The stall is printed, not asserted: pings
    and call deadlines move work off the frozen peer, its stage peer leaves it out of the all-reduce, but hivemind's
    DHT waits for the frozen peer's DHT node, and that stall varies from run to run (7.8 s to 19 s measured).
    The model has maxout boundaries and activation gradients travel low-rank, as servers' error memories keep them."""
    # compression-aware boundaries and low-rank gradients with their error memories, under churn
    model = [
        "--preset",
        "local_debug",
        "--n-stages",
        "3",
        "--d-model",
        "64",
        "--max-seq-len",
        "64",
        "--boundary",
        "maxout",
    ]
    server_port, trainer_port = free_port(), free_port()
    with LocalSwarm(tmp_path, "killtest", model) as swarm:
        swarm.start_dht()
        for stage in range(3):
            for r in range(2):
                metrics = ["--metrics-port", str(server_port)] if (stage, r) == (2, 1) else []
                swarm.start_server(f"server-s{stage}-r{r}", stage, ["--samples-per-step", "16", *metrics])
        trainer_flags = ["--batch-size", "4", "--in-flight", "4", "--min-request-timeout", "5"]
        trainer_flags += ["--backward-codec", "lowrank8"]
        swarm.start_trainer("trainer-0", [*trainer_flags, "--metrics-port", str(trainer_port)])
        wait_for(lambda: trainer_stats(swarm).get("steps", 0) >= 20, 150, "20 microbatches")
        check_scrapes(scrape(server_port), scrape(trainer_port))
        victim = swarm.children["server-s1-r0"]
        victim.signal_group(signal.SIGKILL)  # the machine vanishes: server, its DHT child and p2pd at once
        victim.proc.wait(10)
        steps_at_kill = trainer_stats(swarm)["steps"]
        wait_for(lambda: trainer_stats(swarm).get("steps", 0) >= steps_at_kill + 40, 120, "40 more microbatches")
        after_kill = trainer_stats(swarm)
        assert after_kill["peers_per_stage"][1] == 1, "the killed peer must be banned or expired"

        deadline = max(d["Backward"] for d in trainer_stats(swarm)["call_deadlines_s"])
        frozen = swarm.children["server-s2-r0"]
        frozen.signal_group(signal.SIGSTOP)
        try:
            stall, during = longest_stall(swarm, 20.0)
        finally:
            frozen.signal_group(signal.SIGCONT)
        steps_at_thaw = trainer_stats(swarm)["steps"]
        wait_for(lambda: trainer_stats(swarm).get("steps", 0) >= steps_at_thaw + 20, 120, "20 more microbatches")
        swarm.stop(["trainer-0"])
        final = trainer_stats(swarm)
        summary = {
            k: final[k] for k in ("steps", "lost_microbatches", "retries", "peers_per_stage", "call_deadlines_s")
        }
        print(json.dumps(summary))
        print(f"frozen 20 s: longest stall {stall:.1f}s, {during} microbatches meanwhile, deadline before {deadline}s")
        assert final["lost_microbatches"] == 0
        assert "Traceback" not in (tmp_path / "trainer-0.log").read_text()
