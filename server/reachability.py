"""A starting server's self-test: can the swarm dial its Stage service? (swarm/protocol/reach.py asks other DHT nodes
to dial it back.) Told which address to check, or none (listening on 0.0.0.0 or ::): then the address the swarm's
nodes see us at, which the server announces."""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from dht.node import SwarmDHT
from dht.records import parse_p2p_id
from swarm.net import is_unspecified
from swarm.protocol.reach import MIN_INTERVAL_S, Reachability, check_reachability

logger = logging.getLogger(__name__)
MAX_HELPERS = 3
ATTEMPTS = 3  # self-tests that no helper could answer, before serving without knowing


@dataclass(frozen=True)
class SelfTest:
    result: Reachability
    host: str | None  # the address to announce: the one checked, or where the swarm sees us; None: unknown

    def report(self, port: int, flags: str) -> str:
        """One log line for the server's owner; `flags`: how to fix an unreachable address."""
        r = self.result
        if r.ok:
            where = collections.Counter(r.reachable).most_common(1)[0][0]
            return f"reachable: {len(r.reachable)} of {r.asked} swarm peers asked dialled our Stage service at {where}"
        if not r.answered:
            why = f": {'; '.join(r.declined)}" if r.declined else ""
            return f"could not check whether the swarm can reach us: none of {r.asked} peers asked could check{why}"
        failures = "; ".join(f"{where}: {why}" for where, why in r.unreachable)
        return (
            f"NOT reachable: {len(r.unreachable)} of {r.asked} swarm peers could not dial our Stage service "
            f"({failures}). Trainers and stage peers cannot call this server. Forward TCP port {port} to this "
            f"machine, or pass {flags} with an address that reaches it"
        )


def helper_ids(initial_peers: Sequence[str], servers: Sequence[str], me: str, k: int = MAX_HELPERS) -> list[PeerID]:
    """Up to `k` libp2p ids to ask, at random: the bootstrap peers (from their multiaddrs) and servers (their records'
    p2p ids), never ourselves."""
    ids = set(servers)
    for maddr in initial_peers:
        try:
            ids.add(Multiaddr(maddr).value_for_protocol("p2p"))
        except Exception:  # a multiaddr without /p2p/, or malformed: the DHT already said so at start
            continue
    ids -= {me, ""}
    valid = {p: peer for p in ids if (peer := parse_p2p_id(p)) is not None}  # records say what their owner wrote
    return [valid[p] for p in random.sample(sorted(valid), min(k, len(valid)))]


async def self_test(
    sdht: SwarmDHT, initial_peers: Sequence[str], n_stages: int, host: str, port: int, tls_cert: str = ""
) -> SelfTest:
    """Ask up to MAX_HELPERS swarm peers to dial host:port (`host` unspecified: where they see us; `tls_cert`: over
    TLS, trusting that certificate). If none of them could check for a reason that passes (busy, slow, not yet
    connected to us), ask again, up to ATTEMPTS times in all, as often as a helper answers one asker (the servers of
    the swarm may have changed meanwhile)."""
    for attempt in range(1, ATTEMPTS + 1):
        found = await asyncio.gather(*(sdht.lookup(s) for s in range(n_stages)), return_exceptions=True)
        servers = [e.record.p2p_id for entries in found if isinstance(entries, list) for e in entries]
        helpers = helper_ids(initial_peers, servers, sdht.p2p_id)
        result = await check_reachability(await sdht.p2p(), helpers, host, port, tls_cert)
        if not result.worth_asking_again or attempt == ATTEMPTS:
            break
        logger.info(
            "reachability self-test: none of %d peers asked could check (%s); asking again in %.0fs",
            len(helpers),
            "; ".join(result.declined),
            MIN_INTERVAL_S,
        )
        await asyncio.sleep(MIN_INTERVAL_S)
    if not is_unspecified(host):
        return SelfTest(result, host)
    # where they see us, even if they could not dial us there: the address to fix, and to announce meanwhile
    seen = [d.rsplit(":", 1)[0].strip("[]") for d in result.reachable or [where for where, _ in result.unreachable]]
    return SelfTest(result, collections.Counter(seen).most_common(1)[0][0] if seen else None)
