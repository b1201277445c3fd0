"""Relays that carry stage calls (dht/relay.py): a relaying node's daemon serves the relay its flags configure (4 GiB
and 30 min per connection), not libp2p's default one (128 KiB and 2 min), and proves it at start."""

import asyncio
from types import SimpleNamespace

from hivemind.p2p import P2P

from dht.relay import echo_for


def test_a_relaying_nodes_daemon_runs_on_one_thread_and_takes_only_static_relays():
    make = P2P._make_process_args  # as dht/node.py wraps it
    relaying = make("p2pd", forceReachabilityPublic=1, relay=True)
    assert relaying[:3] == ["env", "GOMAXPROCS=1", "p2pd"] and "-forceReachabilityPublic=1" in relaying, relaying
    natted = make("p2pd", forceReachabilityPrivate=1, trustedRelays="/ip4/127.0.0.1/tcp/1/p2p/x")
    assert natted[0] == "p2pd" and "-relayDiscovery=0" in natted, natted
    assert make("p2pd", relay=True) == ["p2pd", "-relay=1"]


async def test_the_checks_echo_answers_its_own_caller_and_length_only():
    """Anyone can open a stream to the check's hidden daemon through the relay while the check runs. Its echo reads
    the 8-byte header and nothing more from a stream of another peer, or one declaring another length (garbage,
    0, 2**64 - 1): it closes it unanswered."""

    class Writer:
        def __init__(self):
            self.sent, self.closed = b"", False

        def write(self, data: bytes) -> None:
            self.sent += data

        async def drain(self) -> None:
            pass

        def close(self) -> None:
            self.closed = True

    async def stream(sender: str, header: bytes, body: bytes) -> tuple[Writer, int]:
        reader = asyncio.StreamReader()
        reader.feed_data(header + body)
        reader.feed_eof()
        writer = Writer()
        await asyncio.wait_for(echo_for("caller", 4)(SimpleNamespace(peer_id=sender), reader, writer), 5)
        return writer, len(await reader.read())  # what it left unread

    body = b"abcd" + b"x" * 1000
    writer, unread = await stream("caller", (4).to_bytes(8, "big"), body)
    assert writer.sent == b"abcd" and writer.closed
    for sender, header, left in [
        ("forged", (4).to_bytes(8, "big"), 8 + len(body)),  # not even the header is read
        ("caller", (5).to_bytes(8, "big"), len(body)),
        ("caller", bytes(8), len(body)),
        ("caller", b"\xff" * 8, len(body)),
    ]:
        writer, unread = await stream(sender, header, body)
        assert writer.sent == b"" and writer.closed and unread == left, (sender, header, unread)
    writer, _ = await stream("caller", b"\x00\x01", b"")  # a header cut short, then the stream ends
    assert writer.sent == b"" and writer.closed
