"""The gRPC face of a stage: parse, validate, enforce the deadline, delegate to the worker, encode the reply.

Nothing that arrives is trusted. Headers are checked before payloads are buffered (swarm.protocol.frames), tensors are checked
against the stage's schema after decoding (this module), and a bad request ends in INVALID_ARGUMENT for that call only.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import grpc
import torch

from dht.identity import MAX_PUBLIC_KEY_BYTES
from server.collab import AdmissionRefused, Behind, Collaboration, ProgressRefused
from server.collab.hubs import MAX_PASSED_ON
from server.collab.tickets import Ticket, TicketRefused, TicketSpent, TicketUnchecked, admission_of, ticket_key
from server.config import GuardConfig
from server.worker import DeadlineExpired, StageWorker, valid_lineage
from swarm.compression import CODECS_BY_WIRE, WIRE_TO_DTYPE, Codec, CodecContext, TensorRole, get_codec
from swarm.compression.memory import ErrorMemory
from swarm.compression.policy import role_of
from swarm.config import ModelConfig
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.drain import Drains
from swarm.protocol.frames import (
    ADDRESS_SHARE_FACTOR,
    MAX_META_STRING,
    MAX_SIGNATURE_BYTES,
    Busy,
    ByteBudget,
    Call,
    Limits,
    address_of,
    iter_frames,
    read_call,
)
from swarm.protocol.p2p import ADDRESS_PREFIX as P2P_ADDRESS
from swarm.protocol.rpc import CHUNK_BYTES, PROTOCOL_VERSION, stage_handler
from swarm.protocol.tensors import FP16_MAX, WireError, WireStats, check_values, decode_checked, encode_tensor
from swarm.protocol.tensors import fingerprint as tensor_fingerprint
from swarm.tasks import cancelled_here

logger = logging.getLogger(__name__)


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

    def check_inputs(self, x: torch.Tensor) -> None:
        """Types, shapes and ids; float values were checked as they were decoded (decode_checked)."""
        if self.is_first:
            _expect(x.dtype == torch.int64, f"stage 0 takes int64 token ids, got {x.dtype}")
            _expect(x.ndim == 2, f"token ids must be (batch, seq), got shape {list(x.shape)}")
            _check_ids(x, self.cfg.vocab_size, "inputs")
        else:
            _expect(x.is_floating_point(), f"stage {self.stage} takes floating-point hidden states, got {x.dtype}")
            _expect(
                x.ndim == 3 and x.shape[2] == self.cfg.boundary_width,
                f"hidden states must be (batch, seq, {self.cfg.boundary_width}), got shape {list(x.shape)}",
            )
        _expect(1 <= x.shape[0] <= self.max_batch, f"batch {x.shape[0]} outside [1, {self.max_batch}]")
        _expect(1 <= x.shape[1] <= self.cfg.max_seq_len, f"sequence {x.shape[1]} outside [1, {self.cfg.max_seq_len}]")

    def check_backward(self, x: torch.Tensor, other: torch.Tensor) -> None:
        B, T = x.shape[:2]
        if self.is_last:
            _expect(
                other.dtype == torch.int64 and tuple(other.shape) == (B, T),
                f"labels must be int64 {[B, T]}, " f"got {other.dtype} {list(other.shape)}",
            )
            _check_ids(other, self.cfg.vocab_size, "labels")
        else:
            _expect(
                other.is_floating_point() and tuple(other.shape) == (B, T, self.cfg.boundary_width),
                f"grad_outputs must be float {[B, T, self.cfg.boundary_width]}, got {other.dtype} {list(other.shape)}",
            )


MAX_READ_S = 120.0  # the longest a request may take to arrive
# the longest a request may go without a frame (a chunk of CHUNK_BYTES: 2 MiB arrive in 30 s at 0.6 Mb/s)
IDLE_READ_S = 30.0
DRAIN_S = 5.0  # the longest a refused request is read on
DRAINING = 16  # refused requests read on at once; up to 3 times as many wait for a slot (swarm.protocol.drain)
MAX_STATUS_CHARS = 500  # status details travel in HTTP/2 trailers: a caller's oversized input must not make them fail
LOSS_WINDOW = 20  # backwards averaged in the last stage's reported (recent) loss


async def refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the call with `code` and `message` (cut to MAX_STATUS_CHARS): grpc's abort raises, so nothing after this
    runs."""
    await context.abort(code, _short(message))
    raise AssertionError("unreachable: ServicerContext.abort raises")


class ReplyCache:
    """The last Backward replies, by the admission they used (event loop). A Backward counts once per server
    (tickets.py); a trainer whose reply was lost (its deadline passed while the server still computed) asks the same
    server again, and gets the same reply instead of a refusal, or waits for it while the first attempt computes. A
    reply is handed only to the microbatch it was computed for: each is kept with the fingerprint of its request
    (swarm.protocol.tensors `fingerprint`), and a call under the same admission with other tensors (an id collision,
    or an admission copied by someone who saw it) is refused (Duplicate). Bounded in replies and bytes; the replies
    being computed are bounded by the calls a server holds."""

    def __init__(self, max_bytes: int, max_replies: int = 256):
        self.max_bytes, self.max_replies, self.bytes = max_bytes, max_replies, 0
        self._replies: collections.OrderedDict[tuple, tuple[bytes, list[bytes]]] = collections.OrderedDict()
        self._computing: dict[tuple, tuple[bytes, asyncio.Future[list[bytes] | None]]] = {}

    async def recall(self, key: tuple, fingerprint: bytes) -> list[bytes] | None:
        """The reply of the Backward that spent `key` here: kept, or awaited while it computes. None if none is kept
        (forgotten, or computed by an earlier run of this server); raises Uncounted if that Backward failed before
        it counted (its admission is free again), Duplicate if it sent other tensors than `fingerprint` says."""
        if (computing := self._computing.get(key)) is not None:
            _same(computing[0], fingerprint)
            if (frames := await asyncio.shield(computing[1])) is None:
                raise Uncounted
            return frames
        if (kept := self._replies.get(key)) is None:
            return None
        _same(kept[0], fingerprint)
        return kept[1]

    def computing(self, key: tuple, fingerprint: bytes) -> None:
        """A Backward of these tensors spent `key` here (it may still wait for its epoch, or for the compute thread);
        `done` must follow, whatever happens."""
        self._computing[key] = fingerprint, asyncio.get_running_loop().create_future()

    def is_computing(self, key: tuple) -> bool:
        return key in self._computing

    def done(self, key: tuple, frames: list[bytes] | None) -> None:
        """The Backward that spent `key` replied `frames`, or failed before it counted (None)."""
        if (computing := self._computing.pop(key, None)) is None:
            return
        fingerprint, future = computing
        if frames is not None:
            self.put(key, fingerprint, frames)
        if not future.done():
            future.set_result(frames)

    def put(self, key: tuple, fingerprint: bytes, frames: list[bytes]) -> None:
        size = sum(map(len, frames))
        if size > self.max_bytes:
            return
        self._replies[key] = fingerprint, frames
        self.bytes += size
        while self.bytes > self.max_bytes or len(self._replies) > self.max_replies:
            _, (_, dropped) = self._replies.popitem(last=False)
            self.bytes -= sum(map(len, dropped))


class Duplicate(TicketRefused):
    """A Backward under an admission spent here by a call that sent other tensors: two microbatches under one id, or
    one whose admission someone else used first. PERMISSION_DENIED, nothing computed; the trainer retries elsewhere."""


def _same(kept: bytes, fingerprint: bytes) -> None:
    if kept != fingerprint:
        raise Duplicate(
            "admission: spent here by another microbatch with this id and admission (its tensors differ); nothing "
            "computed, ask another peer"
        )


class Uncounted(Exception):
    """The Backward a retry waited for failed before its gradient counted: the retry is judged afresh."""


def caller_of(context: grpc.aio.ServicerContext) -> str:
    """Who calls: its connection ("ipv4:203.0.113.7:51234"), or its libp2p id ("p2p:12D3KooW...": authenticated by
    libp2p). Per-caller limits hold per caller, and per address (swarm.protocol.frames `address_of`) for all of its
    callers together."""
    return context.peer() or ""


def _short(message: str) -> str:
    return message if len(message) <= MAX_STATUS_CHARS else message[: MAX_STATUS_CHARS - 15] + "... (truncated)"


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise WireError(message)


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
    its signature and counts are checked by the receiving collaboration (epoch.py `on_progress`)."""
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


def _check_ids(x: torch.Tensor, vocab: int, name: str) -> None:
    _expect(x.numel() == 0 or (int(x.min()) >= 0 and int(x.max()) < vocab), f"{name} must be token ids in [0, {vocab})")


class StageService:
    def __init__(
        self, worker: StageWorker, schema: StageSchema, collab: Collaboration, guard: GuardConfig | None = None
    ):
        self.worker, self.schema, self.collab = worker, schema, collab
        self.guard = guard or GuardConfig()
        self.budget = ByteBudget(self._budget_bytes(), self.guard.max_caller_share)
        self.drains = Drains(DRAINING)
        self.calls_by_caller: dict[str, int] = {}
        self.calls_by_address: dict[str, int] = {}
        self.replies = ReplyCache(max(self.budget.limit // 4, 8 << 20))
        self._jobs: set[asyncio.Future] = set()  # Backwards computing (asyncio keeps only weak references to tasks)
        self.requests_rejected = 0
        self.requests_busy = 0  # turned away with RESOURCE_EXHAUSTED: too many calls or bytes held
        self.active_calls = 0  # Forward/Backward calls between arrival and reply
        self.paused: str | None = None  # why new Forward/Backward calls are turned away (UNAVAILABLE), if they are
        self.p2p_id = ""  # the server's libp2p id, in Info (a reachability check dialling back matches it)
        self.peer_id = ""  # its swarm id, in Info (rebalancers check that a record's address answers as its owner)
        self.transport = "grpc"  # how callers reach it: "grpc", or "grpc+tls"
        self.max_read_s = MAX_READ_S
        self.traffic = WireStats()  # stage calls' tensors received and sent (written on the compute thread)
        self.losses: deque[float] = deque(maxlen=LOSS_WINDOW)  # last stage: its recent backwards' losses
        self.moves = 0  # set by the peer when it has moved to another stage
        # errors and warm starts of the stateful gradient codecs this server encodes with (compute thread)
        self.codec_memory = ErrorMemory()
        self._digesting = asyncio.Lock()  # Info's state digests, one at a time
        self._fingerprint_key = os.urandom(16)  # which bytes of a request its fingerprint reads (ReplyCache)

    @property
    def recent_loss(self) -> float | None:
        """The mean of the last stage's recent losses; None on other stages or before the first."""
        losses = list(self.losses)
        return sum(losses) / len(losses) if losses and self.schema.is_last else None

    def attach(self, worker: StageWorker, schema: StageSchema, collab: Collaboration) -> None:
        """Serve another stage (after a move) and accept work again."""
        self.worker, self.schema, self.collab, self.paused = worker, schema, collab, None
        self.budget.limit = self._budget_bytes()
        self.losses.clear()
        self.codec_memory = ErrorMemory()

    def _budget_bytes(self) -> int:
        if self.guard.max_buffered_mb > 0:
            return int(self.guard.max_buffered_mb * 2**20)
        return max(4 * (self.schema.max_request_bytes + self.schema.backward_limits.frame_bytes), 64 << 20)

    def pause(self, reason: str) -> None:
        """Turn new Forward/Backward calls away with UNAVAILABLE: trainers retry them on another peer of the stage.
        Calls already accepted finish; Progress and Info are still answered."""
        self.paused = reason

    def handler(self) -> grpc.GenericRpcHandler:
        return stage_handler(self.forward, self.backward, self.info, self.progress)

    async def forward(self, raw_frames, context: grpc.aio.ServicerContext):
        async for frame in self._serve(raw_frames, context, backward=False):
            yield frame

    async def backward(self, raw_frames, context: grpc.aio.ServicerContext):
        async for frame in self._serve(raw_frames, context, backward=True):
            yield frame

    async def progress(self, msg: pb.StageProgress, context: grpc.aio.ServicerContext) -> pb.ProgressAck:
        ok = (
            well_formed_progress(msg, self.schema.stage)
            and len(msg.passed_on) <= MAX_PASSED_ON
            and all(well_formed_progress(m, self.schema.stage) and not m.passed_on for m in msg.passed_on)
        )
        try:
            ack = await self.collab.on_progress(msg) if ok else None
        except ProgressRefused as e:
            await refuse(context, grpc.StatusCode.PERMISSION_DENIED, str(e))
        if ack is None:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed progress message, or not a stage peer")
        return ack

    async def info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoReply:
        w, loss = self.worker, self.recent_loss
        # the epoch of the digested state, not of a step that ran meanwhile: a peer compares the pair
        shared = None
        if request.with_digest:
            async with self._digesting:  # one at a time: each reads the whole state
                shared = await asyncio.to_thread(self.collab.shared_digest)
        epoch, digest = shared or (w.epoch, "")
        return pb.InfoReply(
            protocol_version=PROTOCOL_VERSION,
            stage=self.schema.stage,
            n_stages=self.schema.cfg.n_stages,
            param_version=w.param_version,
            queue_length=w.queue_length,
            throughput=w.throughput,
            model_config_json=json.dumps(dataclasses.asdict(self.schema.cfg)),
            samples_processed=w.samples_processed,
            epoch=epoch,
            state_digest=digest,
            requests_rejected=self.requests_rejected,
            requests_busy=self.requests_busy,
            allreduce_bytes=self.collab.allreduce_bytes,
            allreduce_fp32_bytes=self.collab.allreduce_fp32_bytes,
            backwards_at_stashed_version=w.backwards_at_stashed_version,
            backwards_past_stash=w.backwards_past_stash,
            compression=self.collab.compression,
            gradients_rejected=w.guard.rejected,
            steps_skipped=w.steps_skipped,
            steps_rolled_back=w.steps_rolled_back,
            recent_loss=float("nan") if loss is None else loss,
            traffic=[pb.Traffic(role=r, wire_bytes=n, fp32_bytes=f) for r, (n, f) in self.traffic.by_role().items()],
            rounds_ok=self.collab.rounds_ok,
            rounds_failed=self.collab.rounds_failed,
            moves=self.moves,
            state_downloads=self.collab.state_downloads,
            transport=self.transport,
            p2p_id=self.p2p_id,
            peer_id=self.peer_id,
            progress_sent=self.collab.progress_calls[0],
            progress_received=self.collab.progress_calls[1],
            epoch_end_s=self.collab.epoch_end_s,
        )

    async def _serve(self, raw_frames, context: grpc.aio.ServicerContext, backward: bool):
        started = time.monotonic()
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        caller = caller_of(context)
        address = address_of(caller)
        held, from_address = self.calls_by_caller.get(caller, 0), self.calls_by_address.get(address, 0)
        share = self.guard.max_active_calls * self.guard.max_caller_share
        turned_away = None
        if self.paused is not None:
            turned_away = grpc.StatusCode.UNAVAILABLE, self.paused
        elif self.active_calls >= self.guard.max_active_calls:
            turned_away = grpc.StatusCode.RESOURCE_EXHAUSTED, f"busy: {self.active_calls} calls in progress"
        elif held >= share or from_address >= min(self.guard.max_active_calls, ADDRESS_SHARE_FACTOR * share):
            whose = "this caller" if held >= share else "this address"
            turned_away = (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"busy: {max(held, from_address)} calls of {whose} in progress",
            )
        if turned_away is not None:
            # read on (dropping it) what the caller still sends, for its refusal to reach it (swarm.protocol.drain)
            if turned_away[0] == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.requests_busy += 1
            limits = self.schema.backward_limits if backward else self.schema.forward_limits
            seconds = DRAIN_S if deadline is None else min(DRAIN_S, deadline - time.monotonic())
            await self.drains.drain(raw_frames, 2 * limits.max_tensor_bytes + CHUNK_BYTES, seconds, self._arrived)
            await refuse(context, *turned_away)
        worker, collab = self.worker, self.collab  # a move swaps them: this call finishes on the stage it began on
        self.active_calls += 1
        self.calls_by_caller[caller] = held + 1
        self.calls_by_address[address] = from_address + 1
        call: Call | None = None
        where = "reading"  # what the call waits for now: SWARM_DEBUG logs it for a call its caller gave up on
        # (status, message) to end the call with. Refused after the `except` blocks, not in them: an abort raised
        # there would chain the caught exception, whose traceback holds this call's frames and buffers, into a
        # reference cycle with gRPC's handler that only the garbage collector frees (bench_flood: RSS rose ~200 MB
        # per burst of refusals)
        refusal: tuple[grpc.StatusCode, str] | None = None
        reply: list[bytes] | None = None
        try:
            limits = self.schema.backward_limits if backward else self.schema.forward_limits

            def precheck(meta: pb.CallMeta) -> None:  # what `observe` will refuse, refused before the payload is read
                if not self._admits(meta, backward):
                    collab.precheck(meta, backward)

            call = await self._read(raw_frames, limits, deadline, caller, precheck)
            ticket = None
            n = self._samples(call)
            where = "admission" if self.schema.is_first and not backward else "its epoch (observe)"
            if self._admits(call.meta, backward):
                ticket = await collab.admit(call.meta.microbatch_id, n, deadline, caller)  # the batch it joins
            else:
                reply = await self._observe(
                    collab, call, n, backward, deadline
                )  # checks the admission the call carries
            where = "its computation"
            if reply is None and backward:
                # a task of its own, which the caller going away (its deadline passed) does not cancel: once the
                # compute thread has begun, the gradient counts, so the admission stays spent and the reply is kept
                # for the retry
                job = asyncio.ensure_future(self._backward(worker, collab, call, deadline))
                self._jobs.add(job)
                job.add_done_callback(self._job_done)
                reply = await asyncio.shield(job)
            elif reply is None:
                try:
                    reply = await worker.submit(functools.partial(self._compute, call, False, ticket), deadline, True)
                except BaseException:
                    if ticket is not None:  # admitted but never computed (or never returned): it will not come back
                        collab.release(ticket, call.meta.microbatch_id, n)
                    raise
        except WireError as e:
            self.requests_rejected += 1
            logger.warning("rejected %s request: %s", "Backward" if backward else "Forward", _short(str(e)))
            refusal = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except AdmissionRefused as e:
            refusal = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        except (Behind, TicketUnchecked) as e:
            refusal = grpc.StatusCode.UNAVAILABLE, str(e)
        except TicketRefused as e:
            self.requests_rejected += 1
            logger.warning("refused %s: %s", "Backward" if backward else "Forward", _short(str(e)))
            refusal = grpc.StatusCode.PERMISSION_DENIED, str(e)
        except Busy as e:
            self.requests_busy += 1
            refusal = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        except DeadlineExpired:
            refusal = grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before computing; nothing computed"
        except asyncio.CancelledError:
            if cancelled_here():  # the caller went away (or the server stops)
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug(
                        "%s of %s from %s: its caller went away after %.2fs, waiting for %s",
                        "Backward" if backward else "Forward",
                        call.meta.microbatch_id[:40] if call is not None else "?",
                        caller,
                        time.monotonic() - started,
                        where,
                    )
                raise
            # something this call waited for was cancelled, not the call: re-raised, it would end the handler
            # without a status, and the caller would hear nothing until its deadline
            logger.warning("%s interrupted while waiting for %s", "Backward" if backward else "Forward", where)
            refusal = grpc.StatusCode.UNAVAILABLE, f"interrupted while waiting for {where}; ask again"
        except grpc.aio.AbortError:
            raise
        except Exception:  # a bug, not the caller's fault: say so briefly, never with a traceback
            logger.exception("%s failed", "Backward" if backward else "Forward")
            refusal = grpc.StatusCode.INTERNAL, "internal error (see the server's log)"
        finally:
            self.active_calls -= 1
            for counts, key in ((self.calls_by_caller, caller), (self.calls_by_address, address)):
                if (left := counts.pop(key) - 1) > 0:
                    counts[key] = left
            if call is not None:
                self.budget.release(call.reserved, call.caller)
        if refusal is not None or reply is None:
            call = None
            await refuse(context, *(refusal or (grpc.StatusCode.INTERNAL, "no reply")))
        ready = time.monotonic()
        for frame in reply:
            yield frame
        if logger.isEnabledFor(logging.DEBUG):  # SWARM_DEBUG=1: where a slow call spent its time
            logger.debug(
                "%s of %s from %s: reply ready after %.2fs, sent after %.2fs",
                "Backward" if backward else "Forward",
                call.meta.microbatch_id[:40] if call is not None else "?",
                caller,
                ready - started,
                time.monotonic() - started,
            )

    async def _backward(self, worker: StageWorker, collab: Collaboration, call: Call, deadline: float | None):
        """After `_observe` registered the call's admission as computing (if it spent one here)."""
        key = ticket_key(call.meta)
        kept = self.replies.is_computing(key)
        reply = None
        try:
            reply = await worker.submit(functools.partial(self._compute, call, True), deadline, request=True)
        except BaseException:
            collab.unobserve(call.meta)  # not accumulated: its admission may come again
            raise
        finally:
            if kept:
                self.replies.done(key, reply)
        computed = time.monotonic()
        await collab.after_backward()  # publishes progress; may end the epoch (see server/collab/)
        logger.debug(
            "Backward of %s: computed, then its progress told in %.2fs",
            call.meta.microbatch_id[:40],
            time.monotonic() - computed,
        )
        return reply

    def _job_done(self, job: asyncio.Future) -> None:
        self._jobs.discard(job)
        if not job.cancelled():
            job.exception()  # the caller's call reports it; one whose caller went away needs no report

    async def _observe(
        self, collab: Collaboration, call: Call, n: int, backward: bool, deadline: float | None
    ) -> list[bytes] | None:
        """Checks the call's admission (collab.observe). A Backward whose admission was spent here already is a
        retry whose reply did not reach the caller: it gets that reply (kept, or awaited while the first attempt
        waits for its epoch or computes), or is judged afresh if the first attempt failed before it counted. A
        Backward that spends its admission here is registered as computing from that moment (`_backward` ends it)."""
        fingerprint = tensor_fingerprint(call.tensors, self._fingerprint_key) if backward else b""
        try:
            await self._observe_once(collab, call, n, backward, deadline, fingerprint)
            return None
        except TicketSpent:
            try:
                if (reply := await self.replies.recall(ticket_key(call.meta), fingerprint)) is None:
                    raise
                return reply
            except Uncounted:
                pass
        # TicketSpent again if a third attempt took it meanwhile
        await self._observe_once(collab, call, n, backward, deadline, fingerprint)
        return None

    async def _observe_once(
        self, collab: Collaboration, call: Call, n: int, backward: bool, deadline: float | None, fingerprint: bytes
    ) -> None:
        spent: list[tuple] = []  # the admission's key, once this call spent it

        def on_spent() -> None:
            spent.append(ticket_key(call.meta))
            self.replies.computing(spent[0], fingerprint)

        try:
            spend = on_spent if call.meta.admission_signature else None
            await collab.observe(call.meta, n, backward, on_spent=spend, deadline=deadline)
        except BaseException:
            if spent:  # refused, or its caller went away, before it counted: the admission is free again
                self.replies.done(spent[0], None)
            raise

    async def _read(
        self,
        raw_frames: AsyncIterator[bytes],
        limits: Limits,
        deadline: float | None,
        caller: str,
        on_meta: Callable[[pb.CallMeta], None] | None = None,
    ) -> Call:
        """The request (swarm.protocol.frames parses the raw frames; the payload stays in them until decoded). A caller
        that sets no deadline, or sends a header and then nothing, holds the call for `max_read_s` at most, and
        IDLE_READ_S without a frame.
        A request refused while its caller is still sending is read on (up to about its legitimate size) so that the
        caller gets the reason, not a failed write: DRAINING at a time, and up to 3 times as many waiting for a slot
        (swarm.protocol.drain); beyond that it is ended unread."""
        read_for = self.max_read_s if deadline is None else min(self.max_read_s, deadline - time.monotonic())
        started = time.monotonic()
        try:
            # in this task: asyncio.wait_for ran the read as a task of its own, and when the caller cancelled the call
            # as that task failed, its exception was never retrieved (logged as an asyncio error, 6 times in a soak)
            async with asyncio.timeout(read_for):
                return await read_call(
                    raw_frames, limits, self.budget, caller, idle_timeout=IDLE_READ_S, on_meta=on_meta
                )
        except TimeoutError:
            raise DeadlineExpired from None
        except (WireError, Busy, TicketRefused) as e:
            # drop the traceback (the reader's frames and the payload they hold) so that nothing but the garbage
            # collector would free them
            e.with_traceback(None)
            seconds = min(read_for - (time.monotonic() - started), DRAIN_S)
            await self.drains.drain(raw_frames, 2 * limits.max_tensor_bytes + CHUNK_BYTES, seconds, self._arrived)
            raise

    def _admits(self, meta: pb.CallMeta, backward: bool) -> bool:
        """Whether this call is stage 0's admission of a training microbatch; every other call carries one to check."""
        return self.schema.is_first and not backward and not meta.inference

    def _arrived(self, n: int) -> None:
        self.budget.arrived += n

    @staticmethod
    def _reply_codec(meta: pb.CallMeta, backward: bool) -> Codec:
        """The codec the caller asked for its reply, by name (with its settings) or else by wire value."""
        if meta.reply_codec_name:
            try:
                codec = get_codec(meta.reply_codec_name)
            except ValueError as e:
                raise WireError(f"reply codec: {e}") from None
            _expect(backward or not codec.gradients_only, f"reply codec {codec.name!r} is for Backward replies only")
            _expect(0 <= meta.reply_epilogue <= 1, f"reply_epilogue {meta.reply_epilogue} outside [0, 1]")
            return codec
        _expect(meta.reply_codec in CODECS_BY_WIRE, f"unknown reply codec {meta.reply_codec}")
        codec = CODECS_BY_WIRE[meta.reply_codec]
        _expect(not codec.gradients_only, f"reply codec {meta.reply_codec} must be named (reply_codec_name)")
        return codec

    def _samples(self, call: Call) -> int:
        """The batch size of a call's inputs, from its header (the payload is decoded and checked later)."""
        _expect("inputs" in call.tensors, "missing tensor 'inputs'")
        n = int(call.tensors["inputs"].header.shape[0])
        _expect(1 <= n <= self.schema.max_batch, f"batch {n} outside [1, {self.schema.max_batch}]")
        return n

    def _compute(self, call: Call, backward: bool, ticket: Ticket | None = None) -> list[bytes]:
        """Compute thread: decode, validate, run, encode. Raises WireError before touching the model on bad input."""
        meta, device, schema = call.meta, self.worker.device, self.schema
        _expect(meta.stage == schema.stage, f"this server serves stage {schema.stage}, the call is for {meta.stage}")
        codec = self._reply_codec(meta, backward)
        _expect("inputs" in call.tensors, "missing tensor 'inputs'")
        inputs = decode_checked(call.tensors["inputs"], device, "inputs", schema.bound)
        schema.check_inputs(inputs)
        for name, enc in call.tensors.items():  # names are the schema's (swarm.protocol.frames checked them)
            self.traffic.add(role_of(name, WIRE_TO_DTYPE[enc.header.dtype]), enc)
        if not schema.is_first:
            inputs = inputs.float()
        reply_meta = pb.CallMeta(
            protocol_version=PROTOCOL_VERSION, microbatch_id=meta.microbatch_id, stage=schema.stage
        )
        if not backward:
            outputs = self.worker.forward(inputs)
            check_values(outputs, "this stage's outputs", schema.bound)
            tensors = [encode_tensor("outputs", outputs, codec)]
        else:
            other_name = "labels" if schema.is_last else "grad_outputs"
            _expect(other_name in call.tensors, f"missing tensor {other_name!r}")
            other = decode_checked(call.tensors[other_name], device, other_name, schema.bound)
            schema.check_backward(inputs, other)
            global_batch = meta.global_batch if meta.HasField("global_batch") else None
            admission = admission_of(meta, int(inputs.shape[0])) if global_batch is not None else None
            if schema.is_last:  # its Backward runs the forward itself: no earlier forward to match
                result = self.worker.backward(
                    inputs, labels=other, global_batch=global_batch, admission=admission, caller=call.caller
                )
                assert result.loss is not None  # the last stage computes it
                reply_meta.loss, reply_meta.has_loss = result.loss, True
                self.losses.append(result.loss)
            else:
                version = meta.forward_version if meta.HasField("forward_version") else None
                result = self.worker.backward(
                    inputs,
                    grad_outputs=other.float(),
                    forward_version=version,
                    global_batch=global_batch,
                    admission=admission,
                    caller=call.caller,
                )
            tensors = []
            if (
                codec.gradients_only
                and 0 < meta.reply_epilogue < 1
                and self.collab.batch_done() <= 1 - meta.reply_epilogue
            ):
                codec = CODECS_BY_WIRE[pb.CODEC_BLOCKWISE8]  # not in the batch's epilogue: 8-bit, no error carried
            if result.grad_inputs is not None:
                # a stateful codec carries its error to the next microbatch of the same global batch (the parameters
                # it was computed at), never past a step; without stage 0's tag, the version it was computed at
                batch = global_batch if global_batch is not None else self.worker.param_version
                ctx = CodecContext(TensorRole.ACTIVATION_GRADIENTS, "grad_inputs", self.codec_memory, batch)
                tensors = [encode_tensor("grad_inputs", result.grad_inputs, codec, ctx)]
        for enc in tensors:
            self.traffic.add(role_of(enc.header.name, WIRE_TO_DTYPE[enc.header.dtype]), enc)
        reply_meta.param_version, reply_meta.queue_length = self.worker.param_version, self.worker.queue_length
        if ticket is not None:  # stage 0 admitted this microbatch: its later calls carry where it belongs
            reply_meta.global_batch, reply_meta.admitted_at = ticket.global_batch, ticket.admitted_at
            reply_meta.admitted_by, reply_meta.admission_signature = ticket.signer, ticket.signature
        return list(iter_frames(reply_meta, tensors))
