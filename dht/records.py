"""Typed DHT records. Records come from the network, so parsing validates every field and ignores unknown ones
(old and new peers interoperate); a record that does not parse is skipped, never trusted."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer

from dht.identity import owner_of
from swarm.net import join_host_port
from swarm.protocol.tls import valid_cert

RECORD_VERSION = 1
MAX_STAGES = 256  # stage keys the validator knows (keys reach validators hashed: they are precomputed)
MAX_RECORD_BYTES = 4096


def signed_records(value: Any) -> Iterator[tuple[bytes, ServerRecord, float]]:
    """The well-formed records in a stage key's DHT value, each with the public key that signed it (its owner subkey)
    and its expiration; unsigned and malformed ones (anyone could have written them) are left out."""
    if not isinstance(value, dict):
        return
    for subkey, item in value.items():
        owner, record = owner_of(subkey), ServerRecord.from_dict(getattr(item, "value", None))
        if owner is not None and record is not None:
            yield owner, record, item.expiration_time


def parse_p2p_id(text: object) -> PeerID | None:
    """A libp2p peer id from its base58 text, or None if `text` is not one (records say whatever their owner wrote)."""
    if not isinstance(text, str) or not 0 < len(text) <= 128:
        return None
    try:
        return PeerID.from_base58(text)
    except Exception:  # whatever base58 or multihash raise on garbage
        return None


def stage_key(swarm_name: str, stage: int) -> str:
    return f"{swarm_name}.stage{stage}"


@dataclass(frozen=True)
class ServerRecord:
    """A peer (named by the key that signed this record: dht/identity.py) serves `stage` at host:port. Its load, for
    trainers and the rebalancer (swarm/rebalance.py): measured `throughput` (samples/s it can sustain), `queue_length`
    (requests waiting), `demand` (samples/s it was sent over the last announce period). `joined_at`: DHT time it
    took this stage (by starting or moving), which its cooldown counts from. `ready`: False while it downloads the
    stage's state; it serves nothing yet, but its capacity is already committed here."""

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
    p2p_id: str = ""  # the peer's libp2p id, for hivemind's averagers (its swarm id is its key's fingerprint)
    tls_cert: str = ""  # PEM: its gRPC endpoint serves TLS with this certificate, which callers trust alone ("": none)
    p2p_only: bool = False  # the swarm cannot dial host:port (behind NAT): call it over libp2p, at its p2p_id
    allreduce_bytes: int = 0  # what its stage all-reduces sent and received so far (encoded sizes)
    allreduce_fp32_bytes: int = 0  # what the same rounds would have cost as whole fp32 tensors
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # what must match between peers: `settings`
    version: int = RECORD_VERSION

    @property
    def address(self) -> str:
        """Where callers reach it: host:port, or "p2p:<libp2p id>" for a server they cannot dial (swarm/protocol/p2p.py)."""
        return f"p2p:{self.p2p_id}" if self.p2p_only else join_host_port(self.host, self.port)

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
            isinstance(rec.p2p_id, str) and len(rec.p2p_id) <= 128,
            isinstance(rec.p2p_only, bool) and (not rec.p2p_only or parse_p2p_id(rec.p2p_id) is not None),
            isinstance(rec.tls_cert, str) and (rec.tls_cert == "" or valid_cert(rec.tls_cert)),
            isinstance(rec.allreduce_bytes, int) and 0 <= rec.allreduce_bytes < 2**62,
            isinstance(rec.allreduce_fp32_bytes, int) and 0 <= rec.allreduce_fp32_bytes < 2**62,
            _plain_settings(rec.config),
        )
        return rec if all(checks) else None


def _plain_settings(config: Any) -> bool:
    return (
        isinstance(config, dict)
        and len(config) <= 64
        and all(isinstance(k, str) and len(k) <= 64 for k in config)
        and all(
            v is None or isinstance(v, bool | int | float) or (isinstance(v, str) and len(v) <= 64)
            for v in config.values()
        )
    )


def settings(**sections: Any) -> dict[str, Any]:
    """The settings two peers must share, flat: `settings(model=ModelConfig(...), optimizer=...)` ->
    {"model.d_model": 128, ...}. Scalar fields only; `None` sections are left out."""
    out = {}
    for prefix, section in sections.items():
        if section is None:
            continue
        is_instance = dataclasses.is_dataclass(section) and not isinstance(section, type)
        values = dataclasses.asdict(section) if is_instance else dict(section)
        out.update(
            {f"{prefix}.{k}": v for k, v in values.items() if v is None or isinstance(v, bool | int | float | str)}
        )
    return out


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Settings both name with different values, as 'name: theirs (ours)'. A setting only one side names is not
    compared: a trainer knows the model, not the optimizer."""
    return [
        f"{k}: {theirs[k]!r} (ours {ours[k]!r})" for k in sorted(ours.keys() & theirs.keys()) if ours[k] != theirs[k]
    ]


@dataclass(frozen=True)
class PeerEntry:
    peer_id: str  # the fingerprint of `public_key`
    record: ServerRecord
    expiration: float
    public_key: bytes = b""  # the key that signed the record (its owner subkey's)


class StageRecordValidator(RecordValidatorBase):
    """Every DHT node of the swarm refuses, under a stage's key, anything but a well-formed ServerRecord of that stage
    stored under an owner's subkey (whose signature hivemind's RSASignatureValidator, which runs first, has
    checked). Without it a node would keep unsigned subkeys beside the signed ones, and mixing their types breaks
    hivemind's storage (it compares subkeys of records that expire at the same time)."""

    def __init__(self, swarm_name: str):
        self.swarm_name = swarm_name
        self.stages = {DHTID.generate(source=stage_key(swarm_name, s)).to_bytes(): s for s in range(MAX_STAGES)}

    def validate(self, record: DHTRecord) -> bool:
        stage = self.stages.get(record.key)
        if stage is None:
            return True  # not ours: hivemind's averagers keep their own keys
        if len(record.value) > MAX_RECORD_BYTES:
            return False
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
        except Exception:  # whatever msgpack raises on garbage
            return False
        parsed = ServerRecord.from_dict(value)
        return owner_of(subkey) is not None and parsed is not None and parsed.stage == stage

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, StageRecordValidator) and other.swarm_name == self.swarm_name
