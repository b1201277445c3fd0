"""A server's side of rebalancing: publish its load before each period's boundary, read every peer's after it, and
move if the shared decision function (swarm/rebalance.py) names it. Also `--stage auto`'s choice at start.

Records are signed, but anyone can sign a record of their own that claims any capacity for any address. Such claims
must not move real peers: before it acts (a move, or `--stage auto`'s choice) a peer counts only the records whose
address answers `Info` as the record's owner (its swarm id), on the record's stage. A forged record for a server that
does not exist, or one that points at another peer's server, is then left out; a stage whose other peers are all
such records keeps its last real peer (the decision never takes a stage's last peer)."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING

from hivemind.utils import get_dht_time

from dht.records import PeerEntry
from swarm.protocol.rpc import Channels
from swarm.rebalance import PeerLoad, StageLoad, SwarmView, choose_stage, decide, next_decision_time, stage_loads
from swarm.vetting import answers_as

if TYPE_CHECKING:
    from server.stage_server import StageServer

logger = logging.getLogger("swarm.server")
# Every period: each peer publishes its load SNAPSHOT_LEAD seconds before the boundary, then reads everyone's
# READ_DELAY seconds after it, so all peers decide on the same numbers.
SNAPSHOT_LEAD, READ_DELAY = 1.5, 0.5
INFO_TIMEOUT_S = 3.0  # a record's server must answer Info within this to count


def read_view(per_stage: list[list[PeerEntry]], as_of: float) -> SwarmView:
    """The rebalancer's view from the stages' DHT records, as they stood at DHT time `as_of` (the period's boundary):
    a peer that joined or moved after it counts where it was before, or not at all, so that every peer reading a
    moment later sees the same swarm whichever of those records it already finds. A peer listed under two stages
    (a move whose tombstone has not reached every DHT node yet) counts where its freshest record puts it."""
    newest: dict[str, tuple[int, PeerEntry]] = {}
    for stage, entries in enumerate(per_stage):
        for e in entries:
            if e.record.joined_at > as_of:
                continue
            if e.peer_id not in newest or e.expiration > newest[e.peer_id][1].expiration:
                newest[e.peer_id] = (stage, e)
    peers: list[list[PeerLoad]] = [[] for _ in per_stage]
    for peer_id, (stage, e) in sorted(newest.items()):
        r = e.record
        peers[stage].append(
            PeerLoad(
                peer_id,
                throughput=r.throughput,
                queue_len=r.queue_length,
                demand=r.demand,
                last_move_s=r.joined_at or -math.inf,
                ready=r.ready,
            )
        )
    return SwarmView(tuple(StageLoad(i, tuple(p)) for i, p in enumerate(peers)))


async def sleep_unless(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` or until `stop`; True if stopped."""
    try:
        await asyncio.wait_for(stop.wait(), max(seconds, 0.0))
    except TimeoutError:
        pass
    return stop.is_set()


class Rebalancer:
    def __init__(self, server: StageServer):
        self.server = server
        self.cfg = server.cfg.rebalancing
        self.peer_id = server.sdht.peer_id
        self.channels = Channels(server.sdht.p2p)

    async def view(self, as_of: float, verified: bool = False) -> SwarmView:
        """The swarm's load as the DHT records stood at `as_of`; `verified`: only records whose servers answer as
        their owners (see the module's docstring)."""
        sdht, stages = self.server.sdht, range(self.server.model_cfg.n_stages)
        per_stage = await asyncio.gather(*(sdht.discover(i, include_pending=True) for i in stages))
        return read_view(await self.verify(per_stage) if verified else per_stage, as_of)

    async def verify(self, per_stage: list[list[PeerEntry]]) -> list[list[PeerEntry]]:
        """The entries whose address answers Info, within INFO_TIMEOUT_S, with the entry's peer id and stage (a peer
        still joining may answer with the stage it leaves). Ours counts without asking."""
        entries = [e for stage in per_stage for e in stage]
        answers = await asyncio.gather(*(self._answers_as_owner(e) for e in entries))
        false = {(e.record.stage, e.peer_id) for e, ok in zip(entries, answers, strict=True) if not ok}
        if false:
            logger.warning(
                "rebalancing: not counting %d records whose address does not answer as their owner: %s",
                len(false),
                ", ".join(f"{peer[-6:]} on stage {stage}" for stage, peer in sorted(false)[:8]),
            )
        return [[e for e in stage if (e.record.stage, e.peer_id) not in false] for stage in per_stage]

    async def _answers_as_owner(self, entry: PeerEntry) -> bool:
        if entry.peer_id == self.peer_id:
            return True
        stage = entry.record.stage if entry.record.ready else None
        return await answers_as(self.channels, entry.record.address, entry.peer_id, stage, INFO_TIMEOUT_S)

    async def close(self) -> None:
        await self.channels.close()

    async def choose_stage(self) -> int:
        """`--stage auto`: the stage whose reinforcement raises the pipeline's throughput most (swarm.rebalance)."""
        view = await self.view(as_of=get_dht_time(), verified=True)
        known = sorted(p.throughput for s in view.stages for p in s.peers if p.throughput > 0)
        estimate = known[len(known) // 2] if known else 1.0  # our speed on a stage we have not built: the median peer
        stage = choose_stage(view, self.peer_id, estimate)
        logger.info(
            "--stage auto: peers per stage %s, capacity %s samples/s: joining stage %d",
            "/".join(str(len(s.peers)) for s in view.stages),
            "/".join(f"{s.capacity:.1f}" for s in view.stages),
            stage,
        )
        return stage

    async def run(self, stop: asyncio.Event) -> None:
        """Every period, at the same wall-clock moment as every other peer, decide on the same view whether to move."""
        server, rb = self.server, self.cfg
        while True:
            at = next_decision_time(get_dht_time() + SNAPSHOT_LEAD, rb)
            if await sleep_unless(stop, at - SNAPSHOT_LEAD - get_dht_time()):
                return
            if server.serving:
                server.take_snapshot()
                await server.announce()
            if await sleep_unless(stop, at + READ_DELAY - get_dht_time()):
                return
            try:
                view = await self.view(as_of=at)
            except Exception as e:
                logger.warning("rebalancing skipped: could not read the swarm's load: %r", e)
                continue
            if all(p.peer_id != self.peer_id for s in view.stages for p in s.peers):
                continue  # our record is not visible yet: the others do not count us either
            move = decide(view, self.peer_id, at, rb)
            if move is None:
                continue
            loads = "/".join(f"{x:.2f}" for x in stage_loads(view))
            peers = "/".join(str(len(s.peers)) for s in view.stages)
            # a record can be missing only because its peer's last announce was late (a loaded machine, a slow DHT):
            # read once more an announce period later, and move only if the same records still call for it, counting
            # only the records whose servers answer as their owners
            if await sleep_unless(stop, server.cfg.network.announce_period):
                return
            try:
                confirmed = decide(await self.view(as_of=at, verified=True), self.peer_id, at, rb)
            except Exception as e:
                logger.warning("rebalancing skipped: could not re-read the swarm's load: %r", e)
                continue
            if confirmed != move:
                logger.info(
                    "not moving to stage %d: a second, verified read of the swarm (peers per stage %s at the first) "
                    "no longer calls for it",
                    move.dst,
                    peers,
                )
                continue
            await server.move(move.dst, f"peers per stage {peers}, load (demand/capacity) {loads}")
