"""Local-step training (--local-batch) on a real local swarm: each peer steps alone between outer rounds, the peers
of a stage average pseudo-gradients with hivemind's all-reduce once per global batch, and end every outer round on
one outer state."""

import grpc
import pytest
from safetensors.torch import load_file

from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import StageStub, sync_channel
from tests.conftest import free_port, wait_for
from tests.integration.test_collab import BATCH, IN_FLIGHT, TRAINERS, digests, model_args, read_records
from tools.processes import LocalSwarm

pytestmark = [pytest.mark.integration]

LOCAL_BATCH, OUTER_INTERVAL, EPOCHS = 8, 64, 8  # 64 / (2 peers x 8) = 4 inner steps per peer per outer round


def info(address: str) -> pb.InfoReply:
    with sync_channel(address) as channel:
        return StageStub(channel).info(pb.InfoRequest(), timeout=10)


@pytest.mark.timeout(600)
def test_local_steps_train_and_the_peers_of_each_stage_end_every_outer_round_on_one_outer_state(tmp_path):
    """3 stages x 2 peers, two trainers, 8 outer rounds of 64 samples with inner steps every 8 of a peer's samples,
    and a third stage-1 peer that joins after two rounds: no microbatch lost, the loss falls, each peer took several
    inner steps per outer round, the peers of each stage (the joiner too: it downloaded the outer state)
    reach the same epoch with the same outer state (Info's digest covers it), each checkpoint's weights are those of
    its stage peer, and the stage averaged at most once per outer round."""
    per_trainer = EPOCHS * OUTER_INTERVAL // BATCH // TRAINERS
    server_flags = [
        *("--samples-per-step", str(OUTER_INTERVAL), "--local-batch", str(LOCAL_BATCH), "--lr", "2e-3"),
        *("--matchmaking-time", "0.5", "--progress-period", "0.1", "--no-rebalance", "--lookahead-samples", "0"),
        *("--allreduce-codec", "none"),
    ]
    addresses = {(s, r): f"127.0.0.1:{free_port()}" for s in range(3) for r in range(2)}
    joiner = (1, 2)  # joins stage 1 in the middle of the run: it takes the outer state and goes on with the stage
    addresses[joiner] = f"127.0.0.1:{free_port()}"
    folder = tmp_path / "local"

    def start(swarm: LocalSwarm, stage: int, r: int) -> None:
        flags = [*server_flags, "--port", addresses[stage, r].rpartition(":")[2]]
        swarm.start_server(f"server-s{stage}-r{r}", stage, [*flags, "--checkpoint-dir", str(folder / f"c{stage}{r}")])

    with LocalSwarm(folder, "local", model_args()) as swarm:
        swarm.start_dht()
        for stage, r in addresses:
            if (stage, r) != joiner:
                start(swarm, stage, r)
        for t in range(TRAINERS):
            log = folder / f"trainer-{t}-losses.jsonl"
            flags = ["--batch-size", str(BATCH), "--in-flight", str(IN_FLIGHT), "--data-seed", str(t)]
            swarm.start_trainer(f"trainer-{t}", [*flags, "--max-steps", str(per_trainer), "--loss-log", str(log)])
        trainers = [swarm.children[f"trainer-{t}"] for t in range(TRAINERS)]

        def epoch_of(address: str) -> int:
            try:
                return info(address).epoch
            except grpc.RpcError:  # not serving yet
                return -1

        wait_for(lambda: epoch_of(addresses[1, 0]) >= 2, 300, "two outer rounds")
        start(swarm, *joiner)
        wait_for(lambda: not any(t.alive() for t in trainers), 400, f"{EPOCHS} outer rounds of the local swarm")
        joined = swarm.children[f"server-s{joiner[0]}-r{joiner[1]}"]
        wait_for(lambda: "serving at" in joined.log_path.read_text(), 180, "the joiner to serve")
        stats = swarm.trainer_stats()
        assert all(s["lost_microbatches"] == 0 for s in stats), stats

        def one_outer_state_per_stage() -> dict | None:
            found = digests(addresses)
            same = all(found[s, 0] == found[s, 1] for s in range(3)) and found[joiner] == found[1, 0]
            return found if same else None

        found = wait_for(one_outer_state_per_stage, 60, "the peers of each stage to hold one outer state")
        infos = {key: info(address) for key, address in addresses.items()}
        swarm.stop_all()
    records = sorted(read_records(folder), key=lambda r: r["global_batch"])
    losses = [r["loss"] for r in records]
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    per_sample = {key: i.allreduce_bytes / max(1, i.samples_processed) for key, i in infos.items()}
    print(f"local steps: loss {first:.3f} -> {last:.3f}; outer states {found}; all-reduce bytes/sample {per_sample}")
    assert len(records) >= TRAINERS * per_trainer
    assert last < first - 0.2, (first, last)
    assert all(epoch >= EPOCHS - 1 for epoch, _ in found.values()), found
    assert infos[joiner].state_downloads >= 1, infos[joiner]
    for key, i in infos.items():
        if key == joiner:
            continue
        # inner steps: ~4 a peer per outer round (the last stage's peers too), plus one outer step per round
        assert i.param_version >= 2 * i.epoch, (key, i.param_version, i.epoch)
        assert i.rounds_ok <= i.epoch + 1 and i.rounds_failed <= 2, (key, i.rounds_ok, i.rounds_failed)
    for s in range(3):  # stopped at one outer state: their checkpoints hold one model
        a, b = (load_file(str(folder / f"c{s}{r}" / f"stage{s}.safetensors")) for r in range(2))
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), f"stage {s}'s checkpoints differ"
