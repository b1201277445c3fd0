"""The Stage service over libp2p (swarm/protocol/p2p.py): real DHT nodes' daemons, the same handlers as gRPC; errors,
garbage and private swarms' proofs."""

import pytest
from hivemind.p2p import PeerID

from dht.records import ServerRecord
from swarm.protocol.p2p import circuit_through, path_of

pytestmark = pytest.mark.timeout(30)


def test_a_callers_log_says_whether_it_reaches_a_peer_directly_or_through_a_relay():
    relay = "/ip4/11.0.0.1/tcp/4001/p2p/12D3KooWDWynKPhbrs1YpSKuQQapbRKaVveTYKtcqK2LdkK9LfgL"
    assert path_of([f"{relay}/p2p-circuit"]) == f"through relay {relay}"
    assert path_of(["/ip4/11.0.0.2/tcp/5000", f"{relay}/p2p-circuit"]) == "directly at /ip4/11.0.0.2/tcp/5000"
    assert path_of([]) == "not connected"


def test_a_relay_address_is_the_relays_own_with_p2p_circuit_and_a_bare_peer_id():
    """The daemon takes /p2p/<id> as a bare multihash; hivemind's multiaddr writes it as a CID, which the daemon
    cannot parse ("length greater than remaining number of bytes"), so relay addresses are built by hand."""
    relay = "12D3KooWDWynKPhbrs1YpSKuQQapbRKaVveTYKtcqK2LdkK9LfgL"
    raw = circuit_through(f"/ip4/127.0.0.1/tcp/4001/p2p/{relay}").to_bytes()
    multihash = PeerID.from_base58(relay).to_bytes()
    assert raw == bytes.fromhex("047f000001060fa1") + b"\xa5\x03" + bytes([len(multihash)]) + multihash + b"\xa2\x02"
    for bad in ("/ip4/127.0.0.1/tcp/4001", f"/p2p/{relay}", "/ip4/127.0.0.1/tcp/4001/p2p/not-base58-0OIl"):
        with pytest.raises(ValueError):
            circuit_through(bad)


def test_a_p2p_only_record_is_addressed_by_its_libp2p_id_and_needs_a_valid_one():
    peer = "12D3KooWPCkmoAkpxgWfActTg2UnTzfa5ZgLa9qcmfGzxbg4Pw7C"
    base = ServerRecord(host="192.0.2.1", port=7000, stage=1, p2p_id=peer).to_dict()
    assert ServerRecord.from_dict(base).address == "192.0.2.1:7000"
    assert ServerRecord.from_dict({**base, "p2p_only": True}).address == f"p2p:{peer}"
    for bad in ("", "not base58 0OIl", "x" * 129, f"{peer}:7000", "127.0.0.1:1"):
        assert ServerRecord.from_dict({**base, "p2p_only": True, "p2p_id": bad}) is None, bad
    assert ServerRecord.from_dict({**base, "p2p_only": "yes"}) is None
