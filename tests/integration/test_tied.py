"""Tied embeddings' fused sync (server/collab/tied.py) on real hivemind averagers: one all-reduce over the peers of
stage 0 and of the last stage gives every copy of the tied weight the same step as an all-reduce within each stage
followed by a sync between the two."""

import concurrent.futures
import contextlib
from types import SimpleNamespace

import pytest
import torch

from dht.node import SwarmDHT, start_dht
from server.collab.averaging import averager_options
from server.collab.compat.process import start_in_background
from server.collab.tied import TiedOutcome, build_tied
from server.config import AveragingConfig
from tests.unit.test_tied import state_of

pytestmark = pytest.mark.timeout(120)
SWARM, LAST, SHAPE = "tiedtest", 2, (16, 8)


@contextlib.contextmanager
def tied_peers(stages: list[int], shape: tuple[int, ...] = SHAPE, **averaging):
    """One TiedAveraging per entry of `stages` (each its own DHT node and identity), every peer listed on its stage
    (what `refresh` reads from the stage records, set here directly)."""
    cfg = AveragingConfig(**{"matchmaking_time": 0.5, "averaging_timeout": 5.0, "allreduce_codec": "none", **averaging})
    boot = start_dht(swarm_name=SWARM)
    initial = [str(m) for m in boot.get_visible_maddrs()]
    peers, dhts = [], []
    try:
        for stage in stages:
            sdht = SwarmDHT.start(SWARM, initial)
            dhts.append(sdht)
            worker = SimpleNamespace(tied=torch.zeros(shape), tied_index=0)
            tied = build_tied(worker, sdht, stage, LAST + 1, cfg, averager_options(sdht, cfg))
            assert tied is not None
            start_in_background(tied.averager)
            peers.append(tied)
        for tied in peers:
            tied.averager.wait_until_ready(60)
        listed = {s: frozenset(d.p2p_id for d, st in zip(dhts, stages, strict=True) if st == s) for s in (0, LAST)}
        for tied in peers:
            tied.listed = dict(listed)
        yield peers
    finally:
        for tied in peers:
            tied.averager.shutdown()
        for sdht in dhts:
            sdht.dht.shutdown()
        boot.shutdown()


def run_rounds(peers, grads, weights, samples, epoch) -> list[TiedOutcome]:
    with concurrent.futures.ThreadPoolExecutor(len(peers)) as pool:
        futures = [
            pool.submit(t.average_tied, g, w, n, epoch)
            for t, g, w, n in zip(peers, grads, weights, samples, strict=True)
        ]
        return [f.result() for f in futures]


def test_one_round_over_both_stages_steps_every_copy_as_per_stage_rounds_and_a_sync_would():
    """Two peers of stage 0 and two of the last stage, each with its mean gradient over its samples (8 samples per
    stage, as one global batch). The fused round's gradient is the sum of the two stages' averages, and one AdamW
    step with it leaves every copy equal to the weight of one process stepped with that sum (< 1e-6)."""
    gen = torch.Generator().manual_seed(0)
    stages, samples = [0, 0, LAST, LAST], [3, 5, 6, 2]
    grads = [torch.randn(SHAPE, generator=gen) for _ in stages]
    weight = torch.randn(SHAPE, generator=gen)
    with tied_peers(stages) as peers:
        outcomes = run_rounds(peers, grads, [state_of(weight)] * 4, samples, epoch=1)

    def stage_mean(stage: int) -> torch.Tensor:  # the per-stage all-reduce: a mean weighted by samples
        parts = [(g, n) for g, n, s in zip(grads, samples, stages, strict=True) if s == stage]
        return sum(g * n for g, n in parts) / sum(n for _, n in parts)

    explicit = stage_mean(0) + stage_mean(LAST)  # ... then the sync between the stages: their sum
    for outcome in outcomes:
        assert outcome.grad is not None and outcome.state is None  # epoch 1: not a --tied-average-every epoch
        assert (outcome.grad - explicit).abs().max() < 1e-6
    assert all(torch.equal(o.grad, outcomes[0].grad) for o in outcomes)  # the exact all-reduce: bitwise alike

    reference = torch.nn.Parameter(weight.clone())
    reference.grad = explicit
    torch.optim.AdamW([reference], lr=1e-2).step()
    for outcome in outcomes:
        copy = torch.nn.Parameter(weight.clone())
        copy.grad = outcome.grad
        torch.optim.AdamW([copy], lr=1e-2).step()
        assert (copy - reference).abs().max() < 1e-6
    assert all(t.rounds_ok == 1 and t.bytes > 0 for t in peers)


@pytest.mark.parametrize("codec", ["none", "blockwise8"])
def test_every_few_epochs_the_round_also_brings_the_copies_together(codec):
    """Copies that drifted apart (a round that ended for some peers and failed for others) are averaged with their
    optimizer state, weighted by samples, in the round of every --tied-average-every-th epoch, and the gradient still
    comes with them. Each with its own codec: the gradient with --allreduce-codec, the states with
    --param-average-codec (none: exact)."""
    gen = torch.Generator().manual_seed(1)
    stages, samples = [0, LAST], [4, 4]
    grads = [torch.randn(SHAPE, generator=gen) for _ in stages]
    copies = [torch.randn(SHAPE, generator=gen) for _ in stages]
    with tied_peers(stages, tied_average_every=5, allreduce_codec=codec) as peers:
        states = [state_of(copies[0], 0.1, 0.01, 7), state_of(copies[1], 0.3, 0.03, 6)]
        outcomes = run_rounds(peers, grads, states, samples, epoch=10)
    tolerance = 1e-6 if codec == "none" else 0.05  # 8-bit absmax blocks of values about 1: ~1/127 of the block max
    for outcome in outcomes:
        assert outcome.state is not None and outcome.grad is not None
        weight, m, v, step = outcome.state
        assert (weight - (copies[0] + copies[1]) / 2).abs().max() < 1e-6
        assert torch.allclose(m, torch.full_like(m, 0.2)) and torch.allclose(v, torch.full_like(v, 0.02))
        assert step.item() == 6.5  # the worker rounds it: every copy takes the same count
        error = (outcome.grad - (grads[0] + grads[1])).abs().max()
        assert error < tolerance and (error > 0 or codec == "none")  # 8-bit: the gradient did go 8-bit
        assert outcome.load == {0: outcome.state}
    assert torch.equal(outcomes[0].grad, outcomes[1].grad)
    assert all(torch.equal(a, b) for a, b in zip(outcomes[0].state, outcomes[1].state, strict=True))


def test_a_round_missing_a_listed_peer_fails_and_the_tied_weight_does_not_step():
    """A peer the DHT lists but that never comes to the round (dead, or at another epoch): the others give up within
    --averaging-timeout and leave the tied weight unstepped; nobody steps on a half-group's average."""
    with tied_peers([0, LAST, LAST], averaging_timeout=3.0) as peers:
        grads = [torch.ones(SHAPE)] * 2
        outcomes = run_rounds(peers[:2], grads, [state_of(torch.zeros(SHAPE))] * 2, [4, 4], epoch=3)
    assert all(o.grad is None and o.state is None and o.load == {} for o in outcomes)
    assert all(o.into([torch.ones(1), torch.ones(1)])[0] is None for o in outcomes)
    assert all(t.rounds_failed == 1 for t in peers[:2])


def test_with_no_peer_of_the_other_stage_listed_the_tied_weight_does_not_step_and_no_round_is_tried():
    with tied_peers([0]) as (peer,):
        outcome = peer.average_tied(torch.ones(SHAPE), state_of(torch.zeros(SHAPE)), 4, epoch=1)
    assert outcome.grad is None and peer.rounds_skipped == 1 and peer.rounds_failed == 0


def test_the_round_needs_our_state_on_averaging_epochs_only():
    with tied_peers([0]) as (peer,):  # no partner listed: the round would not run anyway
        assert peer.averages_states(10) and not peer.averages_states(11)
        with pytest.raises(ValueError, match="not given"):
            peer.listed[LAST] = frozenset(["12D3KooWA"])  # someone listed: the round would run
            peer.average_tied(torch.ones(SHAPE), None, 4, epoch=10)


def test_a_peer_no_stage_lists_never_joins_the_tied_round():
    """A forged member: a peer under the tied prefix that lists itself on stage 0 (the DHT does not: the honest peers'
    reads leave it out) and sends an extreme gradient. The honest peers average with each other alone; the stranger's
    round fails and its values reach nobody."""
    with tied_peers([0, LAST, 0]) as (a, b, stranger):
        ids = {t: t.sdht.p2p_id for t in (a, b, stranger)}
        for honest in (a, b):
            honest.listed = {0: frozenset([ids[a]]), LAST: frozenset([ids[b]])}
        stranger.listed = {0: frozenset([ids[a], ids[stranger]]), LAST: frozenset([ids[b]])}
        grads = [torch.ones(SHAPE), torch.full(SHAPE, 3.0), torch.full(SHAPE, 1e6)]
        outcomes = run_rounds([a, b, stranger], grads, [state_of(torch.zeros(SHAPE))] * 3, [4, 4, 4], epoch=1)
    assert all(o.grad is not None and torch.allclose(o.grad, torch.full(SHAPE, 4.0)) for o in outcomes[:2])
    assert outcomes[2].grad is None and stranger.rounds_failed == 1


def test_a_stage_peer_weighs_in_the_tied_round_what_its_admissions_prove():
    """The tied round caps weights as the stage's own rounds do: in the parts a peer reduces, a peer of its own stage
    weighs what its admissions proved (server/collab/served.py), a peer of the other stage (whose admissions it does
    not see) at most one peer's share of an epoch. Stage 0's b proved 1 sample to a and declares 8: in a's parts it
    weighs 1, in the others' 8 (a reducer's own part and the other stage's parts are beyond a's caps)."""
    shape = (1000, 400)  # hivemind hands each reducer whole parts of 512 KiB: enough of them for every peer
    with tied_peers([0, 0, LAST], shape) as (a, b, c):
        ids = {t: t.sdht.p2p_id for t in (a, b, c)}
        a.cap_own_stage(lambda _epoch: {ids[b]: 1.0}, most=8.0)
        c.cap_own_stage(lambda _epoch: {ids[b]: 1.0}, most=8.0)  # another stage's proofs: not c's to apply
        a.members(), c.members()  # what an attempt does first: the caps name the members it was told of
        assert a.weight_caps(3) == {ids[b]: 1.0, ids[c]: 8.0} and c.weight_caps(3) == {ids[a]: 8.0, ids[b]: 8.0}
        grads = [torch.zeros(shape), torch.full(shape, 30.0), torch.full(shape, 3.0)]
        outcomes = run_rounds([a, b, c], grads, [state_of(torch.zeros(shape))] * 3, [4, 8, 4], epoch=1)
    assert all(o.grad is not None and torch.equal(o.grad, outcomes[0].grad) for o in outcomes)
    got = outcomes[0].grad
    capped, declared = 2 * (1 * 30.0 + 4 * 3.0) / 9, 2 * (8 * 30.0 + 4 * 3.0) / 16
    in_capped = int(torch.isclose(got, torch.tensor(capped)).sum())
    in_declared = int(torch.isclose(got, torch.tensor(declared)).sum())
    assert in_capped + in_declared == got.numel() and 0 < in_capped < got.numel(), (got.unique(), capped, declared)
