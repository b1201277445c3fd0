"""The all-reduce a round of ours runs: ExactAllReduceRunner, after which every peer holds the same averaged values or
the round fails for all, with ClippedPartReducer's robust mean when asked; and balance_parts, each peer's share."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import typing

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.load_balancing import hagenbach_bishoff, load_balance_peers
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import CompressionInfo, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished

logger = logging.getLogger(__name__)
CLIP_ITERATIONS = 3  # CenteredClip's iterations (robust aggregation; its paper finds 1-3 enough from a good start)
# how long a reducer holds a sender's stream after its last averaged part (and a peer its state download after the
# end marker) for the other side to read it and close the stream, as ours does at once: closed by the sending side
# right after its last message, that message was lost in flight now and then (download.py SharesState.reply_linger_s)
REPLY_LINGER_S = 5.0


def balance_parts(vector_size: int, bandwidths: typing.Sequence[float | None], min_size: int) -> tuple[int, ...]:
    """hivemind's `load_balance_peers` (each peer's share of a round's values), without its linear program where every
    peer declares the same bandwidth (the fixed groups' 1.0): the program then gives equal parts, and costs 2 ms or
    more of the averager's CPU per round. Every peer of the round computes the same split from the same group."""
    first = bandwidths[0] if bandwidths else None  # hivemind's None: a peer that declared none
    if first is not None and first > 0 and all(bw == first for bw in bandwidths):
        return tuple(hagenbach_bishoff(vector_size, [1.0] * len(bandwidths)))
    return load_balance_peers(vector_size, bandwidths, min_size)


class ClippedPartReducer(TensorPartReducer):
    """A reducer whose part is robust to a minority of senders sending garbage: CenteredClip (Karimireddy, He and
    Jaggi, "Learning from History for Byzantine Robust Optimization", ICML 2021), per part as in BTARD (Gorbunov et
    al., 2022), weighted by the senders' weights. From the medoid v (the sent part with the least total distance to
    the others: robust while fewer than half the senders attack, and, unlike the coordinate-wise median, cheap: a
    tenth of the time on CPU), `iterations` times: v += sum_i w_i (x_i - v) min(1, tau / |x_i - v|), with tau =
    `clip` times the median distance of the parts to the medoid. Honest parts, about as far from each other as from
    the medoid, pass nearly unchanged; one far away moves the result by at most its weight times tau per
    iteration, however large it is. With fewer than 3 senders nobody is an
    outlier: the plain weighted mean. The reducer computes its part once and sends it to every peer, so peers still end
    bitwise equal. `clipped`: per sender index, the parts it sent that were clipped to under half their distance."""

    def __init__(self, part_shapes, num_senders: int, clip: float, iterations: int = CLIP_ITERATIONS):
        self.clip, self.iterations = clip, iterations
        self.received: dict[int, dict[int, tuple[torch.Tensor, float]]] = {}  # part -> sender -> (part, weight)
        self.clipped = [0] * num_senders
        super().__init__(part_shapes, num_senders)

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        if not self.finished.is_set():
            self.received.setdefault(part_index, {})[sender_index] = (tensor_part, weight)
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight)

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            index = self.current_part_index
            counted = [  # as the accumulator counted them: a sender banned later keeps the parts it had sent
                (sender, *sent)
                for sender, sent in self.received.pop(index, {}).items()
                if index < self.sender_failed_after[sender]
            ]
            self.current_part_future.set_result(self._robust_mean(counted))
            self.reset_accumulators()

    def _robust_mean(self, parts: list[tuple[int, torch.Tensor, float]]) -> torch.Tensor:
        parts = [part for part in parts if part[2] > 0]  # a peer without samples is in no median
        if len(parts) < 3 or self.denominator <= 0:
            return self.accumulator.div_(self.denominator)
        x = torch.stack([part.flatten().float() for _, part, _ in parts])
        w = torch.tensor([weight for _, _, weight in parts], dtype=torch.float32) / self.denominator
        apart = torch.cdist(x[None], x[None], compute_mode="donot_use_mm_for_euclid_dist")[0]
        start = int(apart.sum(dim=1).argmin())  # the medoid: a sent part, the closest to all others
        v, tau = x[start], self.clip * apart[start].median()
        for _ in range(self.iterations):
            shift = x - v
            distance = shift.norm(dim=1)
            scale = (tau / distance.clamp_min(torch.finfo(torch.float32).tiny)).clamp(max=1.0)
            v = v + (w * scale) @ shift
        for (sender, _, _), s in zip(parts, scale.tolist(), strict=True):
            self.clipped[sender] += s < 0.5
        return v.view(self.accumulator.shape)

    def finalize(self) -> None:
        self.received.clear()
        super().finalize()


class ExactAllReduceRunner(AllReduceRunner):
    """An all-reduce after which every peer holds the same averaged values, bit for bit.

    hivemind's reducer of a part sends each sender the difference between the part's average and that sender's own
    (compressed) part, and each sender adds it to its exact local values: with a lossy codec every peer ends with a
    different average (its own compression error stays in it), and peers of a stage drift apart step after step. Here
    the reducer sends the average itself, encoded by the same deterministic codec for every sender, and keeps for its
    own part exactly what it sends: the decoded average. The codec's error remains, but it is the same on every
    peer. Peers running hivemind's own runner would send differences: the averagers' DHT prefix carries the protocol
    version, so they never meet."""

    tensor_part_reducer: TensorPartReducer

    def __init__(
        self,
        robust_clip: float = 0.0,
        max_weight: float = math.inf,
        max_total_weight: float = math.inf,
        weight_caps: dict[PeerID, float] | None = None,
        reply_linger_s: float = REPLY_LINGER_S,
        **kwargs,
    ):
        """`robust_clip` > 0: the parts we reduce are a robust mean (ClippedPartReducer), not the weighted mean.
        `max_weight`: the most a sender weighs in the parts we reduce, whatever it declares (its samples: no more
        than one epoch can hold); a weight that is negative, not finite, or changes between parts fails the round.
        `max_total_weight`: the most the whole group can weigh (the samples of one epoch, which its peers share): a
        group whose senders declare more together fails the round, so a peer that overstates its samples can take
        only what its peers left, not the cap each. `weight_caps`: the most each other sender weighs there (the
        samples its admissions prove: server/collab/served.py); a sender it does not name weighs nothing (None: no
        such caps)."""
        self.max_weight, self.max_total_weight, self.weight_caps = max_weight, max_total_weight, weight_caps
        self.reply_linger_s = reply_linger_s
        self.complete_senders: set[PeerID] = set()  # senders all of whose parts we reduced: never banned after
        self.weights: dict[int, float] = {}  # sender index -> its weight as we count it, from its first part
        super().__init__(**kwargs)
        self.tensor_part_container.return_deltas = False  # outputs are averages, not differences
        if robust_clip > 0:  # nothing has been reduced yet: the runner starts when awaited
            reducer = self.tensor_part_reducer
            self.tensor_part_reducer = ClippedPartReducer(reducer.part_shapes, reducer.num_senders, robust_clip)
            reducer.finished.set()  # unused: dropped without hivemind's "received 0% of input tensors" warning
        self.reducer_failed = asyncio.Event()

    async def outputs(self, gather_timeout: float | None = None) -> list[torch.Tensor]:
        """The averaged tensors; raises AllreduceException as soon as a reducer fails. Its part will not be averaged,
        so the round has failed: ending it now (our peers' parts to us are refused from then on) spares us and them
        the wait for every timeout to run out. `gather_timeout`: the round also fails unless every peer of the group
        has begun sending us its part by then (a fixed group: a member that is frozen, or never comes)."""
        outputs: list[torch.Tensor] = []

        async def collect() -> None:
            async for averaged in self:
                outputs.append(averaged)

        task = asyncio.create_task(collect())
        failed = asyncio.create_task(self.reducer_failed.wait())
        try:
            done, _ = await asyncio.wait({task, failed}, timeout=gather_timeout, return_when=asyncio.FIRST_COMPLETED)
            if done or self.all_senders_started.is_set():
                await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
            else:
                missing = [str(p) for p in self.sender_peer_ids if p not in self.active_senders]
                logger.info("members %s did not reach the round within %.1fs", missing, gather_timeout)
        finally:
            failed.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if self._future.done() and not self._future.cancelled():
                self._future.exception()  # the cancellation hivemind's `run` stored: retrieved, so not logged
            raise AllreduceException(f"{self.tensor_part_container.failed_size} values were not averaged")
        task.result()
        return outputs

    def _as_sent(self, averaged: torch.Tensor, info: CompressionInfo) -> torch.Tensor:
        """`averaged` as the senders of its part receive it: encoded with the codec of that part's tensor (one codec
        per averager, or one per tensor with hivemind's PerTensorCompression)."""
        compression = self.tensor_part_container.compression
        if isinstance(compression, AdaptiveCompressionBase):
            compression = compression.choose_compression(info)
        return deserialize_torch_tensor(serialize_torch_tensor(averaged, compression.compression_type))

    async def _communicate_with_peer(self, peer_id: PeerID):
        if peer_id != self.peer_id:  # a remote reducer: what it sends back is registered as it comes
            try:
                return await self._from_reducer(peer_id)
            except Exception as e:
                self.reducer_failed.set()  # its part will not be averaged: the round has failed (see `outputs`)
                logger.info("the part %s reduces for us did not come back: %r", str(peer_id)[-6:], e)
                raise
        peer_index, sender_index = self.ordered_peer_ids.index(peer_id), self.sender_peer_ids.index(peer_id)
        if not self._weigh(sender_index, self.weight):
            raise AllreduceException("the group weighs more than one epoch holds")
        loop = asyncio.get_running_loop()
        infos = [info for _, info in self.tensor_part_container._input_parts_by_peer[peer_index]]  # our parts' tensors
        for part_index, part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(  # capped as a remote sender's would be
                sender_index, part_index, part, weight=self.weights[sender_index]
            )
            info = infos[part_index]
            as_sent = await loop.run_in_executor(None, self._as_sent, averaged, info)  # codec work off the event loop
            self.tensor_part_container.register_processed_part(peer_index, part_index, as_sent)

    async def _from_reducer(self, peer_id: PeerID) -> None:
        """Streams our part to the remote peer that reduces it and registers each averaged part it sends back (as
        hivemind's `_communicate_with_peer` does), but closes the stream as soon as the last part has come, instead
        of reading on until the reducer closes it: a reducer that closed right after its last part lost that part in
        flight now and then (the round failed, "sent 2 parts, but we expected 3"), so ours holds the stream until
        the sender closes it (`_accumulate_parts_streaming`, `reply_linger_s`)."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        try:
            await self._exchange_with(peer_id, peer_index)
        except BaseException:
            if not self.tensor_part_container.finished.is_set():  # (a finished round has let its parts go)
                self.tensor_part_container.register_failed_reducer(peer_index)  # as hivemind's: the outputs end
            raise

    async def _exchange_with(self, peer_id: PeerID, peer_index: int) -> None:
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        done_sending = asyncio.Event()
        inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)

        def decoded(message: averaging_pb2.AveragingData) -> torch.Tensor:
            if message.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
            return deserialize_torch_tensor(message.tensor_part)

        received = 0
        async with contextlib.aclosing(await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)) as stream:
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            parts = amap_in_executor(
                decoded,
                aiter_with_timeout(stream, self.reducer_timeout),
                max_prefetch=self.tensor_part_container.prefetch,
            )
            async with contextlib.aclosing(parts):  # before the stream: it reads the stream
                async for averaged in parts:
                    self.tensor_part_container.register_processed_part(peer_index, received, averaged)
                    received += 1
                    if received == expected:
                        break
        if received != expected:
            raise AllreduceException(f"peer {peer_id} sent {received} parts, but we expected {expected}")

    def _weigh(self, sender_index: int, weight: float) -> bool:
        """Count a sender's weight (capped); False, and the round failed, if the senders counted so far weigh more
        than `max_total_weight` together. Weights are >= 0, so a total over the bound stays over it, and it is found
        before the first part is reduced (that part waits for every sender, and each is weighed first). The reducer
        is then finalized (`_fail_round`)."""
        self.weights[sender_index] = counted = min(weight, self._cap_of(sender_index))
        if counted < weight and self.weight_caps is not None:
            logger.info(
                "%s's part declares %g samples, its admissions prove %g: it weighs %g in our parts",
                str(self.sender_peer_ids[sender_index])[-6:],
                weight,
                self.weight_caps.get(self.sender_peer_ids[sender_index], 0.0),
                counted,
            )
        total = sum(self.weights.values())
        if total <= self.max_total_weight:
            return True
        logger.warning(
            "the group's parts weigh %g samples together, more than one epoch holds (%g): a peer overstates its "
            "samples (declared so far, by sender: %s); the round fails",
            total,
            self.max_total_weight,
            {str(self.sender_peer_ids[i])[-6:]: w for i, w in sorted(self.weights.items())},
        )
        self._fail_round()
        return False

    async def _ban_sender(self, peer_id: PeerID) -> None:
        """A sender that failed (it never came within the sender timeout, broke off, or broke a rule): hivemind's
        reducer would average our part without it and send that part to the others, who would end the round as a
        success while we fail it (CI: a tied round whose third listed peer never came, one peer stepped on the other
        two's average). The round fails for every peer instead. A sender whose parts we all reduced is in every
        part: its stream ending (as it does once it has read our replies) is no failure."""
        if peer_id in self.complete_senders:
            return
        async with self.banlock:
            if peer_id not in self.banned_senders:
                self.banned_senders.add(peer_id)
                self._fail_round()

    def _cap_of(self, sender_index: int) -> float:
        """The most a sender's part weighs in the parts we reduce; ours weighs what we declare, up to `max_weight`."""
        peer = self.sender_peer_ids[sender_index]
        if self.weight_caps is None or peer == self.peer_id:
            return self.max_weight
        return min(self.max_weight, self.weight_caps.get(peer, 0.0))

    def _fail_round(self) -> None:
        """A sender broke the round's rules: no part of ours reaches anyone (hivemind's reducer would go on without
        the sender and hand the others a part it left out), so every peer's round fails, and ours at once."""
        self.tensor_part_reducer.finalize()
        self.reducer_failed.set()

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        """Reducer side: add each part a sender streams to the accumulator; answer with the part's average."""
        part_index, declared = 0, 0.0
        loop = asyncio.get_event_loop()
        try:
            async for part, weight, compression in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if not 0 <= weight < math.inf or (part_index and weight != declared):  # NaN too
                    logger.warning(
                        "%s sent a part weighing %r (a finite weight >= 0, the same for every part): its values are "
                        "refused",
                        str(self.sender_peer_ids[sender_index])[-6:],
                        weight,
                    )
                    break  # banned (below), which fails the round: no average with a sign flipped or NaN
                if not part_index and not self._weigh(sender_index, weight):
                    break  # banned (below): the round fails
                declared = weight
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=self.weights[sender_index]
                    )
                    part_index += 1
                    if part_index == self.tensor_part_reducer.num_parts:  # in every part now: `_ban_sender`
                        self.complete_senders.add(self.sender_peer_ids[sender_index])
                except BannedException:
                    break  # the sender was banned meanwhile: its parts are no longer needed
                reply = await loop.run_in_executor(None, serialize_torch_tensor, averaged, compression)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=reply)
            if part_index == self.tensor_part_reducer.num_parts:
                # every part came back averaged: hold the stream until the sender, having read them all, closes it
                # (hivemind's stream handler then cancels this call, and the runner's handler bans whoever it was
                # serving: `_ban_sender` spares a complete sender). Closed by us right after the last part, that part
                # was lost in flight now and then. A reply cut short ends at once: its sender learns the round failed.
                del part, averaged, reply  # a part each: not held while we wait
                await asyncio.sleep(self.reply_linger_s)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
