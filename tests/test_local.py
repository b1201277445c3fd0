"""swarm-local's configuration (pure; the launcher itself runs in test_integration.py and test_rebalance_live.py)."""

import pytest

from swarm.tools.local import LocalConfig, main


def test_servers_per_stage_takes_one_count_or_one_per_stage():
    assert LocalConfig(stages=3, servers_per_stage="2").allocation == [2, 2, 2]
    assert LocalConfig(stages=3, servers_per_stage="4,1,1").allocation == [4, 1, 1]


@pytest.mark.parametrize("bad", ["4,1", "4,1,1,1", "0", "2,0,1", "two", "", "1,,1"])
def test_a_bad_allocation_is_refused_with_a_message(bad, capsys):
    with pytest.raises(SystemExit):
        main(["--stages", "3", "--servers-per-stage", bad])
    assert "--servers-per-stage must be one count >= 1 or 3 comma-separated counts" in capsys.readouterr().err
