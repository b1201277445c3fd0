"""The gRPC face of a stage: parse, validate, enforce the deadline, delegate to the worker, encode the reply.

Nothing that arrives is trusted. Headers are checked before payloads are buffered (swarm.protocol.frames), tensors are
checked against the stage's schema after decoding (server/schema.py), and a bad request ends in INVALID_ARGUMENT for
that call only; server/errors.py says which status every other failure ends a call with.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import grpc

from server.calls import CallCounts
from server.collab import Collaboration, ProgressRefused
from server.collab.tickets import Ticket, TicketRefused, TicketSpent, admission_of, ticket_key
from server.compute import DeadlineExpired
from server.config import GuardConfig
from server.errors import Tally, refusal_of, refuse, shortened
from server.replies import ReplyCache, Uncounted, reply_frames
from server.schema import StageSchema, expect, well_formed_progress_call
from server.worker import StageWorker
from swarm.compression import WIRE_TO_DTYPE, CodecContext, TensorRole
from swarm.compression.memory import ErrorMemory
from swarm.compression.policy import epilogue_codec, requested_reply_codec, role_of
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.drain import Drains
from swarm.protocol.frames import Busy, ByteBudget, Call, Limits, address_of, read_call
from swarm.protocol.rpc import CHUNK_BYTES, PROTOCOL_VERSION, stage_handler
from swarm.protocol.tensors import EncodedTensor, WireError, WireStats, check_values, decode_checked, encode_tensor
from swarm.protocol.tensors import fingerprint as tensor_fingerprint
from swarm.tasks import cancelled_here

logger = logging.getLogger(__name__)

MAX_READ_S = 120.0  # the longest a request may take to arrive
# the longest a request may go without a frame (a chunk of CHUNK_BYTES: 2 MiB arrive in 30 s at 0.6 Mb/s)
IDLE_READ_S = 30.0
DRAIN_S = 5.0  # the longest a refused request is read on
DRAINING = 16  # refused requests read on at once; up to 3 times as many wait for a slot (swarm.protocol.drain)
LOSS_WINDOW = 20  # backwards averaged in the last stage's reported (recent) loss


def caller_of(context: grpc.aio.ServicerContext) -> str:
    """Who calls: its connection ("ipv4:203.0.113.7:51234"), or its libp2p id ("p2p:12D3KooW...": authenticated by
    libp2p). Per-caller limits hold per caller, and per address (swarm.protocol.frames `address_of`) for all of its
    callers together."""
    return context.peer() or ""


@dataclass
class InFlight:
    """How far one Forward or Backward got (event loop): the request once read, whose budget bytes it holds until it
    ends, and what it waits for now (SWARM_DEBUG logs it for a call its caller gave up on)."""

    call: Call | None = None
    where: str = "reading"

    @property
    def microbatch(self) -> str:
        return self.call.meta.microbatch_id[:40] if self.call is not None else "?"


def _kind(backward: bool) -> str:
    return "Backward" if backward else "Forward"


class StageService:
    """A stage's four RPCs (event loop). Forward and Backward are parsed, validated and delegated to the worker
    (`_serve`); Progress goes to the collaboration; Info reports. A move swaps worker, schema and collaboration."""

    def __init__(
        self, worker: StageWorker, schema: StageSchema, collab: Collaboration, guard: GuardConfig | None = None
    ):
        self.worker, self.schema, self.collab = worker, schema, collab
        self.guard = guard or GuardConfig()
        self.budget = ByteBudget(self._budget_bytes(), self.guard.max_caller_share)
        self.drains = Drains(DRAINING)
        self.calls = CallCounts()  # Forward/Backward calls between arrival and reply
        self.replies = ReplyCache(max(self.budget.limit // 4, 8 << 20))
        self._jobs: set[asyncio.Future] = set()  # Backwards computing (asyncio keeps only weak references to tasks)
        self.requests_rejected = 0
        self.requests_busy = 0  # turned away with RESOURCE_EXHAUSTED: too many calls or bytes held
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
    def active_calls(self) -> int:
        return self.calls.active

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
        try:
            ack = await self.collab.on_progress(msg) if well_formed_progress_call(msg, self.schema.stage) else None
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
        """One Forward or Backward: turned away at once if the server holds too much, else read, checked, computed
        (`_answer`) and replied to, or refused with the status its failure maps to (server/errors.py)."""
        started = time.monotonic()
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        caller = caller_of(context)
        address = address_of(caller)
        turned_away = self.calls.turned_away(caller, address, self.guard)
        if self.paused is not None:  # moving or leaving: trainers retry on another peer of the stage
            turned_away = grpc.StatusCode.UNAVAILABLE, self.paused
        if turned_away is not None:
            if turned_away[0] == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.requests_busy += 1
            # read on (dropping it) what the caller still sends, for its refusal to reach it (swarm.protocol.drain)
            seconds = DRAIN_S if deadline is None else min(DRAIN_S, deadline - time.monotonic())
            await self._drain(raw_frames, self._limits(backward), seconds)
            await refuse(context, *turned_away)
        worker, collab = self.worker, self.collab  # a move swaps them: this call finishes on the stage it began on
        self.calls.hold(caller, address)
        at = InFlight()
        # (status, message) to end the call with. Refused after the `except` blocks, not in them: an abort raised
        # there would chain the caught exception, whose traceback holds this call's frames and buffers, into a
        # reference cycle with gRPC's handler that only the garbage collector frees (bench_flood: RSS rose ~200 MB
        # per burst of refusals)
        refusal: tuple[grpc.StatusCode, str] | None = None
        reply: list[bytes] | None = None
        try:
            reply = await self._answer(worker, collab, raw_frames, backward, deadline, caller, at)
        except asyncio.CancelledError:
            if cancelled_here():  # the caller went away (or the server stops)
                logger.debug(
                    "%s of %s from %s: its caller went away after %.2fs, waiting for %s",
                    _kind(backward),
                    at.microbatch,
                    caller,
                    time.monotonic() - started,
                    at.where,
                )
                raise
            # something this call waited for was cancelled, not the call: re-raised, it would end the handler
            # without a status, and the caller would hear nothing until its deadline
            logger.warning("%s interrupted while waiting for %s", _kind(backward), at.where)
            refusal = grpc.StatusCode.UNAVAILABLE, f"interrupted while waiting for {at.where}; ask again"
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            refusal = self._refusal(e, backward)
        finally:
            self.calls.release(caller, address)
            if at.call is not None:
                self.budget.release(at.call.reserved, at.call.caller)
        if refusal is not None or reply is None:
            at.call = None
            await refuse(context, *(refusal or (grpc.StatusCode.INTERNAL, "no reply")))
        ready = time.monotonic()
        for frame in reply:
            yield frame
        logger.debug(  # SWARM_DEBUG=1: where a slow call spent its time
            "%s of %s from %s: reply ready after %.2fs, sent after %.2fs",
            _kind(backward),
            at.microbatch,
            caller,
            ready - started,
            time.monotonic() - started,
        )

    async def _answer(
        self,
        worker: StageWorker,
        collab: Collaboration,
        raw_frames: AsyncIterator[bytes],
        backward: bool,
        deadline: float | None,
        caller: str,
        at: InFlight,
    ) -> list[bytes] | None:
        """Reads the call (parse), checks its batch and its admission (validate: stage 0 admits a new microbatch,
        every other call's admission is observed) and has the worker compute it (delegate; its tensors are checked on
        the compute thread, `_compute`). The reply's frames; a retried Backward gets those of its first attempt."""

        def precheck(meta: pb.CallMeta) -> None:  # what `observe` will refuse, refused before the payload is read
            if not self._admits(meta, backward):
                collab.precheck(meta, backward)

        at.call = call = await self._read(raw_frames, self._limits(backward), deadline, caller, precheck)
        ticket = None
        n = self.schema.samples(call)
        at.where = "admission" if self.schema.is_first and not backward else "its epoch (observe)"
        if self._admits(call.meta, backward):
            ticket = await collab.admit(call.meta.microbatch_id, n, deadline, caller)  # the batch it joins
        elif (kept := await self._observe(collab, call, n, backward, deadline)) is not None:  # checks its admission
            return kept
        at.where = "its computation"
        if backward:
            # a task of its own, which the caller going away (its deadline passed) does not cancel: once the compute
            # thread has begun, the gradient counts, so the admission stays spent and the reply is kept for the retry
            job = asyncio.ensure_future(self._backward(worker, collab, call, deadline))
            self._jobs.add(job)
            job.add_done_callback(self._job_done)
            return await asyncio.shield(job)
        try:
            return await worker.submit(functools.partial(self._compute, call, False, ticket), deadline, True)
        except BaseException:
            if ticket is not None:  # admitted but never computed (or never returned): it will not come back
                collab.release(ticket, call.meta.microbatch_id, n)
            raise

    def _refusal(self, e: Exception, backward: bool) -> tuple[grpc.StatusCode, str]:
        """The status and message `e` ends its call with, counted and logged as server/errors.py says."""
        if (refusal := refusal_of(e)) is None:  # a bug, not the caller's fault: say so briefly, never with a traceback
            logger.exception("%s failed", _kind(backward))
            return grpc.StatusCode.INTERNAL, "internal error (see the server's log)"
        if refusal.tally is Tally.REJECTED:
            self.requests_rejected += 1
        elif refusal.tally is Tally.BUSY:
            self.requests_busy += 1
        if refusal.warning is not None:
            logger.warning(refusal.warning, _kind(backward), shortened(str(e)))
        return refusal.code, str(e) if refusal.message is None else refusal.message

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
            await self._drain(raw_frames, limits, min(read_for - (time.monotonic() - started), DRAIN_S))
            raise

    def _admits(self, meta: pb.CallMeta, backward: bool) -> bool:
        """Whether this call is stage 0's admission of a training microbatch; every other call carries one to check."""
        return self.schema.is_first and not backward and not meta.inference

    def _arrived(self, n: int) -> None:
        self.budget.arrived += n

    def _limits(self, backward: bool) -> Limits:
        return self.schema.backward_limits if backward else self.schema.forward_limits

    async def _drain(self, raw_frames: AsyncIterator[bytes], limits: Limits, seconds: float) -> None:
        """Reads on, for up to `seconds`, and drops about a request's worth of what a refused caller still sends."""
        await self.drains.drain(raw_frames, 2 * limits.max_tensor_bytes + CHUNK_BYTES, seconds, self._arrived)

    def _compute(self, call: Call, backward: bool, ticket: Ticket | None = None) -> list[bytes]:
        """Compute thread: decode, validate, run, encode. Raises WireError before touching the model on bad input."""
        meta, device, schema = call.meta, self.worker.device, self.schema
        expect(meta.stage == schema.stage, f"this server serves stage {schema.stage}, the call is for {meta.stage}")
        try:
            codec = requested_reply_codec(meta, backward)
        except ValueError as e:  # what the caller asked for: its fault
            raise WireError(str(e)) from None
        expect("inputs" in call.tensors, "missing tensor 'inputs'")
        inputs = decode_checked(call.tensors["inputs"], device, "inputs", schema.bound)
        schema.check_inputs(inputs)
        self._count(call.tensors.values())  # names are the schema's (swarm.protocol.frames checked them)
        if not schema.is_first:
            inputs = inputs.float()
        loss = None
        if not backward:
            outputs = self.worker.forward(inputs)
            check_values(outputs, "this stage's outputs", schema.bound)
            tensors = [encode_tensor("outputs", outputs, codec)]
        else:
            other_name = "labels" if schema.is_last else "grad_outputs"
            expect(other_name in call.tensors, f"missing tensor {other_name!r}")
            other = decode_checked(call.tensors[other_name], device, other_name, schema.bound)
            schema.check_backward(inputs, other)
            global_batch = meta.global_batch if meta.HasField("global_batch") else None
            admission = admission_of(meta, int(inputs.shape[0])) if global_batch is not None else None
            if schema.is_last:  # its Backward runs the forward itself: no earlier forward to match
                result = self.worker.backward(
                    inputs, labels=other, global_batch=global_batch, admission=admission, caller=call.caller
                )
                assert result.loss is not None  # the last stage computes it
                loss = result.loss
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
            codec = epilogue_codec(codec, meta.reply_epilogue, self.collab.batch_done)
            if result.grad_inputs is not None:
                # a stateful codec carries its error to the next microbatch of the same global batch (the parameters
                # it was computed at), never past a step; without stage 0's tag, the version it was computed at
                batch = global_batch if global_batch is not None else self.worker.param_version
                ctx = CodecContext(TensorRole.ACTIVATION_GRADIENTS, "grad_inputs", self.codec_memory, batch)
                tensors = [encode_tensor("grad_inputs", result.grad_inputs, codec, ctx)]
        self._count(tensors)
        w = self.worker
        return reply_frames(
            meta,
            schema.stage,
            tensors,
            param_version=w.param_version,
            queue_length=w.queue_length,
            loss=loss,
            ticket=ticket,
        )

    def _count(self, tensors: Iterable[EncodedTensor]) -> None:
        """Adds the tensors of a call or a reply to this server's traffic, by role (compute thread)."""
        for enc in tensors:
            self.traffic.add(role_of(enc.header.name, WIRE_TO_DTYPE[enc.header.dtype]), enc)
