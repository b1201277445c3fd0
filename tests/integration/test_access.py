"""Private swarms (swarm/protocol/access.py): only peers with the swarm key take part. Real gRPC servers, real DHT
nodes and averagers; forged, stale, replayed and missing proofs."""

import asyncio
import functools
import glob
import logging
import re
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dht.identity import Identity
from dht.node import SwarmDHT, start_dht
from dht.records import stage_key
from server.collab.compat.averager import StrictAverager
from server.collab.compat.process import start_in_background
from swarm.cli import to_argv
from swarm.protocol import access, reach
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.access import METADATA_KEY, SwarmKey
from swarm.protocol.rpc import StageStub, aio_channel, stage_handler, start_stage_server
from tests.conftest import wait_for
from tests.peers import stock_dht
from tests.unit.test_access import INFO
from tools.processes import LocalSwarm

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def private_server():
    """A Stage service behind a swarm key, whose handlers count what reaches them."""
    key = SwarmKey.new()
    reached: list[str] = []

    async def info(request, context):
        reached.append("Info")
        return pb.InfoReply(stage=1)

    async def forward(request_iterator, context):
        reached.append("Forward")
        async for _ in request_iterator:
            pass
        yield b""

    server, _, port = await start_stage_server(stage_handler(forward, forward, info, info), "127.0.0.1", 0, key=key)
    try:
        yield key, f"127.0.0.1:{port}", reached
    finally:
        await server.stop(None)


async def test_a_private_server_refuses_calls_without_the_key_before_its_handlers_run(private_server):
    key, address, reached = private_server
    async with aio_channel(address) as channel:
        assert (await StageStub(channel, key).info(pb.InfoRequest(), timeout=5)).stage == 1
        assert reached == ["Info"]
        refusals = {
            "no key": StageStub(channel).info(pb.InfoRequest(), timeout=5),
            "another key": StageStub(channel, SwarmKey.new()).info(pb.InfoRequest(), timeout=5),
            "garbage proof": StageStub(channel).info(pb.InfoRequest(), timeout=5, metadata=((METADATA_KEY, "1-2-3"),)),
        }
        for what, call in refusals.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
            assert key.swarm_id in err.value.details() and len(err.value.details()) < 300, what
        # a replayed proof: the same metadata sent twice
        proof = ((METADATA_KEY, key.call_token(INFO)),)
        raw = channel.unary_unary(INFO)
        assert pb.InfoReply.FromString(await raw(b"", metadata=proof, timeout=5)).stage == 1
        with pytest.raises(grpc.aio.AioRpcError, match="used before") as err:
            await raw(b"", metadata=proof, timeout=5)
        # a stream without the key: refused whatever it sends, and its frames never reach the handler
        call = StageStub(channel).forward(iter([b"\xff" * 1000] * 50), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert reached == ["Info", "Info"]
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # whether it is up, nothing else


async def test_this_processs_key_makes_every_stub_prove_it(private_server, monkeypatch):
    key, address, _ = private_server
    monkeypatch.setattr(access, "KEY", key)
    async with aio_channel(address) as channel:
        assert (await StageStub(channel).info(pb.InfoRequest(), timeout=5)).stage == 1


async def test_only_nodes_with_the_key_join_a_private_dht_and_the_key_never_reaches_the_logs(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    key = SwarmKey.new()
    key.write(tmp_path / "swarm.key")
    secret = (tmp_path / "swarm.key").read_text().strip()
    loop = asyncio.get_running_loop()
    boot = await loop.run_in_executor(None, functools.partial(start_dht, swarm_key=key))
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    member = None
    try:
        member = await loop.run_in_executor(None, functools.partial(start_dht, maddrs, swarm_key=key))
        assert await loop.run_in_executor(None, member.store, "k", "v", time.time() + 60)
        assert (await loop.run_in_executor(None, boot.get, "k")).value == "v"
        before = set(glob.glob("/tmp/hivemind-p2pd-*.sock"))
        for other in (None, SwarmKey.new()):
            with pytest.raises(RuntimeError, match="private swarm answers only peers with its key"):
                await loop.run_in_executor(None, functools.partial(start_dht, maddrs, swarm_key=other))
        # the refused starts' daemons were shut down with their sockets (hivemind left them: dht/node.py)
        assert not set(glob.glob("/tmp/hivemind-p2pd-*.sock")) - before
    finally:
        for node in (member, boot):
            if node is not None:
                node.shutdown()
    assert secret not in caplog.text and secret not in repr(key)


async def test_a_private_averager_serves_its_state_only_to_peers_that_proved_the_key():
    """A donor in a private DHT: a stranger that dials its libp2p address directly (its DHT node could not join: no
    key) downloads nothing; a member of the DHT, listed on no stage yet (a joiner), gets the state once it has
    introduced itself to the donor's DHT node."""
    key = SwarmKey.new()
    loop = asyncio.get_running_loop()
    boot = await loop.run_in_executor(None, functools.partial(start_dht, swarm_key=key))
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    member_identity = Identity()
    donor_dht, member_dht = [
        await loop.run_in_executor(None, functools.partial(start_dht, maddrs, identity=i, swarm_key=key))
        for i in (Identity(), member_identity)
    ]
    donor_maddrs = [str(m) for m in donor_dht.get_visible_maddrs()]

    # a stock node with no key: it cannot bootstrap, but it dials the donor
    stranger_dht = await loop.run_in_executor(None, lambda: stock_dht(donor_maddrs, ensure_bootstrap_success=False))
    common = dict(prefix="access_state", start=False, min_matchmaking_time=1.0, request_timeout=0.5)
    donor = StrictAverager(averaged_tensors=[torch.arange(4.0)], dht=donor_dht, allow_state_sharing=True, **common)
    donor.listed_under = stage_key("t", 0)  # before its process forks, as build_averaging does
    member = StrictAverager(averaged_tensors=[torch.zeros(4)], dht=member_dht, **common)
    stranger = StrictAverager(averaged_tensors=[torch.zeros(4)], dht=stranger_dht, **common)
    averagers = (donor, member, stranger)
    for averager in averagers:
        start_in_background(averager)  # forks with the collector frozen (dht/forking.py)
    for averager in averagers:
        averager.wait_until_ready(30)
    try:
        assert await loop.run_in_executor(None, stranger.download_state, str(donor.peer_id), 5.0) is None
        await SwarmDHT(member_dht, "t", member_identity, swarm_key=key).introduce(str(donor.peer_id))
        got = await loop.run_in_executor(None, member.download_state, str(donor.peer_id), 5.0)
        assert got is not None and torch.equal(got[1][0], torch.arange(4.0))
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in (stranger_dht, member_dht, donor_dht, boot):
            dht.shutdown()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_private_swarm_trains_its_members_and_refuses_the_uninvited(tmp_path):
    """swarm-local's private swarm: a trainer with the key trains through servers with the key; a server with another
    key and a trainer with none are refused at the DHT and exit saying why; a call to a server without the key is
    refused; a server that joins later downloads its stage's state; the key appears in no log."""
    other_key = tmp_path / "other.key"
    SwarmKey.new().write(other_key)
    model = ["--preset", "tiny_test", "--n-stages", "2"]
    with LocalSwarm(tmp_path / "logs", "private", model, private=True) as swarm:
        swarm.start_dht()
        for stage in range(2):
            swarm.start_server(f"server-s{stage}", stage, ["--no-rebalance"])
        swarm.start_trainer("trainer-0", ["--max-steps", "12", "--batch-size", "2"])
        swarm.start_server("intruder-server", 0, ["--swarm-key", str(other_key)])
        open_argv = [*to_argv(swarm.local_trainer("intruder")), "--swarm-name", "private", *model]
        swarm.spawn("intruder-trainer", "trainer.main", [*open_argv, "--initial-peers", *swarm.initial_peers])
        for name in ("intruder-server", "intruder-trainer"):
            child = swarm.children[name]
            assert child.proc.wait(120) != 0, name
            assert "a private swarm answers only peers with its key" in child.log_path.read_text(), name
        trainer = swarm.children["trainer-0"]
        wait_for(lambda: not trainer.alive(), 240, "the member trainer's 12 microbatches")
        assert trainer.proc.returncode == 0
        stats = swarm.trainer_stats()[0]
        assert stats["steps"] >= 12 and stats["lost_microbatches"] == 0, stats
        served = re.search(r"serving at (\S+);", swarm.children["server-s1"].log_path.read_text())
        assert served, "server-s1 did not serve"

        async def call_without_key() -> grpc.StatusCode:
            async with aio_channel(served.group(1)) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await StageStub(channel).info(pb.InfoRequest(), timeout=5)
                return err.value.code()

        assert asyncio.run(call_without_key()) == grpc.StatusCode.PERMISSION_DENIED
        # a member joining later gets the stage's state from its peer, before its own record is listed
        late = swarm.start_server("server-s1-late", 1, ["--no-rebalance"])
        wait_for(lambda: "loaded state at epoch" in late.log_path.read_text(), 90, "the late server's state download")
    secret = (tmp_path / "logs" / "swarm.key").read_text().strip()
    logs = list((tmp_path / "logs").glob("*.log"))
    assert logs and not [p.name for p in logs if secret in p.read_text(errors="replace")]


async def test_a_private_nodes_reach_checks_answer_only_proofs_bound_to_the_asker(monkeypatch):
    """A reachability request in a private swarm carries a MAC of the asker's libp2p id: missing, made with another
    key, or made for another peer id (a proof copied off the wire), it is refused without a dial."""
    monkeypatch.setattr(reach, "MIN_INTERVAL_S", 0.0)
    key = SwarmKey.new()
    loop = asyncio.get_running_loop()
    helper = await loop.run_in_executor(None, start_dht)
    asker = await loop.run_in_executor(
        None, functools.partial(start_dht, [str(m) for m in helper.get_visible_maddrs()])
    )
    dialled: list[str] = []

    async def dial(host: str, port: int, expected: str, cert: str) -> tuple[bool, str]:
        dialled.append(expected)
        return True, ""

    helper_p2p, asker_p2p = await helper.replicate_p2p(), await asker.replicate_p2p()
    try:
        await reach.ReachResponder(helper_p2p, key, dial).start()
        mine = asker_p2p.peer_id.to_bytes()
        proofs = {
            "none": b"",
            "another key": SwarmKey.new().peer_proof(reach.PROOF_PURPOSE, mine),
            "another peer": key.peer_proof(reach.PROOF_PURPOSE, helper_p2p.peer_id.to_bytes()),
            "garbage": b"\xff" * 5000,
        }
        for what, proof in proofs.items():
            request = pb.ReachRequest(host="127.0.0.1", port=7000, proof=proof)
            reply = await asker_p2p.call_protobuf_handler(helper_p2p.peer_id, reach.HANDLER, request, pb.ReachReply)
            assert not reply.reachable and "private" in reply.detail, what
        assert dialled == []
        monkeypatch.setattr(access, "KEY", key)  # the asker's own key: check_reachability proves it
        result = await reach.check_reachability(asker_p2p, [helper_p2p.peer_id], "127.0.0.1", 7000)
        assert result.ok and dialled == [str(asker.peer_id)]
    finally:
        for p2p in (asker_p2p, helper_p2p):
            await p2p.shutdown()
        asker.shutdown()
        helper.shutdown()
