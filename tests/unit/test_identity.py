"""Identity for everything that changes a stage's state: DHT records only their key's owner can write, and Progress
messages that count only when signed by a peer the DHT lists on the stage. Real in-process stage peers (tests/peers.py)
and, as the attacker, a stock `hivemind.DHT` that runs no validator and signs nothing."""

import pytest

from dht.identity import Identity, fingerprint
from dht.records import differences, settings
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(30)


def signed(identity: Identity, **fields) -> pb.StageProgress:
    msg = pb.StageProgress(protocol_version=PROTOCOL_VERSION, stage=0, public_key=identity.public_key, **fields)
    msg.signature = identity.sign(msg.SerializeToString())
    return msg


def test_peer_ids_are_key_fingerprints():
    one, two = Identity(), Identity()
    assert one.peer_id == fingerprint(one.public_key) != two.peer_id
    assert len(one.peer_id) <= 128


def test_settings_are_flat_and_only_shared_names_are_compared():
    ours = settings(model={"d_model": 128, "seed": 0}, optimizer={"lr": 1e-3}, unused=None)
    assert ours == {"model.d_model": 128, "model.seed": 0, "optimizer.lr": 1e-3}
    assert differences(ours, {"model.d_model": 128}) == []
    assert differences(ours, {"model.d_model": 64, "optimizer.lr": 1e-3}) == ["model.d_model: 64 (ours 128)"]
