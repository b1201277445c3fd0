"""Which listed servers count: those that answered as themselves where their record says.

Anyone can sign a record of their own, at any address, claiming any throughput: a record is a claim, not a server.
Before a listed peer gets its first microbatch from a trainer (and again whenever its record names another address),
the trainer asks it for its Info and routes to it only if the server there names the record's owner and stage; a
stage past 0 likewise computes a Backward under a stage-0 peer's admission only once that peer answered so
(server/collab/tickets.py). A record whose address never answers so draws a probe, then another after 2, 4, ...
seconds (at most MAX_WAIT_S), never a microbatch: a stranger's record at an unreachable address drew 54 dials and 6
failed calls in 50 s, and cost the trainer a quarter of its throughput, when records were routed to on sight.

`Vetting` is pure and synchronous, clock injected: its user runs the probes it asks for (`answers_as`) and reports
them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import Channels

logger = logging.getLogger(__name__)
FIRST_WAIT_S = 2.0  # after a failed probe, the next one waits this long, doubling after each failure
MAX_WAIT_S = 60.0


@dataclass(slots=True)
class _Vetting:
    address: str
    failures: int = 0
    next_probe: float = 0.0
    probing: bool = False
    vetted: bool = False


class Vetting:
    """The vetting of one stage's listed peers, by peer id."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._peers: dict[str, _Vetting] = {}

    def listed(self, addresses: Mapping[str, str]) -> list[str]:
        """The stage's listing (peer id -> address): returns the peers to probe now (and marks them probing). A peer
        whose address changed is vetted afresh; one no longer listed is forgotten."""
        self._peers = {
            p: v if v.address == addresses[p] else _Vetting(addresses[p])
            for p, v in self._peers.items()
            if p in addresses
        }
        now, due = self.clock(), []
        for peer_id, address in addresses.items():
            v = self._peers.setdefault(peer_id, _Vetting(address))
            if not v.vetted and not v.probing and now >= v.next_probe:
                v.probing = True
                due.append(peer_id)
        return due

    def answered(self, peer_id: str, address: str, ok: bool) -> None:
        """A probe of `peer_id` at `address` came back: `ok` if the server there named it and its stage."""
        v = self._peers.get(peer_id)
        if v is None or v.address != address:
            return  # unlisted or moved meanwhile: the next listing decides
        v.probing = False
        if ok:
            v.vetted, v.failures = True, 0
            return
        v.failures += 1
        v.next_probe = self.clock() + min(MAX_WAIT_S, FIRST_WAIT_S * 2 ** (v.failures - 1))

    def vetted(self, peer_id: str) -> bool:
        v = self._peers.get(peer_id)
        return v is not None and v.vetted


async def answers_as(channels: Channels, address: str, peer_id: str, stage: int | None, timeout: float) -> bool:
    """Whether the server at `address` answers Info, within `timeout`, naming `peer_id` and `stage` (None: any stage,
    for a peer still joining, which may answer with the stage it leaves). Unreachable, frozen or garbage: False."""
    try:
        reply = await channels.stub(address).info(pb.InfoRequest(), timeout=timeout)
    except Exception as e:  # noqa: BLE001  # whatever went wrong, it did not answer as itself
        logger.debug("%s at %s did not answer as itself: %r", peer_id[-6:], address, e)
        return False
    return reply.peer_id == peer_id and (stage is None or reply.stage == stage)
