"""No orphans: what a peer process started (hivemind's DHT child, its p2pd daemon, their sockets) ends with it."""

from dht.reaper import daemon_sockets, descendants


def test_daemon_sockets_come_from_the_command_line():
    cmd = b"/x/hivemind_cli/p2pd -idleTimeout=30s -listen=/unix/tmp/hivemind-p2pd-kL6YL_J2-Y.sock -relay=1 "
    assert daemon_sockets(cmd) == ["/tmp/hivemind-p2pd-kL6YL_J2-Y.sock", "/tmp/hivemind-p2pclient-kL6YL_J2-Y.sock"]
    assert daemon_sockets(b"python -m server.main --listen=/unix/tmp/x.sock") == []
    assert daemon_sockets(b"p2pd -listen=/unix/tmp/hivemind-p2pd-../../etc.sock") == []  # only a plain id


def test_descendants_skip_other_reapers_and_what_they_watch():
    table = {10: (1, 100), 11: (10, 110), 12: (11, 120), 13: (10, 130), 14: (2, 140)}
    assert descendants(10, table) == {11: 110, 12: 120, 13: 130}
    assert descendants(14, table) == {}
