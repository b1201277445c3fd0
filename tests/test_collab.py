"""Collaborative stage training on real local swarms: peers of a stage average gradients with hivemind's all-reduce
and step together, so the swarm follows single-process training of the same model, step for step."""

import asyncio
import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from server.export import export_model
from swarm.compression import CompressionPolicy
from swarm.config import model_config
from swarm.model import GPT
from swarm.protocol.tensors import WireStats
from swarm.tools.local import LocalSwarm
from tests.conftest import wait_for
from trainer.client import StageClient
from trainer.data import load_corpus, microbatches

pytestmark = [pytest.mark.integration]

MODEL_FLAGS = {"d_model": 64, "n_heads": 4, "d_ff": 128, "max_seq_len": 64, "n_stages": 3, "layers_per_stage": 2}
LR, WEIGHT_DECAY, BATCH, GLOBAL_BATCH, EPOCHS = 1e-3, 0.01, 4, 8, 50


def model_args() -> list[str]:
    args = ["--preset", "local_debug"]
    for k, v in MODEL_FLAGS.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def read_losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()] if path.exists() else []


def run_swarm(
    tmp: Path, codec: str, name: str, epochs: int = EPOCHS
) -> tuple[list[float], dict[tuple[int, int], dict]]:
    """3 stages x 2 peers, one sequential trainer, EPOCHS global batches. Returns the per-microbatch losses and each
    server's final weights (saved by SIGTERM to its own checkpoint folder)."""
    server_flags = [
        "--samples-per-step",
        str(GLOBAL_BATCH),
        "--lr",
        str(LR),
        "--weight-decay",
        str(WEIGHT_DECAY),
        "--clip-grad-norm",
        "0",
        "--allreduce-codec",
        codec,
        "--matchmaking-time",
        "0.5",
        "--progress-period",
        "0.1",
        "--no-rebalance",
    ]
    loss_log = tmp / f"{name}-losses.jsonl"
    with LocalSwarm(tmp / name, name, model_args()) as swarm:
        swarm.start_dht()
        for stage in range(3):
            for r in range(2):
                ckpt = tmp / name / f"ckpt-s{stage}-r{r}"
                swarm.start_server(f"server-s{stage}-r{r}", stage, [*server_flags, "--checkpoint-dir", str(ckpt)])
        swarm.start_trainer(
            "trainer-0",
            [
                "--batch-size",
                str(BATCH),
                "--in-flight",
                "1",
                "--codec",
                codec,
                "--max-steps",
                str(epochs * GLOBAL_BATCH // BATCH),
                "--loss-log",
                str(loss_log),
            ],
        )
        trainer = swarm.children["trainer-0"]
        wait_for(lambda: not trainer.alive(), 400, f"{epochs} epochs of the {name} swarm")
        swarm.stop_all()
    weights = {
        (s, r): load_file(str(tmp / name / f"ckpt-s{s}-r{r}" / f"stage{s}.safetensors"))
        for s in range(3)
        for r in range(2)
    }
    return read_losses(loss_log), weights


def single_process_reference() -> tuple[list[float], GPT]:
    cfg = model_config("local_debug", **MODEL_FLAGS)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    data = microbatches(load_corpus(None), BATCH, cfg.max_seq_len, seed=0)  # the trainer's data order (--data-seed 0)
    losses = []
    for _ in range(EPOCHS):
        for _ in range(GLOBAL_BATCH // BATCH):
            tokens, labels = next(data)
            loss = model(tokens, labels)
            (loss * BATCH / GLOBAL_BATCH).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, model


@pytest.mark.timeout(900)
def test_swarm_matches_single_process_training_and_8bit_stays_close(tmp_path):
    ref_losses, ref_model = single_process_reference()
    losses, weights = run_swarm(tmp_path, "none", "exact")
    assert len(losses) == len(ref_losses) == EPOCHS * GLOBAL_BATCH // BATCH
    rel = [abs(a - b) / b for a, b in zip(losses, ref_losses, strict=True)]
    early = 20 * GLOBAL_BATCH // BATCH
    print(
        f"\ncodec none: relative loss difference to single-process training: max {max(rel[:early]):.2e} over the "
        f"first 20 steps, max {max(rel):.2e} / mean {sum(rel) / len(rel):.2e} over {EPOCHS}; "
        f"loss {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}"
    )
    # Not bitwise: hivemind's all-reduce returns local + (average - local), and sums in another order than autograd,
    # so every step differs by rounding. Rounding noise grows chaotically with training: the single-process run
    # itself, with 1e-7 relative noise on its gradients, drifts 1e-7 in 20 steps but 5e-4 by step 46 (measured).
    # hivemind sometimes fails a round (a follower gives up on its leader under load); then the stage's peer with the
    # most samples steps alone and the others copy it (server/collab/, tests/test_collab_failures.py), which costs
    # the other peers' samples of that step, nothing when they had none: a failed round at step 2 left the first 20
    # steps within 1.1e-7. Before that rule, stepping on empty gradients cost 1.2e-2 (a CI failure).
    # tests/test_averaging.py catches a no-op averager.
    assert max(rel[:early]) < 1e-2
    assert sum(rel) / len(rel) < 1e-2

    for s in range(3):  # epoch 50 is a parameter-averaging epoch (--param-average-every 5)
        a, b = weights[(s, 0)], weights[(s, 1)]
        peer_gap = max((a[k] - b[k]).abs().max().item() for k in a)
        print(f"stage {s}: max |peer 0 - peer 1| = {peer_gap:.2e}")
        assert peer_gap < 1e-6, "peers of a stage must hold the same parameters"

    epochs_8bit = 25  # a fixed number of steps, shorter than the exact run to keep CI short
    losses_8bit, _ = run_swarm(tmp_path, "blockwise8", "8bit", epochs=epochs_8bit)
    end, tail = epochs_8bit * GLOBAL_BATCH // BATCH, 5 * GLOBAL_BATCH // BATCH  # the last 5 steps' microbatches
    final_none, final_8bit = sum(losses[end - tail : end]) / tail, sum(losses_8bit[-tail:]) / tail
    print(
        f"loss after {epochs_8bit} steps: none {final_none:.4f}, blockwise8 {final_8bit:.4f} "
        f"({abs(final_8bit - final_none) / final_none:.2%} apart)"
    )
    assert abs(final_8bit - final_none) / final_none < 0.02


def log_text(swarm: LocalSwarm, name: str) -> str:
    return swarm.children[name].log_path.read_text(errors="replace")


def steps(swarm: LocalSwarm) -> int:
    stats = swarm.trainer_stats()
    return stats[0]["steps"] if stats else 0


def serving_address(log: str) -> str:
    return re.findall(r"serving at (127\.0\.0\.1:\d+)", log)[-1]


async def swarm_loss(addresses: list[str], tokens, labels, cfg) -> float:
    """Evaluation through the live servers: Forward only (nothing accumulates), codec none, loss from the logits."""
    client = StageClient(CompressionPolicy.for_wire("none"), WireStats(), max_tensor_bytes=1 << 26)
    h = tokens
    for s, address in enumerate(addresses):
        shape = (*tokens.shape, cfg.vocab_size if s == cfg.n_stages - 1 else cfg.d_model)
        h = (await client.call(address, "Forward", s, "eval", {"inputs": h}, shape, 30)).tensor
    await client.close()
    return F.cross_entropy(h.flatten(0, 1), labels.flatten()).item()


@pytest.mark.timeout(600)
def test_peers_die_rejoin_and_an_emptied_stage_resumes_from_its_checkpoint(tmp_path):
    flags = [
        "--samples-per-step",
        "16",
        "--matchmaking-time",
        "0.5",
        "--progress-period",
        "0.2",
        "--checkpoint-period",
        "3600",
        "--no-rebalance",
    ]
    ckpt = {name: tmp_path / f"ckpt-{name}" for name in ("s0-r0", "s0-r1", "s1-r0", "s1-r1")}
    two_stages = [*model_args()[:-2], "--n-stages", "2"]  # same small model, 2 stages
    with LocalSwarm(tmp_path / "logs", "faults", two_stages) as swarm:
        swarm.start_dht()
        for name, path in ckpt.items():
            swarm.start_server(f"server-{name}", int(name[1]), [*flags, "--checkpoint-dir", str(path)])
        swarm.start_trainer("trainer-0", ["--batch-size", "4", "--in-flight", "2", "--request-timeout", "30"])
        wait_for(lambda: steps(swarm) >= 15, 180, "15 microbatches")

        # 1. one peer per stage vanishes (SIGKILL of its whole process group): nothing is lost, training goes on
        for name in ("server-s0-r0", "server-s1-r0"):
            swarm.children[name].signal_group(signal.SIGKILL)
            swarm.children[name].proc.wait(10)
        at_kill = steps(swarm)
        wait_for(lambda: swarm.trainer_stats()[0]["peers_per_stage"] == [1, 1], 60, "the trainer to drop the dead")
        wait_for(lambda: steps(swarm) >= at_kill + 20, 180, "20 microbatches after the kills")

        # 2. they come back and join: state downloaded from their stage peer, serving within 30 s
        started = time.monotonic()
        for name in ("s0-r0", "s1-r0"):
            swarm.start_server(f"server-{name}-again", int(name[1]), [*flags, "--checkpoint-dir", str(ckpt[name])])
        for name in ("s0-r0", "s1-r0"):
            log = wait_for(
                lambda n=name: "serving at" in log_text(swarm, f"server-{n}-again")
                and log_text(swarm, f"server-{n}-again"),
                60,
                f"{name} to serve again",
            )
            joined_after = time.monotonic() - started
            loaded = re.search(r"loaded state at epoch (\d+) \(digest (\w+)\)", log)
            assert loaded, f"{name} did not download its stage's state"
            peer_log = log_text(swarm, f"server-{name[:2]}-r1")
            sent = re.findall(r"sending state of epoch (\d+) to a joining peer \(digest (\w+)\)", peer_log)
            print(
                f"{name} rejoined at epoch {loaded[1]} and served after {joined_after:.1f}s; digest {loaded[2]}, "
                f"its peer sent {sent[-1] if sent else None}"
            )
            assert (loaded[1], loaded[2]) in sent, "the joiner's state must be bitwise the state its peer sent"
            assert joined_after < 30
        at_rejoin = steps(swarm)
        wait_for(
            lambda: steps(swarm) >= at_rejoin + 20 and swarm.trainer_stats()[0]["peers_per_stage"] == [2, 2],
            180,
            "training with both peers back",
        )

        # 3. stage 1 loses every peer (SIGTERM: each saves its checkpoint); trainers wait, then resume on a restart
        swarm.stop(["server-s1-r0-again", "server-s1-r1"])
        wait_for(lambda: "has no live peer" in log_text(swarm, "trainer-0"), 60, "the trainer to notice")
        at_empty = steps(swarm)
        swarm.start_server("server-s1-r1-again", 1, [*flags, "--checkpoint-dir", str(ckpt["s1-r1"])])
        wait_for(lambda: steps(swarm) >= at_empty + 10, 180, "training to resume")
        assert "resumed from checkpoint" in log_text(swarm, "server-s1-r1-again")

        swarm.stop(["trainer-0"])
        final = swarm.trainer_stats()[0]
        assert final["lost_microbatches"] == 0, final

        # 4. export: the gathered checkpoints load into the single-process model and give the swarm's loss
        cfg = model_config("local_debug", **{**MODEL_FLAGS, "n_stages": 2})
        tokens, labels = next(microbatches(load_corpus(None), 4, cfg.max_seq_len, seed=999))  # held out: unseen seed
        addresses = [serving_address(log_text(swarm, n)) for n in ("server-s0-r1", "server-s1-r1-again")]
        loss_swarm = asyncio.run(swarm_loss(addresses, tokens, labels, cfg))
        swarm.stop_all()  # SIGTERM: every server writes its final checkpoint
    model = export_model(cfg, [str(ckpt["s0-r1"]), str(ckpt["s1-r1"])], tmp_path / "model.safetensors")
    with torch.no_grad():
        loss_export = model(tokens, labels).item()
    print(
        f"held-out loss: swarm {loss_swarm:.6f}, exported model {loss_export:.6f}; {final['retries']} retries, "
        f"0 lost of {final['steps']} microbatches"
    )
    assert abs(loss_swarm - loss_export) / loss_export < 1e-5
