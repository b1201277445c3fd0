"""What a stage accepts from the network: the pure checks of a call's tensors and of a Progress message.

Nothing that arrives is trusted. Headers are checked before payloads are buffered (swarm.protocol.frames); the tensors
are checked here against the stage's schema after decoding, and a failed check raises WireError (INVALID_ARGUMENT for
that call only). Progress messages are checked for form here, for signature and counts by the collaboration.
"""

from __future__ import annotations

import torch

from dht.identity import MAX_PUBLIC_KEY_BYTES, fingerprint, verify
from server.collab.hubs import MAX_PASSED_ON
from server.state import valid_lineage
from swarm.config import ModelConfig
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.frames import MAX_META_STRING, MAX_SIGNATURE_BYTES, Call, Limits
from swarm.protocol.p2p import ADDRESS_PREFIX as P2P_ADDRESS
from swarm.protocol.rpc import PROTOCOL_VERSION
from swarm.protocol.tensors import FP16_MAX, WireError


class StageSchema:
    """What this stage accepts: token ids (B, T) for stage 0, hidden (B, T, D) float for the rest; grad_outputs of the
    stage's output shape; labels (B, T) in [0, vocab) for the last stage. B <= max_batch, T <= max_seq_len."""

    def __init__(self, cfg: ModelConfig, stage: int, max_batch: int, max_activation: float = FP16_MAX):
        self.cfg, self.stage, self.max_batch, self.bound = cfg, stage, max_batch, max_activation
        self.is_first, self.is_last = stage == 0, stage == cfg.n_stages - 1
        hidden_bytes = max_batch * cfg.max_seq_len * cfg.boundary_width * 4
        self.max_request_bytes = 2 * hidden_bytes  # a Backward: inputs and grad_outputs, uncompressed
        self.forward_limits = Limits(hidden_bytes, frozenset({"inputs"}))
        grad_name = "labels" if self.is_last else "grad_outputs"
        self.backward_limits = Limits(hidden_bytes, frozenset({"inputs", grad_name}))

    def samples(self, call: Call) -> int:
        """The batch size of a call's inputs, from its header (the payload is decoded and checked later)."""
        expect("inputs" in call.tensors, "missing tensor 'inputs'")
        n = int(call.tensors["inputs"].header.shape[0])
        expect(1 <= n <= self.max_batch, f"batch {n} outside [1, {self.max_batch}]")
        return n

    def check_inputs(self, x: torch.Tensor) -> None:
        """Types, shapes and ids; float values were checked as they were decoded (decode_checked)."""
        if self.is_first:
            expect(x.dtype == torch.int64, f"stage 0 takes int64 token ids, got {x.dtype}")
            expect(x.ndim == 2, f"token ids must be (batch, seq), got shape {list(x.shape)}")
            _check_ids(x, self.cfg.vocab_size, "inputs")
        else:
            expect(x.is_floating_point(), f"stage {self.stage} takes floating-point hidden states, got {x.dtype}")
            expect(
                x.ndim == 3 and x.shape[2] == self.cfg.boundary_width,
                f"hidden states must be (batch, seq, {self.cfg.boundary_width}), got shape {list(x.shape)}",
            )
        expect(1 <= x.shape[0] <= self.max_batch, f"batch {x.shape[0]} outside [1, {self.max_batch}]")
        expect(1 <= x.shape[1] <= self.cfg.max_seq_len, f"sequence {x.shape[1]} outside [1, {self.cfg.max_seq_len}]")

    def check_backward(self, x: torch.Tensor, other: torch.Tensor) -> None:
        B, T = x.shape[:2]
        if self.is_last:
            expect(
                other.dtype == torch.int64 and tuple(other.shape) == (B, T),
                f"labels must be int64 {[B, T]}, got {other.dtype} {list(other.shape)}",
            )
            _check_ids(other, self.cfg.vocab_size, "labels")
        else:
            expect(
                other.is_floating_point() and tuple(other.shape) == (B, T, self.cfg.boundary_width),
                f"grad_outputs must be float {[B, T, self.cfg.boundary_width]}, got {other.dtype} {list(other.shape)}",
            )


def expect(ok: bool, message: str) -> None:
    """Raises WireError(`message`) unless `ok`: the caller sent something this stage does not accept."""
    if not ok:
        raise WireError(message)


def _check_ids(x: torch.Tensor, vocab: int, name: str) -> None:
    expect(x.numel() == 0 or (int(x.min()) >= 0 and int(x.max()) < vocab), f"{name} must be token ids in [0, {vocab})")


def valid_admission(a: pb.Admission) -> bool:
    """The form of an admission a Progress carries, as a call's is checked (swarm.protocol.frames); its signature is
    checked by the receiving collaboration (server/collab/served.py)."""
    return (
        len(a.microbatch_id) <= MAX_META_STRING
        and 1 <= a.samples < 2**40
        and 0 <= a.global_batch < 2**62
        and 0 <= a.admitted_at < 2**62
        and 0 < len(a.admitted_by) <= MAX_META_STRING
        and 0 < len(a.signature) <= MAX_SIGNATURE_BYTES
    )


def well_formed_progress(msg: pb.StageProgress, stage: int) -> bool:
    """Whether a Progress (or one a hub passes on in it) is of our protocol and stage with every field in its bounds;
    its signature and counts are checked by the receiving collaboration (intake.py `on_progress`)."""
    return (
        msg.protocol_version == PROTOCOL_VERSION
        and msg.stage == stage
        and 0 < len(msg.peer_id) <= 128
        and 0 <= msg.epoch < 2**62
        and 0 <= msg.samples < 2**40
        and 0 <= msg.admitted < 2**40
        and 0 <= msg.admitted_next < 2**40
        and 0 <= msg.averaged <= msg.epoch
        and (not msg.lineage or valid_lineage(msg.lineage))
        and len(msg.address) <= 300
        and (not msg.address or msg.address.rpartition(":")[2].isdigit() or msg.address.startswith(P2P_ADDRESS))
        and len(msg.public_key) <= MAX_PUBLIC_KEY_BYTES
        and len(msg.signature) <= 2048
        and all(map(valid_admission, msg.served))
        and (not msg.HasField("taken_epoch") or 0 <= msg.taken_epoch < msg.epoch)
        and (msg.HasField("taken_epoch") or not msg.taken)
        and all(map(valid_admission, msg.taken))
        and (not msg.HasField("moved_on") or (valid_admission(msg.moved_on) and msg.moved_on.admitted_at > msg.epoch))
    )


def well_formed_progress_call(msg: pb.StageProgress, stage: int) -> bool:
    """A Progress call: well-formed, and so is each of the (at most MAX_PASSED_ON) messages a hub passes on in it,
    none of which passes others on."""
    return (
        well_formed_progress(msg, stage)
        and len(msg.passed_on) <= MAX_PASSED_ON
        and all(well_formed_progress(m, stage) and not m.passed_on for m in msg.passed_on)
    )


def forged_progress(msg: pb.StageProgress) -> str | None:
    """Why `msg` was not sent by the peer it names, or None: it is signed with the key its peer id is the fingerprint
    of."""
    if fingerprint(msg.public_key) != msg.peer_id:
        return "progress: peer_id is not the fingerprint of public_key"
    unsigned = pb.StageProgress()
    unsigned.CopyFrom(msg)
    unsigned.ClearField("signature")
    if not verify(msg.public_key, unsigned.SerializeToString(), msg.signature):
        return "progress: bad signature"
    return None
