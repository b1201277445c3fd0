"""The control-plane simulator (tools/control_plane.py) drives the real epoch rules and hub choice: a stage ends every
epoch it can, no liar ends one before its samples were computed, a frozen hub is routed around within the peer
timeout, and a stage past HUB_FROM peers makes about as many calls per sample as a larger one."""

import dataclasses

import pytest

from server.collab import hubs
from tools.control_plane import ControlConfig, Simulation

pytestmark = pytest.mark.timeout(60)
CFG = ControlConfig(epochs=4, seed=1)


def run(n: int, **faults) -> tuple[Simulation, dict]:
    sim = Simulation(dataclasses.replace(CFG, **faults), n)
    return sim, sim.run()


def test_a_stage_ends_every_epoch_moments_after_its_last_sample():
    for n in (2, 4, hubs.HUB_FROM + 3):
        sim, report = run(n)
        assert report["epochs"] == CFG.epochs, report
        assert report["longest_stall_s"] < 1.0, report
        for epoch, ends in sim.ended_at.items():
            if epoch in sim.full_at:
                assert min(ends) >= sim.full_at[epoch], "an epoch ended before its samples were computed"


def test_calls_per_sample_do_not_grow_with_the_peers_once_hubs_carry_the_counts():
    small, large = run(hubs.HUB_FROM + 3)[1], run(4 * (hubs.HUB_FROM + 3))[1]
    assert large["calls_per_stage_sample"] < 1.5 * small["calls_per_stage_sample"], (small, large)
    assert large["messages_taken_per_stage_sample_per_peer"] < 1.5 * small["messages_taken_per_stage_sample_per_peer"]


def test_liars_end_no_epoch_early_and_stall_nothing():
    sim, report = run(12, lying=0.2)
    assert sim.lying_ids and report["epochs"] == CFG.epochs, report
    for epoch, ends in sim.ended_at.items():
        assert epoch in sim.full_at and min(ends) >= sim.full_at[epoch], f"epoch {epoch} ended on a liar's word"
    assert report["longest_stall_s"] < 2 * CFG.peer_timeout, report


def test_frozen_peers_and_hubs_are_routed_around_within_the_peer_timeout():
    sim, report = run(12, frozen=0.2)
    assert sim.frozen_ids and report["epochs"] == CFG.epochs, report
    assert report["longest_stall_s"] < 2 * CFG.peer_timeout + hubs.PERIOD_S[1], report


def test_liars_that_ask_to_end_every_epoch_with_every_message_do_not_multiply_the_stages_calls():
    honest, lying = run(32)[1], run(32, lying=0.1)[1]
    assert lying["calls_per_stage_sample"] < 1.3 * honest["calls_per_stage_sample"], (honest, lying)
    # each liar still gets one pass-on at once per epoch from each hub (hubs.py `FirstEnds`): 3 liars of 32, 1.6x
    assert lying["busiest_peer_calls_per_s"] < 2 * honest["busiest_peer_calls_per_s"], (honest, lying)
