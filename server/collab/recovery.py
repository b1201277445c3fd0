"""How a peer gets back to the stage's one model: joining, copying the reference after a failed round, catching up.

Every state transfer goes through the stage averager's state sharing: parameters, optimizer state and epoch, read
under the worker's state lock by the sender, loaded on the receiver's compute thread (which drops the gradients of
the epoch it leaves).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import Iterable
from concurrent.futures import Executor

import torch

from server.collab.progress import StagePeers
from server.collab.stage_averager import StageAverager
from server.config import AveragingConfig
from server.optim import MAX_BOUNDED_STEPS
from server.state import state_digest
from server.worker import StageWorker

logger = logging.getLogger(__name__)
UNUSABLE_STATE = (ValueError, KeyError, TypeError, AttributeError)  # what loading a malformed state raises
PROBE_S = 1.0  # how often a peer waiting for the stage's reference to step asks whether it still answers
JOIN_READS = 3  # DHT reads a joining peer tries before it gives up: a peer that took a read's timeout for an empty
# stage would start from the seed beside peers that are epochs ahead


VOUCHERS = 4  # other peers of the stage asked whether they hold a state downloaded from one of them, at most


class NotOneStep(Exception):
    """A state downloaded from the peer that stepped alone after a failed round (or from one we catch up from, which
    holds a descendant of our state: `Recovery.load_checked`), one version past ours, is not our state after one
    step on an honest gradient (server/state.py `StateChecks.not_one_step_from_ours`); at another version, it is
    behind ours or out of reach of ours in that many steps (`StateChecks.not_within_steps_of_ours`); or it is
    malformed."""


class Unvouched(ValueError):
    """A downloaded state that more of the stage's other peers at its epoch contradict than confirm."""


def vouched(epoch: int, digest: str, told: Iterable[tuple[int, str]]) -> bool:
    """Pure. Whether a state of `epoch` whose digest is `digest`, downloaded from one peer of the stage, may be loaded,
    given the (epoch, digest) other peers `told` of their own states: unless two or more of those at its epoch hold
    one other state, and more of them than hold this one, its sender counted with the latter. So one peer's state
    cannot stand against two that agree on another. Peers at other epochs say nothing of it (behind: catching up
    themselves, or restarted; ahead: the state is stale, and the next catch-up takes theirs), and one word stands
    against another: peers whose optimizers round differently (a CPU and a GPU in one stage) each hold a state of
    their own, and a peer catching up must still take one."""
    others = collections.Counter(d for e, d in told if e == epoch and d != digest)
    held = 1 + sum(1 for e, d in told if e == epoch and d == digest)
    return not any(n >= 2 and n > held for n in others.values())


class Recovery:
    """State transfers of one stage peer. Methods say which thread they run on."""

    def __init__(
        self,
        worker: StageWorker,
        averager: StageAverager,
        peers: StagePeers,
        cfg: AveragingConfig,
        stage: int,
        pool: Executor,
    ):
        self.worker, self.averager, self.peers, self.cfg, self.stage, self.pool = (
            worker,
            averager,
            peers,
            cfg,
            stage,
            pool,
        )
        self.downloads = 0  # states loaded from peers
        self.unvouched = 0  # downloaded states refused because the stage's other peers hold another (`vouch`)
        # the lineage (server/worker.py) of the last state we took from the stage, or held when we started it; None
        # after a join that found peers and took no state (we start from our own start or checkpoint beside them)
        self._taken_lineage: str | None = worker.lineage
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop's (set at start), for the compute thread

    async def join(self) -> bool:
        """Download parameters, optimizer state and epoch from live peers of the stage. False when there are none or
        none answered: a new stage, whose first peers all start from the shared seed (or a checkpoint)."""
        await self._read_peers()
        if not self.peers.peers:
            return False
        logger.info("stage %d has %d live peers: downloading their state", self.stage, len(self.peers.peers))
        # only from peers with a signed record on this stage, by name: hivemind's own choice would take any peer
        # under the averager's prefix (and its record of who shares state can lag behind: see `download_state`)
        # A state the others did not hold may have been one of a peer in the middle of a step (delayed steps): we ask
        # again for up to twice the averaging timeout before starting alone
        patience = time.monotonic() + 2 * self.cfg.averaging_timeout
        attempt, refused = 0, self.unvouched
        while attempt < 2 or (self.unvouched > refused and time.monotonic() < patience):
            if attempt > 0:
                await asyncio.sleep(1.0)
                await self._read_peers()
            attempt += 1
            distrusted = self.peers.distrusted(self.worker.epoch)
            for peer_id in sorted(p for p in self.peers.peers if p not in distrusted):
                logger.info("stage %d: asking %s for its state", self.stage, peer_id[-6:])
                if await self.download(peer_id, attempts=1):
                    return True
        self._taken_lineage = None
        if self.unvouched > refused:
            logger.error(
                "stage %d: the states our peers sent are not the one the stage's other peers hold (%d refused): "
                "joining from our own start, and copying the stage's state once its peers agree",
                self.stage,
                self.unvouched - refused,
            )
        else:
            logger.warning("stage %d: no peer sent its state", self.stage)
        return False

    async def _read_peers(self) -> None:
        """The stage's peers from the DHT, read again when a read times out (seen once on a loaded 2-core machine);
        raises when none of JOIN_READS reads answered."""
        for attempt in range(1, JOIN_READS + 1):
            try:
                await self.peers.refresh()
                return
            except TimeoutError:
                logger.warning("stage %d: the DHT did not answer (read %d of %d)", self.stage, attempt, JOIN_READS)
        raise RuntimeError(
            f"stage {self.stage}: the DHT did not answer {JOIN_READS} reads: cannot tell whether the "
            "stage has peers to copy, so not joining it"
        )

    async def download(
        self, source: str, attempts: int = 3, keep_gradients: bool = False, vouch: bool = True, checked: bool = False
    ) -> bool:
        """Event loop. From `source` (a stage peer's id), through its averager (its libp2p id, from its record).
        `keep_gradients`: see `load`. `vouch`: only if the stage's other peers let us (`vouch`); not when copying
        the state of a peer at our own epoch after stepping alone (delayed steps): its peers may each hold their own.
        `checked`: catching up, not diverged: if we hold an ancestor of the state (`holds_ancestor`) and no other
        peer at its epoch holds it too, it must be within reach of ours (`load_checked`); a state that is not refuses
        its sender (`StagePeers.refuse`), and we return False."""
        loop = asyncio.get_running_loop()
        p2p_id = self.peers.p2p_ids.get(source)
        if not p2p_id:
            logger.warning("stage %d: no record of %s's averager", self.stage, source[-6:])
            return False
        if self.peers.sdht.swarm_key is not None:  # a private swarm: its averager serves only peers that proved the key
            with contextlib.suppress(Exception):  # the download says why if it still fails
                await self.peers.sdht.introduce(p2p_id)
        fetch = functools.partial(self.averager.download_state, p2p_id, self.cfg.averaging_timeout)
        for attempt in range(attempts):
            try:
                loaded = await loop.run_in_executor(self.pool, fetch)
            except TimeoutError:  # the averager process hung
                loaded = None
            if loaded is not None:
                meta, tensors = loaded
                try:
                    digest, confirmed = (
                        await self.vouch(source, meta, tensors) if vouch and self.averager.exact_states else (None, 0)
                    )
                    # a state its sender alone holds among the peers at its epoch is held to ours, if ours is its
                    # ancestor
                    load = self.load_checked if checked and self.holds_ancestor() and not confirmed else self.load
                    await self.worker.submit(functools.partial(load, meta, tensors, keep_gradients, digest))
                    self.peers.established.add(source)  # its state checked out: its word counts (rules.py)
                    return True
                except Unvouched as e:  # the stage's other peers hold another state: ask another peer
                    self.unvouched += 1
                    logger.warning("%s", e)
                    return False
                except NotOneStep as e:
                    logger.warning(
                        "stage %d: refusing the state of %s: %s; it is no source of ours any more",
                        self.stage,
                        source[-6:],
                        e,
                    )
                    self.peers.refuse(source, self.worker.epoch)
                    return False
                except UNUSABLE_STATE as e:
                    logger.warning("downloaded state is unusable: %r", e)
            if attempt + 1 < attempts:
                await asyncio.sleep(1.0 + attempt)
        return False

    async def vouch(self, source: str, meta: dict, tensors: list[torch.Tensor]) -> tuple[str, int]:
        """Event loop. Raises Unvouched unless the stage's other live peers (`VOUCHERS` of them, those at the state's
        epoch first) let a state downloaded from `source` be loaded (`vouched`): each answers Info with the digest of
        its own state, which covers the parameters, the optimizer state, the schedule's position and, with low-rank
        averaging, the factors the state carries (a state sent through a lossy --state-codec is not vouched for: it
        makes every joiner's state its own). A peer of the stage could otherwise hand a joiner, or a
        peer catching up, any finite state with our optimizer settings: it is whoever sorts first, or reports the
        furthest epoch. A peer that copies the state of one that stepped alone (after a failed round, or another
        lineage) takes that peer's word: nobody else holds its state yet. Returns the state's digest, and how many
        of the peers asked hold it too."""
        self.averager.split_state(meta, tensors)  # raises ValueError if malformed
        epoch = int(meta.get("epoch", -1))
        digest = await asyncio.to_thread(state_digest, tensors, meta)
        epochs, me = self.peers.epochs_of(), self.peers.sdht.peer_id
        others = sorted(
            (p for p in self.peers.peers if p not in (source, me)), key=lambda p: (epochs.get(p) != epoch, p)
        )
        answers = await asyncio.gather(*(self.peers.state_of(p, self.cfg.averaging_timeout) for p in others[:VOUCHERS]))
        told = [answer for answer in answers if answer is not None]
        if not vouched(epoch, digest, told):
            raise Unvouched(
                f"stage {self.stage}: the state of epoch {epoch} from {source[-6:]} (digest {digest[:12]}) is not the "
                f"one the stage's other peers at that epoch hold: they told {sorted((e, d[:12]) for e, d in told)}"
            )
        confirmed = sum(answer == (epoch, digest) for answer in told)
        logger.info(
            "stage %d: the state of epoch %d from %s is held by %d other peer(s) too",
            self.stage,
            epoch,
            source[-6:],
            confirmed,
        )
        return digest, confirmed

    def load(
        self, meta: dict, tensors: list[torch.Tensor], keep_gradients: bool = False, digest: str | None = None
    ) -> None:
        """Compute thread: replaces parameters, optimizer state and epoch; drops the gradients of the old epochs.
        `keep_gradients`: keeps what we accumulated towards our current epoch if the state is of that epoch too
        (delayed steps: the next epoch accumulates while the last one is averaged and stepped). `digest`: the
        state's, if known (for the log)."""
        worker_tensors, factors = self.averager.split_state(meta, tensors)  # checked before anything changes
        if not keep_gradients or int(meta.get("epoch", -1)) != self.worker.epoch:
            self.worker.drop_gradients()
        lowrank = self.averager.lowrank
        # the factors with the parameters, in one change: the state we share (and its digest) pairs them
        self.worker.load_state(meta, worker_tensors, None if lowrank is None else lambda: lowrank.load_shared(factors))
        self.downloads += 1
        self._taken_lineage = self.worker.lineage
        digest = digest or state_digest(tensors, meta)
        logger.info("stage %d: loaded state at epoch %d (digest %s)", self.stage, self.worker.epoch, digest)

    def holds_ancestor(self) -> bool:
        """Any thread: whether the stage's state descends from ours, as far as we know: we started the stage (no peers
        when we joined) or took a state from it since, and have not stepped alone after: each lone step starts a
        lineage of our own (`StageWorker.branch`), with no peer listed, as the reference after a failed round (the
        stage's history goes on from our step only if its peers copy it: a thawed peer's peers were epochs on, and
        its honest catch-up was refused in a soak; the stage then copied the peer's state, 40 versions behind), or
        on our own gradients after a failed delayed round (`not_an_ancestor`)."""
        return self._taken_lineage is not None and self._taken_lineage == self.worker.lineage

    def not_an_ancestor(self) -> None:
        """Compute thread: we stepped alone on our own gradients; see `holds_ancestor`."""
        self._taken_lineage = None

    def load_checked(
        self, meta: dict, tensors: list[torch.Tensor], keep_gradients: bool = False, digest: str | None = None
    ) -> None:
        """Compute thread: `load`, once the state is within reach of ours (`_check_one_step`: one version on, ours
        after one honest step; further, within what that many steps can do); raises NotOneStep if not. For a peer
        catching up that holds an ancestor of the stage's state: a peer alone at the furthest epoch was otherwise
        taken on its word (nobody at its epoch to vouch for it or against it), whatever it sent. A state more than
        MAX_BOUNDED_STEPS versions on (a peer restarted from an old checkpoint) is beyond any check, and taken on the
        vouching alone, as is any state through a lossy --state-codec."""
        if isinstance(meta.get("outer"), dict):
            # local steps: the outer state moves by outer steps on averaged pseudo-gradients, which no replay of one
            # optimizer step bounds; taken on the vouching alone (docs/trust.md)
            self.load(meta, tensors, keep_gradients, digest)
            return
        try:
            version, epoch = int(meta["param_version"]), int(meta["epoch"])
        except Exception as e:  # inf overflows int(): any malformed number is the sender's fault
            raise NotOneStep(f"malformed state: {e!r}") from e
        if version > epoch:  # a step an epoch at most, from the stage's start
            raise NotOneStep(f"it claims version {version} at epoch {epoch}")
        steps = version - self.worker.param_version
        beyond = steps > MAX_BOUNDED_STEPS
        limit = self.peers.shown_limit(True)
        if beyond and limit is not None and epoch > limit:  # an epoch claimed to carry it past the check
            raise NotOneStep(f"it is at epoch {epoch}, beyond what stage 0's admissions show ({limit})")
        if self.averager.exact_states and not beyond:
            self._check_one_step(meta, tensors)
        elif beyond:
            logger.warning(
                "stage %d: the state is %d versions past ours, too far to check: taking it on its peers' word",
                self.stage,
                steps,
            )
        self.load(meta, tensors, keep_gradients, digest)

    def after_failed_round(self, grads: list[torch.Tensor], n_samples: int) -> list[torch.Tensor] | None:
        """Compute thread, after a failed round of the current epoch, before any request sees our parameters. Returns
        the gradients to step alone on, or None: we copied a peer's state (the epoch moved on) or the epoch stays open.

        One peer steps alone and the others copy it, so the stage stays one model. The reference is a peer that has
        finished the epoch (smallest peer id), else the live peer with the most samples behind its gradients (ties:
        the smallest peer id); every peer names the same one, because peers report their counts before they reply
        to a trainer, hence before the epoch can end. The copy takes the reference's word for a gradient only: its
        state must be ours after one step (`NotOneStep`); a reference that lies is refused, by every honest peer
        alike, and the reference chosen again without it. The reference steps alone on its own gradients; the others
        wait for it to step and copy its state. A reference that stops answering (dead, frozen: the stage drops it)
        is passed over and the reference chosen again among the live peers, so a frozen peer never holds the stage;
        once it comes back it is behind, and copies the stage's state before it serves again. If the reference does
        not step in time we do not step at all: the epoch stays open, our gradients stay accumulated, and the next
        round, or a peer that finishes the epoch, closes it."""
        epoch, me = self.worker.epoch, self.peers.sdht.peer_id
        deadline = time.monotonic() + 2 * self.cfg.averaging_timeout  # its round may have begun after ours
        try:
            with self._not_sharing():  # a peer that needs a state must not take our stale one
                while time.monotonic() < deadline:
                    reference, why = self._reference(epoch, me, n_samples)
                    if reference is None:  # nobody has samples this epoch: nothing to step on
                        break
                    if reference == me:
                        # a history of our own, unless the stage's peers copy our state (and lineage) after our step:
                        # peers that refused each other and stepped alone each rejoin through the lineage rule once
                        # the refusal lapses (with one lineage they stayed apart, silently)
                        self.worker.branch()
                        logger.warning(
                            "stage %d epoch %d: stepping alone with %d samples; the stage's peers will copy our state",
                            self.stage,
                            epoch,
                            n_samples,
                        )
                        return grads
                    logger.warning(
                        "stage %d epoch %d: copying the state of %s (%s) once it has stepped",
                        self.stage,
                        epoch,
                        reference[-6:],
                        why,
                    )
                    try:
                        if self._copy_once_stepped(reference, epoch, deadline, checked=True):
                            return None
                    except NotOneStep as e:
                        logger.warning(
                            "stage %d epoch %d: refusing the state of %s: %s; it is no reference of ours any more",
                            self.stage,
                            epoch,
                            reference[-6:],
                            e,
                        )
                        self.peers.refuse(reference, epoch)
        except UNUSABLE_STATE as e:
            logger.warning("copying the state of the stage's reference peer failed: %r", e)
        logger.warning(
            "stage %d epoch %d: no state to copy; the epoch stays open, keeping our %d samples",
            self.stage,
            epoch,
            n_samples,
        )
        self.worker.return_gradients(grads, n_samples)
        return None

    def adopt(self, reference: str, epoch: int, keep_gradients: bool = False) -> None:
        """Compute thread, right after our step of `epoch` (no request has seen our new parameters): load the state
        `reference` has after its step of `epoch`, whose lineage (server/worker.py) the stage keeps. If it does not
        send it in time, the next epoch tries again. `keep_gradients`: delayed steps, whose next epoch is already
        accumulating (`load`); a reference serves no state while its own delayed step is pending."""
        logger.warning(
            "stage %d epoch %d: %s holds parameters of another history (a peer stepped alone): copying its state",
            self.stage,
            epoch,
            reference[-6:],
        )
        try:
            with self._not_sharing():  # nobody must take the parameters we are about to drop
                deadline = time.monotonic() + 2 * self.cfg.averaging_timeout
                if self._copy_once_stepped(reference, epoch, deadline, keep_gradients):
                    return
        except UNUSABLE_STATE as e:
            logger.warning("copying the state of %s failed: %r", reference[-6:], e)
        logger.warning(
            "stage %d epoch %d: no state from %s; trying again next epoch", self.stage, epoch, reference[-6:]
        )

    @contextlib.contextmanager
    def _not_sharing(self):
        """Our averager serves no state meanwhile: the parameters we hold are about to be replaced."""
        self.averager.allow_state_sharing = False
        try:
            yield
        finally:
            self.averager.allow_state_sharing = True

    def _reference(self, epoch: int, me: str, n_samples: int) -> tuple[str | None, str]:
        """The peer that steps alone after a failed round of `epoch`, among the live ones, and why; None if nobody
        has samples."""
        refused = self.peers.distrusted(epoch)
        counts = {p: n for p, n in self.peers.counts_of(epoch).items() if p not in refused}
        counts[me] = n_samples
        ahead = [p for p in self.peers.ahead_of(epoch) if p in self.peers.peers and p not in refused]
        if ahead:
            return ahead[0], "finished the epoch"
        reference = min(counts, key=lambda p: (-counts[p], p))
        return (reference, f"{counts[reference]} samples") if counts[reference] > 0 else (None, "")

    def _copy_once_stepped(
        self, reference: str, epoch: int, deadline: float, keep_gradients: bool = False, checked: bool = False
    ) -> bool:
        """Compute thread: wait for `reference` to step past `epoch` and load its state (True); False once it is
        no longer a live peer of the stage, or at `deadline`. `checked`: we hold the state it stepped from (a failed
        round of `epoch`, not stepped): raises NotOneStep unless a state one version past ours is ours after one
        honest step. A state of another version (a step further already: half the copies in a soak; or none, its
        step skipped) cannot be replayed: it must be within reach of ours in that many steps, and is loaded then (an
        epoch left open instead kept the peer serving the next global batch at the old version, CI)."""
        probed = time.monotonic()
        while time.monotonic() < deadline and reference in self.peers.peers:
            if time.monotonic() - probed > PROBE_S:  # nobody else may be calling it meanwhile: is it frozen?
                self._probe(reference)
                probed = time.monotonic()
                continue
            if self.peers.epochs_of().get(reference, epoch) <= epoch:
                time.sleep(0.02)
                continue
            loaded = self.averager.download_state(
                self.peers.p2p_ids.get(reference, ""),
                timeout=self.cfg.averaging_timeout,
                alive=lambda: reference in self.peers.peers,
            )
            if loaded is not None and int(loaded[0].get("epoch", -1)) > epoch:
                if checked and self.averager.exact_states:  # through a lossy --state-codec no state is bitwise ours
                    self._check_one_step(*loaded)
                self.load(*loaded, keep_gradients=keep_gradients)
                return True
            time.sleep(0.2)  # it reported the next epoch but sent no state (yet): ask again
        if reference not in self.peers.peers:
            logger.warning("stage %d epoch %d: %s stopped answering; choosing again", self.stage, epoch, reference[-6:])
        return False

    def _check_one_step(self, meta: dict, tensors: list[torch.Tensor]) -> None:
        """Compute thread: raises NotOneStep if a downloaded state one version past ours is not ours after one honest
        step, if one at another version is behind ours or further from ours than that many steps can take it
        (server/state.py `StateChecks.not_within_steps_of_ours`: an honest reference a step further already, or whose
        step was skipped, passes; a liar claiming either is held to it), or if it is malformed (the sender's fault
        alike)."""
        try:
            steps = int(meta["param_version"]) - self.worker.param_version
            worker_tensors, _ = self.averager.split_state(meta, tensors)  # the low-rank factors are not checked
            if steps == 1:
                why = self.worker.checks.not_one_step_from_ours(meta, worker_tensors)
            elif steps < 0:
                why = f"it is at version {meta['param_version']}, behind ours ({self.worker.param_version})"
            elif steps > (epochs := int(meta["epoch"]) - self.worker.epoch):  # a step an epoch at most (we were at one)
                why = f"it claims {steps} steps in {epochs} epochs"
            else:  # a step further already, or its step skipped: bounded, not replayed
                why = self.worker.checks.not_within_steps_of_ours(meta, worker_tensors, steps)
            if why is None:  # the tied weight's copies drift apart between averages of their states: 2 steps an epoch
                every = self.cfg.tied_average_every
                why = self.worker.checks.tied_not_within(meta, worker_tensors, steps + 2 * every if every else None)
        except Exception as e:
            why = f"malformed state: {e!r}"
        if why is not None:
            raise NotOneStep(why)
        if steps != 1:
            logger.info("stage %d: the state is %d versions past ours, within reach of ours in that many steps",
                        self.stage, steps)  # fmt: skip

    def _probe(self, peer_id: str) -> None:
        """Compute thread: asks `peer_id` whether it answers (the stage drops it if not); waits at most the peer
        timeout and a second."""
        if self.loop is None:
            return
        probe = asyncio.run_coroutine_threadsafe(self.peers.probe(peer_id), self.loop)
        with contextlib.suppress(Exception):  # a slow event loop: the next probe asks again
            probe.result(timeout=self.peers.peer_timeout + 1.0)
