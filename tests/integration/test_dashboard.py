"""swarm-monitor: what it believes of other peers (unit), and swarm-local's Ctrl-C, which has to stop every process it
started. The page itself is tested in a real headless browser against the defaults run (test_integration.py)."""

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import processes_with_marker, wait_for


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_process(tmp_path, marker):
    """swarm-local's Ctrl-C, once every process it starts runs (a small swarm: 2 stages of 1 server, 1 trainer): all
    of them end, and it exits 130 (128 + SIGINT, as a shell reports it). (The dashboard's browser test runs against the defaults run in test_integration.py.)"""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.local", "--duration", "0", "--stages", "2", "--servers-per-stage", "1"]
        + ["--trainers", "1", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        stats = tmp_path / "trainer-0.json"
        wait_for(stats.exists, 90, "the trainer to run")
        # launcher, dht, monitor, 2 servers, trainer, and the DHT child (and its p2pd) of each
        assert len(processes_with_marker(marker)) >= 8
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGINT, out
        assert "dashboard: http://127.0.0.1:" in out
        wait_for(lambda: not processes_with_marker(marker), 10, "every process to exit")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
