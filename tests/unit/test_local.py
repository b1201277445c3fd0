"""swarm-local's configuration, and the pipeline every command needs (pure; the launcher itself runs in
test_integration.py and test_rebalance_live.py)."""

import os
import signal

import pytest

import tools.local
from tools.local import LocalConfig, main


def test_servers_per_stage_takes_one_count_or_one_per_stage():
    assert LocalConfig(stages=3, servers_per_stage="2").allocation == [2, 2, 2]
    assert LocalConfig(stages=3, servers_per_stage="4,1,1").allocation == [4, 1, 1]


@pytest.mark.parametrize("bad", ["4,1", "4,1,1,1", "0", "2,0,1", "two", "", "1,,1"])
def test_a_bad_allocation_is_refused_with_a_message(bad, capsys):
    with pytest.raises(SystemExit):
        main(["--stages", "3", "--servers-per-stage", bad])
    assert "--servers-per-stage must be one count >= 1 or 3 comma-separated counts" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, argv",
    [
        ("tools.local", ["--stages", "1"]),
        ("server.main", ["--n-stages", "1", "--stage", "0"]),
        ("trainer.main", ["--n-stages", "1"]),
    ],
)
def test_a_one_stage_swarm_is_refused_at_start_with_the_reason(command, argv, capsys):
    """A one-stage pipeline never calls a Forward, so stage 0 would admit nothing and refuse every Backward: the swarm
    started, and trained 0 steps for as long as it ran. Now each command says so and exits."""
    module = __import__(command, fromlist=["main"])
    with pytest.raises(SystemExit) as exited:
        module.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "must be >= 2" in err and "stage 0 admits microbatches on their Forward" in err, err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_run_stopped_by_a_signal_exits_128_plus_it(monkeypatch, sig, code):
    """Ctrl+C stops the swarm as the end of a run does, but the exit status says it was stopped (it was 0)."""

    def run_until_stopped(cfg, stop):
        os.kill(os.getpid(), sig)
        assert stop.wait(5)
        return {}

    monkeypatch.setattr(tools.local, "run", run_until_stopped)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as exited:
            main([])
        assert exited.value.code == code
        monkeypatch.setattr(tools.local, "run", lambda cfg, stop: {})
        main([])  # a run that ends by itself returns: status 0
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
