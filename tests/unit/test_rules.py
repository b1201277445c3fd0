"""The epoch rules (server/collab/rules.py), case by case: pure functions of a frozen view, no swarm."""

import dataclasses

from server.collab import rules
from server.collab.rules import REFUSED_EPOCHS, Act, Decision, EpochView

QUOTA = 16


def view(**changes) -> EpochView:
    """A stage-1 peer at epoch 5 that joined at epoch 2, holding nothing yet, no lookahead."""
    base = EpochView(stage=1, epoch=5, quota=QUOTA, lookahead=0, joined_at=2)
    return dataclasses.replace(base, **changes)


def test_a_peer_trusts_its_stage_peers_word_on_stage_0_and_in_the_epoch_it_joined_in():
    assert rules.trusting(view(stage=0))
    assert rules.trusting(view(joined_at=None)), "not started yet"
    assert rules.trusting(view(joined_at=5)), "the epoch we joined in"
    assert not rules.trusting(view(joined_at=4))


def test_an_epoch_may_end_on_stage_0s_word_or_on_what_the_stage_proves_not_on_a_peers_word():
    assert not rules.may_end(view(held=8, proven=7))
    assert rules.may_end(view(held=8, proven=8)), "the global batch, ours and proven"
    assert rules.may_end(view(stage0_at=6)), "stage 0 admits epoch 6: it finished 5"
    assert not rules.may_end(view(stage0_at=5))
    assert rules.may_end(view(stage=0, established=frozenset({"a"})), "a"), "stage 0 trusts its established peers"
    assert not rules.may_end(view(stage=0, established=frozenset({"a"})), "stranger"), "not a stranger"
    assert not rules.may_end(view(established=frozenset({"a"})), "a"), "a later stage trusts proofs only"


def test_a_peer_is_believed_as_far_as_stage_0s_admissions_show():
    assert rules.shown_limit(view(stage=0), trusted=True) is None, "an established peer of stage 0: its word"
    assert rules.shown_limit(view(stage=0)) == 5, "a stranger: as far as stage 0's admissions show"
    assert rules.shown_limit(view()) == 5, "nothing proven: not past our own epoch"
    assert rules.shown_limit(view(held=QUOTA)) == 6, "our epoch proven: a peer may have finished it"
    assert rules.shown_limit(view(ending=5)) == 6, "while we end it, a peer that finished it stays in view"
    assert rules.shown_limit(view(stage0_at=9)) == 10, "stage 0 at 9: a later stage may have finished 9 itself"
    assert rules.shown_limit(view(stage0_at=9, lookahead=2 * QUOTA)) == 12, "and the epochs admitted early"
    assert rules.shown(view(peer_epochs={"a": 5, "liar": 900})) == {"a": 5}


def test_a_liars_far_epoch_makes_a_peer_copy_nothing():
    liar = view(peer_epochs={"liar": 900})
    assert rules.furthest(liar) is None
    assert rules.on_poll(liar) == Decision(Act.WAIT)
    assert not rules.behind_for_admission(liar)


def test_a_peer_whose_state_we_refused_is_nobody_ahead_of_us_until_the_refusal_lapses():
    """A refused peer alone at the furthest epoch counted as ahead: the peer kept trying to catch up from nobody and
    refused work as behind. The distrust lapses as the stage's epochs go on, though ours stays where it is."""
    v = view(stage=0, peer_epochs={"a": 9, "b": 5}, established=frozenset({"a", "b"}))
    assert rules.furthest(v) == 9
    refused = dataclasses.replace(v, refused_at={"a": 5})
    assert rules.furthest(refused) == 5 and rules.lately_refused(refused) == {"a"}
    lapsed = dataclasses.replace(refused, peer_epochs={"a": 9, "b": 5 + REFUSED_EPOCHS})
    assert rules.furthest(lapsed) == 5 + REFUSED_EPOCHS and not rules.lately_refused(lapsed)


def test_the_poller_catches_up_joins_a_round_ends_a_full_batch_or_waits():
    assert rules.on_poll(view(accumulating=False, held=QUOTA)) == Decision(Act.WAIT), "ending or recovering"
    a = frozenset({"a"})
    assert rules.on_poll(view(stage=0, peer_epochs={"a": 7}, established=a)) == Decision(Act.CATCH_UP), "copy it"
    assert rules.on_poll(view(stage=0, peer_epochs={"a": 7})) == Decision(Act.WAIT), "a stranger's word: nothing"
    assert rules.on_poll(view(diverged=True)) == Decision(Act.CATCH_UP)
    assert rules.on_poll(view(stage=0, peer_epochs={"a": 6}, established=a)) == Decision(Act.END, 5), "it finished"
    assert rules.on_poll(view(held=10, proven=6)) == Decision(Act.ANNOUNCE_AND_END, 5)
    assert rules.on_poll(view(stage=0), lost=True) == Decision(Act.ANNOUNCE_AND_END, 5)
    assert rules.on_poll(view(held=10, proven=5)) == Decision(Act.WAIT)


def test_a_peer_ends_its_epoch_when_asked_only_if_it_may():
    assert rules.on_end_message(view(stage0_at=6), 5, "a")
    assert not rules.on_end_message(view(stage0_at=6), 4, "a"), "another epoch"
    assert not rules.on_end_message(view(stage0_at=6, accumulating=False), 5, "a")
    assert not rules.on_end_message(view(), 5, "a"), "a peer's word alone"
    stage0 = view(stage=0, established=frozenset({"a"}))
    assert rules.on_end_message(stage0, 5, "a") and not rules.on_end_message(stage0, 5, "stranger")


def test_a_call_of_a_later_epoch_ends_ours_skips_or_finds_us_behind():
    """`stage0_at` is the frontier once the call's own admission is counted in (epoch.py checks it first)."""
    assert rules.on_call(view(stage0_at=5), 5, False) == Decision(Act.GO)
    assert rules.on_call(view(stage0_at=5), 3, False) == Decision(Act.GO), "a late microbatch joins our epoch"
    assert rules.on_call(view(stage0_at=6), 6, False) == Decision(Act.ANNOUNCE_AND_END, 5, skip_to=6)
    assert rules.on_call(view(stage0_at=6, accumulating=False), 6, False) == Decision(Act.GO), "already ending"
    # two epochs on: behind if a peer of ours is there to copy, else the whole stage is behind stage 0 and skips
    assert rules.on_call(view(stage0_at=8), 8, False) == Decision(Act.ANNOUNCE_AND_END, 5, skip_to=8)
    assert rules.on_call(view(stage0_at=8, peer_epochs={"a": 8}), 8, False) == Decision(Act.BEHIND)
    behind = view(stage=0, stage0_at=8, established=frozenset({"a"}))
    assert rules.on_call(behind, 8, True) == Decision(Act.BEHIND), "stage 0: the signer is a peer, ahead"
    assert rules.on_call(behind, 8, False) == Decision(Act.ANNOUNCE_AND_END, 5, skip_to=8), "our own"


def test_a_call_moves_a_stage_only_as_far_as_the_frontier_confirms():
    """A stranger that announced itself on stage 0 signs an admission 1000 epochs on: the stage acts on it as far as
    the signers holding most of its recent work show stage 0 to be, here epoch 5: it serves the call and stays."""
    assert rules.on_call(view(stage0_at=5), 1005, False) == Decision(Act.GO)
    assert rules.on_call(view(stage0_at=6), 1005, False) == Decision(Act.ANNOUNCE_AND_END, 5, skip_to=6)


def test_the_frontier_is_what_signers_holding_half_of_the_recent_work_show():
    assert rules.frontier({}, {}) == -1
    assert rules.frontier({"a": 3, "stranger": 1003}, {}) == 1003, "no work yet: a signature is all there is"
    work = {"a": 60, "b": 40, "stranger": 10}
    assert rules.frontier({"a": 3, "b": 3, "stranger": 1003}, work) == 3, "the stranger moves nothing"
    assert rules.frontier({"a": 4, "b": 3, "stranger": 1003}, work) == 4, "half or more moves it"
    assert rules.frontier({"a": 3, "b": 4, "stranger": 1003}, work) == 3, "b holds 40 of 110: it waits for a"
    assert rules.frontier({"a": 3, "b": 4, "stranger": 1003}, {"a": 50, "b": 50}) == 4, "and a tie moves it"
    assert rules.frontier({"a": 3, "new": 9}, {"a": 50}) == 3, "a signer with no work here moves nothing"
    assert rules.frontier({"a": 3, "stranger": 1003}, {"a": 10, "stranger": 90}) == 1003, "most of the work: it moves"


def test_stage_0_ends_an_epoch_whose_backwards_stopped_coming_after_the_admission_timeout():
    assert rules.lost_microbatches(0, QUOTA, QUOTA, 30.0, 30.0)
    assert not rules.lost_microbatches(0, QUOTA, QUOTA, 29.0, 30.0)
    assert not rules.lost_microbatches(0, QUOTA - 1, QUOTA, 60.0, 30.0), "not admitted in full yet"
    assert not rules.lost_microbatches(1, QUOTA, QUOTA, 60.0, 30.0), "stage 0's rule"
