"""Typed DHT records. Records come from the network, so parsing validates every field and ignores unknown ones
(old and new peers interoperate); a record that does not parse is skipped, never trusted."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

RECORD_VERSION = 1


def stage_key(swarm_name: str, stage: int) -> str:
    return f"{swarm_name}.stage{stage}"


@dataclass(frozen=True)
class ServerRecord:
    """Peer `peer_id` serves `stage` at host:port. Its load, for trainers and the rebalancer (swarm/rebalance.py):
    measured `throughput` (samples/s it can sustain), `queue_length` (requests waiting), `demand` (samples/s it was
    sent over the last announce period). `joined_at`: DHT time it took this stage (by starting or moving), which its
    cooldown counts from. `ready`: False while it downloads the stage's state; it serves nothing yet, but its capacity
    is already committed here."""

    host: str
    port: int
    stage: int
    throughput: float = 0.0
    queue_length: int = 0
    param_version: int = 0
    demand: float = 0.0
    joined_at: float = 0.0
    ready: bool = True
    online: bool = True  # False: a tombstone left by a peer that withdrew
    version: int = RECORD_VERSION

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> ServerRecord | None:
        """None if `raw` is not a valid record."""
        if not isinstance(raw, dict):
            return None
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known}
        try:
            rec = cls(**kwargs)
        except TypeError:
            return None
        checks = (
            isinstance(rec.host, str) and 0 < len(rec.host) <= 255,
            isinstance(rec.port, int) and 0 < rec.port < 65536,
            isinstance(rec.stage, int) and rec.stage >= 0,
            isinstance(rec.throughput, int | float) and 0 <= rec.throughput < float("inf"),
            isinstance(rec.queue_length, int) and rec.queue_length >= 0,
            isinstance(rec.param_version, int) and rec.param_version >= 0,
            isinstance(rec.demand, int | float) and 0 <= rec.demand < float("inf"),
            isinstance(rec.joined_at, int | float) and 0 <= rec.joined_at < float("inf"),
            isinstance(rec.ready, bool),
            isinstance(rec.online, bool),
        )
        return rec if all(checks) else None


@dataclass(frozen=True)
class PeerEntry:
    peer_id: str
    record: ServerRecord
    expiration: float
