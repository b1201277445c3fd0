"""What a trainer tells Prometheus (swarm/metrics.py): its last progress snapshot (`Trainer.snapshot`, taken every
second on the event loop), so the metrics thread reads a finished dict and never the loop's live state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm.metrics import Families

if TYPE_CHECKING:
    from trainer.trainer import Trainer


def fill_trainer_metrics(trainer: Trainer, f: Families) -> None:
    s = trainer.last_snapshot
    if not s:  # before the first second
        return
    f.counter("trainer_microbatches", "microbatches trained (forward and backward through every stage)", s["steps"])
    f.counter("trainer_samples", "samples trained", s["samples"])
    f.gauge("trainer_samples_per_second", "samples/s since the trainer started", s["samples_per_second"])
    if s["recent_loss"] is not None:
        f.gauge("trainer_loss", "mean loss of the recent microbatches", s["recent_loss"])
    f.counter("trainer_lost_microbatches", "microbatches given up after every retry", s["lost_microbatches"])
    f.counter("trainer_retries", "stage calls retried on another peer", s["retries"])
    for stage, (peers, banned, version) in enumerate(
        zip(s["peers_per_stage"], s["banned_per_stage"], s["param_versions"], strict=True)
    ):
        f.gauge("trainer_stage_peers", "live, unbanned peers of the stage", peers, stage=str(stage))
        f.gauge("trainer_stage_banned", "peers of the stage banned until they re-announce", banned, stage=str(stage))
        f.gauge("trainer_stage_version", "the newest parameter version a stage replied with", version, stage=str(stage))
    by_role = {role: (b["wire"], b["fp32"]) for role, b in s["by_role"].items()}
    f.traffic("trainer_pipeline", "stage calls' tensors sent and received", by_role)
