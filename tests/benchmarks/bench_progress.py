"""The bytes of a stage's Progress messages per epoch, with the admissions each carries (server/collab/served.py),
as the peers of one stage send them: a peer sends one Progress after every Backward it serves, and each names the
admissions behind its count. Before protocol version 8 each carried every admission of its epoch; now each carries
those a receiver has not said it holds (`ProgressAck.served_held`).

Both are measured with the real sender (`StagePeers.broadcast`: protobuf, RSA signatures) and real receivers (`Served`
checking every admission's stage-0 signature); the receivers answer as they do, or (the old protocol) as if they held
nothing, which makes the sender send every admission again. No network: the bytes are the serialized messages, times
the peers each goes to.

    python -m tests.benchmarks.bench_progress                    # 4 peers, 4..256 microbatches an epoch
    python -m tests.benchmarks.bench_progress --peers 8 --microbatches 64 1024
"""

from __future__ import annotations

import argparse
import asyncio
import time
import types

from dht.identity import Identity
from server.collab.progress import StagePeers
from server.collab.served import Served
from server.collab.tickets import Tickets, ticket_bytes
from swarm.protocol import wire_pb2 as pb

SAMPLES = 8  # per microbatch


def _receiver(stage0: Identity) -> Served:
    async def discover(stage: int, include_pending: bool = False):
        return [types.SimpleNamespace(peer_id=stage0.peer_id, public_key=stage0.public_key)]

    return Served(Tickets(types.SimpleNamespace(discover=discover), timeout=1.0))


async def one_epoch(n_peers: int, microbatches: int, acked: bool) -> tuple[int, float]:
    """(bytes all peers of the stage sent in Progress messages over one epoch, seconds it took), the epoch's
    microbatches spread evenly over the peers, one Progress per Backward."""
    stage0 = Identity()
    admissions = [
        pb.Admission(
            microbatch_id=f"trainer-{i % 7}:{i:08d}",
            samples=SAMPLES,
            global_batch=0,
            admitted_at=0,
            admitted_by=stage0.peer_id,
            signature=stage0.sign(ticket_bytes(f"trainer-{i % 7}:{i:08d}", SAMPLES, 0, 0)),
        )
        for i in range(microbatches)
    ]
    identities = [Identity() for _ in range(n_peers)]
    receivers = {identity.peer_id: _receiver(stage0) for identity in identities}
    senders = []
    for identity in identities:
        peers = StagePeers(types.SimpleNamespace(identity=identity, peer_id=identity.peer_id, p2p=None), 1, 1.0)
        peers.peers.update({p: f"127.0.0.1:{i + 1}" for i, p in enumerate(receivers) if p != identity.peer_id})

        async def send(peer_id: str, address: str, msg: pb.StageProgress) -> pb.ProgressAck:
            served = receivers[peer_id]
            await served.prove(msg, int(msg.epoch))
            held = served.held(msg.peer_id, int(msg.epoch)) if acked else 0
            return pb.ProgressAck(epoch=msg.epoch, served_held=held)

        peers._send = send  # type: ignore[method-assign]
        senders.append(peers)
    started = time.perf_counter()
    mine: list[list[pb.Admission]] = [[] for _ in identities]
    for i, admission in enumerate(admissions):  # Backwards land on the peers in turn
        k = i % n_peers
        mine[k].append(admission)
        await senders[k].broadcast(0, SAMPLES * len(mine[k]), False, served=list(mine[k]))
    elapsed = time.perf_counter() - started
    for identity, held in zip(identities, mine, strict=True):  # every receiver can weigh every sender right
        for peer_id, served in receivers.items():
            if peer_id != identity.peer_id:
                assert served.proven(identity.peer_id, 0) == SAMPLES * len(held)
    return sum(s.bytes_sent for s in senders), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4, help="peers of the stage")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 16, 64, 256], help="per epoch, all peers")
    args = parser.parse_args()
    print(f"Progress bytes per epoch, one stage of {args.peers} peers (all peers' messages together)")
    print(f"{'microbatches':>12} {'all each time':>15} {'only unheld':>13} {'ratio':>7} {'per message':>14}")
    for m in args.microbatches:
        full, _ = asyncio.run(one_epoch(args.peers, m, acked=False))
        delta, _ = asyncio.run(one_epoch(args.peers, m, acked=True))
        per = delta / (m * (args.peers - 1))
        print(
            f"{m:>12} {full / 1e6:>12.2f} MB {delta / 1e6:>10.3f} MB {full / delta:>6.1f}x {per:>11.0f} B", flush=True
        )


if __name__ == "__main__":
    main()
