"""What a stuck process is doing (swarm/stacks.py), and what a failed local swarm tells the CI log
(LocalSwarm.__exit__): real processes, real signals."""

import pytest

from tests.conftest import wait_for
from tools.processes import LocalSwarm


def test_a_failure_inside_a_local_swarm_prints_each_log_and_has_each_peer_write_its_stacks(tmp_path, marker, capsys):
    with pytest.raises(RuntimeError, match="the test failed"), LocalSwarm(tmp_path) as swarm:
        stuck = swarm.spawn("server-stuck", "tests.sleeper", [])
        wait_for(lambda: "waiting" in stuck.log_path.read_text(), 60, "the sleeper to start")
        raise RuntimeError("the test failed")
    assert not stuck.alive()
    printed = capsys.readouterr().err
    assert f"--- the last lines of {stuck.log_path}:\nINFO sleeper: waiting" in printed
    log = stuck.log_path.read_text()
    assert "Current thread" in log, log  # the threads, from faulthandler
    assert "signal SIGUSR1; 2 pending asyncio tasks:\n  the stuck task, waiting on" in log, log  # the loop's tasks
    assert "tests/sleeper.py:13 in waiting_for_nothing" in log, log  # and where each one waits
