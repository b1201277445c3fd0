"""Stage checkpoints: weights in safetensors (`stage{i}.safetensors`, loadable by anyone), optimizer state and epoch
beside them (`stage{i}.state.pt`). Writes are atomic: a crash mid-save leaves the previous checkpoint intact."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from server.collab.lowrank import LowRankState
from server.worker import StageWorker

logger = logging.getLogger(__name__)


def weights_path(directory: str | Path, stage: int) -> Path:
    return Path(directory) / f"stage{stage}.safetensors"


def state_path(directory: str | Path, stage: int) -> Path:
    return Path(directory) / f"stage{stage}.state.pt"


def save_checkpoint(worker: StageWorker, directory: str | Path, lowrank: LowRankState | None = None) -> Path:
    """Any thread: reads a consistent snapshot (parameters, optimizer state, epoch) under the worker's state lock;
    with low-rank averaging, also its factors and this peer's residual."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    meta, tensors, shared = worker.state_and_shared()
    saved_lowrank = None
    if lowrank is not None:
        saved_lowrank = lowrank.checkpoint()  # this peer's residual, and the factors the state shares (one snapshot)
        if shared:
            saved_lowrank["shared"] = shared
    epoch = meta["epoch"]
    names = [name for name, p in worker.stage.named_parameters() if p.requires_grad]
    weights = {name: t.contiguous() for name, t in zip(names, tensors, strict=False)}
    stage = worker.stage.index
    for path, write in (
        (weights_path(directory, stage), lambda f: save_file(weights, f, metadata={"epoch": str(epoch)})),
        (
            state_path(directory, stage),
            lambda f: torch.save({"meta": meta, "tensors": tensors, "lowrank": saved_lowrank}, f),
        ),
    ):
        tmp = path.with_suffix(path.suffix + ".tmp")
        write(str(tmp))
        os.replace(tmp, path)
    logger.info("stage %d: checkpoint at epoch %d saved to %s", stage, epoch, directory)
    return weights_path(directory, stage)


def load_checkpoint(worker: StageWorker, directory: str | Path, lowrank: LowRankState | None = None) -> int | None:
    """Loads weights, optimizer state and epoch if a checkpoint of this stage exists; returns its epoch. With low-rank
    averaging, also its factors and residual where the checkpoint has them (else they start over)."""
    stage = worker.stage.index
    if not state_path(directory, stage).exists():
        return None
    saved = torch.load(state_path(directory, stage), weights_only=True)  # a crafted file cannot run code
    weights = load_file(str(weights_path(directory, stage)))
    names = [name for name, p in worker.stage.named_parameters() if p.requires_grad]
    tensors = [weights[name] for name in names] + saved["tensors"][len(names) :]

    def restore_lowrank() -> None:
        assert lowrank is not None
        try:
            lowrank.restore(saved.get("lowrank"))
        except (ValueError, AttributeError, TypeError) as e:
            logger.warning("stage %d: the low-rank factors start over: %s", stage, e)

    # the factors with the parameters, in one change: the state the peer shares (and its digest) pairs them
    worker.load_state(saved["meta"], tensors, None if lowrank is None else restore_lowrank)
    logger.info("stage %d: resumed from checkpoint at epoch %d", stage, saved["meta"]["epoch"])
    return int(saved["meta"]["epoch"])
