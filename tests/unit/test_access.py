"""Private swarms (swarm/protocol/access.py): only peers with the swarm key take part. Real gRPC servers, real DHT
nodes and averagers; forged, stale, replayed and missing proofs."""

import os
import time

import pytest

from swarm.protocol.access import CALL_WINDOW_S, SwarmKey
from swarm.protocol.rpc import SERVICE

pytestmark = pytest.mark.timeout(120)
INFO = f"/{SERVICE}/Info"


def test_a_key_file_round_trips_privately_and_errors_never_quote_it(tmp_path):
    key = SwarmKey.new()
    path = tmp_path / "swarm.key"
    key.write(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        key.write(path)  # never over an existing key
    assert SwarmKey.from_file(path).swarm_id == key.swarm_id
    secret = path.read_text().strip()
    assert secret not in repr(key) and secret not in key.swarm_id and key.swarm_id in repr(key)
    for content in ("zz" * 40, secret[:20], ""):
        (tmp_path / "bad.key").write_text(content)
        with pytest.raises(ValueError) as err:
            SwarmKey.from_file(tmp_path / "bad.key")
        assert not content or content not in str(err.value)
    with pytest.raises(ValueError, match="cannot read"):
        SwarmKey.from_file(tmp_path / "missing.key")


def test_call_proofs_are_bound_to_key_method_time_and_a_single_use():
    key, other = SwarmKey.new(), SwarmKey.new()
    token = key.call_token(INFO)
    assert key.check_call(INFO, token) is None
    assert "used before" in key.check_call(INFO, token)  # a replay
    assert "wrong swarm key" in key.check_call(INFO, other.call_token(INFO))
    assert "wrong swarm key" in key.check_call(f"/{SERVICE}/Forward", key.call_token(INFO))  # another method
    stamp = str(int((time.time() - 2 * CALL_WINDOW_S) * 1000))
    stale = f"{stamp}-00-{key.mac(b'grpc', INFO.encode(), stamp.encode(), b'00').hex()}"
    assert "old" in key.check_call(INFO, stale)
    for garbage in (None, "", "-", "1-2", "1-2-3-4", "x-00-00", "1-00-zz", "9" * 200, "-1-00-" + "0" * 64):
        reason = key.check_call(INFO, garbage)
        assert reason is not None and len(reason) < 200, (garbage, reason)
    fresh = [key.call_token(INFO) for _ in range(100)]
    assert [key.check_call(INFO, t) for t in fresh] == [None] * 100
