"""ACP-SGD's math (server/collab/lowrank.py), without the network: which tensors go low-rank, exact reconstruction of
low-rank gradients, error feedback's bookkeeping, rounds that fail, and garbage factors from a peer."""

import pytest
import torch

from server.collab.lowrank import PHASE_P, PHASE_PSGD_P, PHASE_PSGD_Q, PHASE_Q, AcpState, Layout, PowerSgdState
from server.config import AveragingConfig


def low_rank(n: int, m: int, r: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=gen) @ torch.randn(r, m, generator=gen)


def one_peer_round(acp: AcpState, grads: list[torch.Tensor], epoch: int) -> list[torch.Tensor]:
    """A round of one peer: the all-reduce hands back its own factors."""
    rnd = acp.compress(grads, epoch)
    out = acp.decompress(rnd, rnd.factors, [g.shape for g in grads])
    acp.commit(rnd, rnd.factors, had_samples=True)
    return out


def test_layout_sends_matrices_as_factors_only_where_they_are_smaller():
    shapes = [torch.Size(s) for s in [(64, 32), (64,), (4, 4), (8, 2, 16), (3, 1000)]]
    layout = Layout.of(shapes, rank=4)
    assert layout.matrices == (0, 3)  # (4, 4): factors of 32 values for 16; (3, 1000): rank 3, factors 3009 > 3000
    assert layout.dims == ((64, 32, 4), (8, 32, 4))
    assert layout.whole == (1, 2, 4)
    assert layout.sent_numel(PHASE_P, shapes) == 64 * 4 + 8 * 4 + 64 + 16 + 3000
    assert layout.sent_numel(PHASE_Q, shapes) == 32 * 4 + 32 * 4 + 64 + 16 + 3000
    with pytest.raises(ValueError, match="rank"):
        Layout.of(shapes, rank=0)


def test_acp_reconstructs_a_low_rank_gradient_once_the_query_spans_it():
    """Round 1 (P) projects M onto a random query's span; round 2 (Q) multiplies by orth(P), which spans M's columns:
    the approximation is M itself. With error feedback the two rounds together send exactly 2M."""
    m = low_rank(48, 40, 3, seed=0)
    plain = AcpState(Layout.of([m.shape], rank=4), seed=1, error_feedback=False)
    first, second = one_peer_round(plain, [m], 0)[0], one_peer_round(plain, [m], 1)[0]
    assert (first - m).norm() / m.norm() > 0.1, "a random query already spanned M: the test shows nothing"
    assert torch.allclose(second, m, atol=1e-4), (second - m).abs().max()

    ef = AcpState(Layout.of([m.shape], rank=4), seed=1)
    total = one_peer_round(ef, [m], 0)[0] + one_peer_round(ef, [m], 1)[0]
    assert torch.allclose(total, 2 * m, atol=1e-4)
    assert ef.errors[0].abs().max() < 1e-4


def test_error_feedback_keeps_the_sum_of_sent_gradients_on_the_sum_of_true_ones():
    """Full-rank, slowly changing gradients at rank 2: what was sent plus the residual is always what was computed,
    and the residual levels off instead of growing with the steps, so the sums' relative gap shrinks like 1/steps
    (measured: 0.22 after 60 steps, 0.07 after 200). Without error feedback it stays at 0.86."""
    gen = torch.Generator().manual_seed(2)
    base, shapes = torch.randn(32, 24, generator=gen), [torch.Size((32, 24))]
    gaps = {}
    for ef in (True, False):
        acp = AcpState(Layout.of(shapes, rank=2), seed=3, error_feedback=ef)
        true_sum, sent_sum, residuals = torch.zeros(32, 24), torch.zeros(32, 24), []
        for t in range(200):
            g = base + 0.3 * torch.randn(32, 24, generator=torch.Generator().manual_seed(100 + t))
            true_sum += g
            sent_sum += one_peer_round(acp, [g], t)[0]
            residuals.append(acp.errors[0].norm().item())
        gaps[ef] = (true_sum - sent_sum).norm().item() / true_sum.norm().item()
        if ef:
            assert torch.allclose(sent_sum + acp.errors[0], true_sum, rtol=1e-4, atol=1e-2)
            assert max(residuals[100:]) < 1.1 * max(residuals[:100]), "the residual keeps growing"
    assert gaps[True] < 0.1 and gaps[False] > 0.5, gaps


def test_a_failed_round_commits_nothing_and_a_round_without_samples_keeps_the_residual():
    m = torch.randn(20, 16, generator=torch.Generator().manual_seed(4))
    acp = AcpState(Layout.of([m.shape], rank=2), seed=5)
    one_peer_round(acp, [m], 0)
    before = [t.clone() for t in (*acp.p, *acp.q, *acp.errors)]
    acp.compress([3 * m], 1)  # the round failed: never committed
    assert all(torch.equal(a, b) for a, b in zip(before, (*acp.p, *acp.q, *acp.errors), strict=True))

    rnd = acp.compress([torch.zeros_like(m)], 1)
    acp.commit(rnd, rnd.factors, had_samples=False)  # our weight was 0: our factors did not count
    assert torch.equal(acp.errors[0], before[-1])
    assert not torch.equal(acp.q[0], before[1]), "the round's factors are the stage's, samples or not"


def test_peers_averaging_factors_average_their_approximations():
    """The all-reduce stays additive: every peer multiplies by the same query, so the mean of the factors decodes to
    the (weighted) mean of the peers' approximations."""
    grads = [torch.randn(30, 20, generator=torch.Generator().manual_seed(s)) for s in (6, 7)]
    peers = [AcpState(Layout.of([g.shape], rank=3), seed=8) for g in grads]
    for epoch in (0, 1):
        rounds = [acp.compress([g], epoch) for acp, g in zip(peers, grads, strict=True)]
        mean = [(1 * rounds[0].factors[0] + 3 * rounds[1].factors[0]) / 4]
        decoded = [acp.decompress(rnd, mean, [g.shape]) for acp, rnd, g in zip(peers, rounds, grads, strict=True)]
        own = [acp.decompress(rnd, rnd.factors, [g.shape])[0] for acp, rnd, g in zip(peers, rounds, grads, strict=True)]
        assert torch.equal(decoded[0][0], decoded[1][0])
        assert torch.allclose(decoded[0][0], (1 * own[0] + 3 * own[1]) / 4, atol=1e-5)
        for acp, rnd in zip(peers, rounds, strict=True):
            acp.commit(rnd, mean, had_samples=True)
    assert all(torch.equal(a, b) for a, b in zip(peers[0].shared_tensors(), peers[1].shared_tensors(), strict=True))


def test_downloaded_factors_are_checked_before_anything_changes():
    shapes = [torch.Size((16, 12)), torch.Size((12,))]
    acp = AcpState(Layout.of(shapes, rank=2), seed=9)
    good = acp.shared_tensors()
    before = [t.clone() for t in good]
    garbage = {
        "too few": good[:1],
        "too many": [*good, good[0]],
        "wrong shape": [torch.zeros(16, 3), good[1]],
        "nan": [torch.full_like(good[0], float("nan")), good[1]],
        "inf": [good[0], torch.full_like(good[1], float("inf"))],
        "integers": [torch.zeros(16, 2, dtype=torch.int64), good[1]],
    }
    for name, tensors in garbage.items():
        with pytest.raises(ValueError):
            acp.load_shared(tensors)
        assert all(torch.equal(a, b) for a, b in zip(acp.shared_tensors(), before, strict=True)), name
    acp.errors[0] += 1.0
    acp.load_shared([2 * t for t in good])
    assert torch.equal(acp.p[0], 2 * good[0]) and acp.errors[0].abs().max() == 0, "a joiner's residual starts at 0"


def test_selective_compression_names_the_earliest_stages():
    acp = dict(allreduce_codec="acp")
    assert AveragingConfig(**acp).compressed_stages(3) == {0, 1, 2}
    assert AveragingConfig(**acp, allreduce_compress_stages="0,1").compressed_stages(4) == {0, 1}
    assert AveragingConfig(**acp, allreduce_compress_stages="0.5").compressed_stages(3) == {0, 1}
    assert AveragingConfig(**acp, allreduce_compress_stages="0.0").compressed_stages(3) == set()
    left_out = AveragingConfig(**acp, allreduce_compress_stages="0")
    assert left_out.for_stage(1, 3).allreduce_codec == "blockwise8" and left_out.for_stage(0, 3) is left_out
    assert AveragingConfig(allreduce_compress_stages="0").for_stage(1, 3).allreduce_codec == "blockwise8"
    for bad in ("", "first", "1.5", "-1", "0,x", "-0.5"):
        with pytest.raises(ValueError, match="--allreduce-compress-stages"):
            AveragingConfig(**acp, allreduce_compress_stages=bad)


def test_a_checkpoint_keeps_the_factors_and_the_residual(tmp_path):
    from server.checkpoint import load_checkpoint, save_checkpoint
    from server.config import ComputeConfig, OptimizerConfig
    from server.worker import StageWorker
    from swarm.model import Stage
    from tests.peers import MODEL

    def worker() -> StageWorker:
        return StageWorker(Stage(MODEL, 0), OptimizerConfig(), ComputeConfig(), torch.device("cpu"))

    w = worker()
    acp = AcpState(Layout.of([p.shape for p in w.params], rank=2), seed=1)
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(w.params)]
    one_peer_round(acp, grads, 0)
    save_checkpoint(w, tmp_path, acp)

    fresh = AcpState(acp.layout, seed=1)
    assert load_checkpoint(worker(), tmp_path, fresh) == 0
    saved, restored = acp.checkpoint(), fresh.checkpoint()
    for key in ("shared", "errors"):
        assert all(torch.equal(a, b) for a, b in zip(saved[key], restored[key], strict=True)), key

    other = AcpState(Layout.of([p.shape for p in w.params], rank=3), seed=1)  # another rank: starts over
    before = other.checkpoint()
    assert load_checkpoint(worker(), tmp_path, other) == 0
    assert all(torch.equal(a, b) for a, b in zip(before["shared"], other.checkpoint()["shared"], strict=True))
    for garbage in (None, [], {"errors": "x"}, {"errors": [torch.full((2, 2), float("nan"))]}):
        with pytest.raises(ValueError):
            fresh.restore(garbage)


def test_the_residual_keeps_its_mass_when_the_peers_share_of_the_batch_changes():
    """A peer's weight (its samples in the epoch) changes between epochs: the residual is a sum over samples, so the
    samples-weighted sum of what it sent plus the residual is the samples-weighted sum of its gradients."""
    gen = torch.Generator().manual_seed(10)
    acp = AcpState(Layout.of([torch.Size((24, 20))], rank=2), seed=11)
    true_sum, sent_sum = torch.zeros(24, 20), torch.zeros(24, 20)
    for epoch, weight in enumerate([8, 24, 16, 4, 28, 12]):
        g = torch.randn(24, 20, generator=gen)
        rnd = acp.compress([g], epoch, float(weight))
        sent_sum += weight * acp.decompress(rnd, rnd.factors, [g.shape])[0]
        acp.commit(rnd, rnd.factors, had_samples=True)
        true_sum += weight * g
    assert torch.allclose(sent_sum + acp.errors[0], true_sum, rtol=1e-4, atol=1e-3)


def power_sgd_epoch(
    state: PowerSgdState | list[PowerSgdState],
    grads_of_peers: list[list[torch.Tensor]],
    weights: list[float],
    epoch: int,
):
    """One PowerSGD epoch of several peers in one process: each round's average is the weighted mean of the peers'
    factors, as the stage's all-reduce computes it. Returns what the epoch hands every peer (the states are the
    peers'; each peer's second factors come from the same averaged P)."""
    states = state if isinstance(state, list) else [state]
    total = sum(weights)
    firsts = [s.first(g, epoch, w) for s, g, w in zip(states, grads_of_peers, weights, strict=True)]
    mean_p = [
        sum(w * r.factors[k] for r, w in zip(firsts, weights, strict=True)) / total
        for k in range(len(firsts[0].factors))
    ]
    seconds = [s.second(r, mean_p) for s, r in zip(states, firsts, strict=True)]
    mean_q = [
        sum(w * r.factors[k] for r, w in zip(seconds, weights, strict=True)) / total
        for k in range(len(seconds[0].factors))
    ]
    shapes = [g.shape for g in grads_of_peers[0]]
    return [s.finish(r, mean_q, shapes, had_samples=True) for s, r in zip(states, seconds, strict=True)]


def test_power_sgd_reconstructs_a_low_rank_gradient_in_one_epoch_and_sends_both_factors():
    """PowerSGD's P round spans M's columns at once (a random query of rank >= M's), and its Q round then recovers
    M exactly: one epoch, unlike ACP's two. Its rounds send P with the whole tensors, then Q alone."""
    m = low_rank(48, 40, 3, seed=0)
    state = PowerSgdState(Layout.of([m.shape], rank=4), seed=1)
    out = power_sgd_epoch(state, [[m]], [1.0], 0)[0][0]
    assert torch.allclose(out, m, atol=1e-4), (out - m).abs().max()
    assert state.errors[0].abs().max() < 1e-4
    shapes = [torch.Size((64, 32)), torch.Size((64,))]
    layout = Layout.of(shapes, rank=4)
    assert layout.sent_numel(PHASE_PSGD_P, shapes) == 64 * 4 + 64
    assert layout.sent_numel(PHASE_PSGD_Q, shapes) == 32 * 4


def test_power_sgd_of_several_peers_averages_their_gradients_and_keeps_them_in_step():
    """Two peers (weights 1 and 3): the epoch hands both the same values, the projection of the weighted mean
    gradient onto the averaged P's span, and with a mean of rank <= r that is the mean itself. Each peer's residual
    is what its own share missed; what was sent plus the residuals is what was computed."""
    shapes = [torch.Size((30, 20))]
    u = torch.randn(30, 2, generator=torch.Generator().manual_seed(7))  # both peers' gradients share a 2-d column span
    grads = [[u @ torch.randn(2, 20, generator=torch.Generator().manual_seed(s))] for s in (8, 9)]
    weights = [1.0, 3.0]
    states = [PowerSgdState(Layout.of(shapes, rank=2), seed=1) for _ in weights]
    outs = power_sgd_epoch(states, grads, weights, 0)
    mean = (grads[0][0] + 3 * grads[1][0]) / 4
    assert torch.equal(outs[0][0], outs[1][0]), "the peers hold different averages"
    assert torch.allclose(outs[0][0], mean, atol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(states[0].shared_tensors(), states[1].shared_tensors(), strict=True))
    # a full-rank pair of gradients: each residual is its own miss, weighted by its samples
    grads = [[torch.randn(30, 20, generator=torch.Generator().manual_seed(s))] for s in (10, 11)]
    before = [s.errors[0].clone() for s in states]
    sent = power_sgd_epoch(states, grads, weights, 1)[0][0]
    computed = sum(w * (g[0] + e / w) for w, g, e in zip(weights, grads, before, strict=True))
    residuals = sum(s.errors[0] for s in states)
    assert torch.allclose(4 * sent + residuals, computed, atol=1e-4)


def test_power_sgd_error_feedback_tracks_the_sum_of_true_gradients():
    """As ACP's test: rank 2 of full-rank, slowly changing gradients; the residual levels off with error feedback,
    and the sums' gap shrinks; without it, it does not."""
    gen = torch.Generator().manual_seed(2)
    base, shapes = torch.randn(32, 24, generator=gen), [torch.Size((32, 24))]
    gaps = {}
    for ef in (True, False):
        state = PowerSgdState(Layout.of(shapes, rank=2), seed=3, error_feedback=ef)
        true_sum, sent_sum = torch.zeros(32, 24), torch.zeros(32, 24)
        for t in range(200):
            g = base + 0.3 * torch.randn(32, 24, generator=torch.Generator().manual_seed(100 + t))
            true_sum += g
            sent_sum += power_sgd_epoch(state, [[g]], [1.0], t)[0][0]
        gaps[ef] = (true_sum - sent_sum).norm().item() / true_sum.norm().item()
        if ef:
            assert torch.allclose(sent_sum + state.errors[0], true_sum, rtol=1e-4, atol=1e-2)
    assert gaps[True] < 0.1 and gaps[False] > 0.5, gaps


def test_a_power_sgd_epoch_that_fails_in_either_round_commits_nothing():
    m = torch.randn(20, 16, generator=torch.Generator().manual_seed(4))
    state = PowerSgdState(Layout.of([m.shape], rank=2), seed=5)
    power_sgd_epoch(state, [[m]], [1.0], 0)
    before = [t.clone() for t in (*state.p, *state.q, *state.errors)]
    rnd = state.first([3 * m], 1)  # the P round failed: never continued
    state.second(rnd, rnd.factors)  # the Q round failed: never finished
    assert all(torch.equal(a, b) for a, b in zip(before, (*state.p, *state.q, *state.errors), strict=True))


def test_peers_of_another_averaging_policy_differ_in_their_records_settings():
    """What peers of a stage must share travels in their records: another low-rank scheme, rank, parameter-averaging
    codec or state codec is named in the warning that makes a peer ignore the other (dht/node.py)."""
    from dht.records import differences, settings

    ours = settings(averaging=AveragingConfig().shared)
    for change, named in (
        ({"allreduce_codec": "powersgd"}, "averaging.allreduce_codec: 'powersgd' (ours 'blockwise8')"),
        ({"allreduce_rank": 8}, "averaging.allreduce_rank: 8 (ours 4)"),
        ({"param_average_codec": "fp16"}, "averaging.param_average_codec: 'fp16' (ours 'none')"),
        ({"state_codec": "blockwise8"}, "averaging.state_codec: 'blockwise8' (ours 'none')"),
    ):
        assert differences(ours, settings(averaging=AveragingConfig(**change).shared)) == [named]
    policy = AveragingConfig(allreduce_codec="powersgd", param_average_codec="fp16").policy()
    assert (policy.allreduce_gradients, policy.parameters, policy.state) == ("fp16", "fp16", "none")
    with pytest.raises(ValueError, match="--state-codec"):
        AveragingConfig(state_codec="acp")
