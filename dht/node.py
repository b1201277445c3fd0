"""An asyncio face for `hivemind.DHT`: start, announce a server, discover a stage's servers, shut down.

hivemind runs the DHT in a child process (plus its p2pd daemon); every call here returns an awaitable and never
blocks the event loop. Shut it down in a `finally`: a killed parent orphans those children.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import hivemind
import torch
from hivemind.utils import get_dht_time

from dht.records import PeerEntry, ServerRecord, stage_key

logger = logging.getLogger(__name__)


def start_dht(
    initial_peers: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    client_mode: bool = False,
    identity_path: str | None = None,
) -> hivemind.DHT:
    """Blocking (about a second): call it before the event loop starts, or in an executor."""
    # hivemind selects torch's "file_system" sharing at import, which starts a torch_shm_manager daemon per process
    # that escapes our process groups and outlives us by tens of seconds; we share no tensors between processes.
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    return hivemind.DHT(
        initial_peers=list(initial_peers),
        host_maddrs=[f"/ip4/{host}/tcp/{port}"],
        client_mode=client_mode,
        identity_path=identity_path,
        start=True,
        await_ready=True,
    )


class SwarmDHT:
    def __init__(self, dht: hivemind.DHT, swarm_name: str, timeout: float = 10.0):
        self.dht, self.swarm_name, self.timeout = dht, swarm_name, timeout

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    async def announce(self, record: ServerRecord, ttl: float) -> bool:
        future = self.dht.store(
            stage_key(self.swarm_name, record.stage),
            record.to_dict(),
            get_dht_time() + ttl,
            subkey=self.peer_id,
            return_future=True,
        )
        return bool(await asyncio.wait_for(future, self.timeout))

    async def withdraw(self, record: ServerRecord, ttl: float) -> bool:
        """Replace our record with a tombstone that outlives it, so readers drop us at once rather than at expiry."""
        tombstone = ServerRecord(host=record.host, port=record.port, stage=record.stage, online=False)
        return await self.announce(tombstone, ttl)

    async def discover(self, stage: int, include_pending: bool = False) -> list[PeerEntry]:
        """Live, valid, online servers of `stage`; malformed or foreign records are skipped. Servers still downloading
        the stage's state (`ready=False`) only with `include_pending`: the rebalancer counts them, nobody calls them."""
        future = self.dht.get(stage_key(self.swarm_name, stage), latest=True, return_future=True)
        found = await asyncio.wait_for(future, self.timeout)
        if found is None or not isinstance(found.value, dict):
            return []
        now, entries = get_dht_time(), []
        for peer_id, item in found.value.items():
            record = ServerRecord.from_dict(getattr(item, "value", None))
            if record is None or record.stage != stage:
                logger.debug("skipping malformed record of %s under stage %d", peer_id, stage)
                continue
            if record.online and item.expiration_time > now and (record.ready or include_pending):
                entries.append(PeerEntry(str(peer_id), record, item.expiration_time))
        return entries

    def shutdown(self) -> None:
        if self.dht.is_alive():
            self.dht.shutdown()
