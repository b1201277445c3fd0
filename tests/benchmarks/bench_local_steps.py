"""Local-step training's settings, simulated in one process: held-out loss at equal samples of synchronous training
(one AdamW step per global batch) against local steps (each of W workers steps its own AdamW every --local-batch of
its samples; every outer interval the workers' pseudo-gradients are averaged, weighted by samples, and one outer step
is taken with the server's own `server.outer.OuterState`), over a grid of local batch, outer interval and outer
optimizer. No swarm: the same model, data streams (worker w reads trainer w's), clipping per stage (each stage is
its own server) and held-out sequences as bench_quality, so the grid is cheap and bench_quality's swarm rows check
the settings it picks.

    python -m tests.benchmarks.bench_local_steps [--quick] [--data builtin] [--samples 3232] [--workers 2]
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from server.optim import build_optimizer
from server.outer import OuterState
from swarm.config import model_config
from swarm.model import GPT, clip_gradients
from tests.benchmarks import common
from tests.benchmarks.bench_quality import CLIP, WEIGHT_DECAY, evaluate, held_out_batch, prepare_corpus
from trainer.data import load_corpus, microbatches

LR, BATCH, SYNC_BATCH = 2e-3, 8, 32  # swarm-local's learning rate, microbatch and global batch
# (local batch, outer interval in samples, outer lr, outer momentum); DiLoCo's outer optimizer is (0.7, 0.9)
GRID = [
    (8, 128, 0.7, 0.9),
    (8, 128, 1.0, 0.0),
    (8, 128, 0.7, 0.5),
    (8, 512, 0.7, 0.9),
    (8, 512, 1.0, 0.0),
    (32, 512, 0.7, 0.9),
    (32, 512, 1.0, 0.0),
    (32, 2048, 1.0, 0.0),
]
QUICK = GRID[:2]


def clip_per_stage(model: GPT) -> None:
    for stage in model.stages:
        clip_gradients([p for p in stage.parameters() if p.requires_grad], CLIP)


def synchronous(cfg, streams, samples: int, batch) -> float:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = build_optimizer("adamw", list(model.parameters()), LR, WEIGHT_DECAY)
    done, w = 0, 0
    while done < samples:
        for _ in range(SYNC_BATCH // BATCH):
            tokens, labels = next(streams[w % len(streams)])
            w += 1
            (model(tokens, labels) * tokens.shape[0] / SYNC_BATCH).backward()
            done += tokens.shape[0]
        clip_per_stage(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return evaluate(model, batch)


def local_steps(cfg, streams, samples: int, batch, local: int, interval: int, lr: float, momentum: float) -> float:
    torch.manual_seed(0)
    workers = [GPT(cfg) for _ in streams]
    for m in workers[1:]:
        m.load_state_dict(workers[0].state_dict())
    inner = [build_optimizer("adamw", list(m.parameters()), LR, WEIGHT_DECAY) for m in workers]
    outer = OuterState(list(workers[0].parameters()), lr, momentum)
    done = 0
    while done < samples:
        parts = []
        for m, opt, stream in zip(workers, inner, streams, strict=True):
            seen = 0
            while seen < interval // len(workers):
                for _ in range(max(1, local // BATCH)):
                    tokens, labels = next(stream)
                    (m(tokens, labels) * tokens.shape[0] / max(local, BATCH)).backward()
                    seen += tokens.shape[0]
                clip_per_stage(m)
                opt.step()
                opt.zero_grad(set_to_none=True)
            parts.append((outer.pseudo_gradients(list(m.parameters())), seen))
            done += seen
        total = sum(n for _, n in parts)
        averaged = [sum(n * g[i] for g, n in parts) / total for i in range(len(parts[0][0]))]
        outer.step(averaged)
        with torch.no_grad():
            for m in workers:
                for p, o in zip(m.parameters(), outer.params, strict=True):
                    p.copy_(o)
    model = GPT(cfg)
    with torch.no_grad():
        for p, o in zip(model.parameters(), outer.params, strict=True):
            p.copy_(o)
    return evaluate(model, batch)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--data", default="builtin", help="builtin, licences, or a path (bench_quality's corpora)")
    p.add_argument("--samples", type=int, default=3232)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    cfg = model_config("local_debug")
    train_path, heldout = prepare_corpus(args.data, Path(args.out) / "local_steps")
    train, batch = load_corpus(str(train_path)), held_out_batch(heldout, cfg.max_seq_len)

    def streams():
        return [microbatches(train, BATCH, cfg.max_seq_len, seed=w) for w in range(args.workers)]

    started = time.monotonic()
    sync = synchronous(cfg, streams(), args.samples, batch)
    common.log(f"sync (global batch {SYNC_BATCH}): {sync:.4f} ({time.monotonic() - started:.0f}s)")
    rows = [["sync", "-", SYNC_BATCH, "-", f"{sync:.4f}", "1.000", "1"]]
    results = [{"config": "sync", "heldout": sync}]
    for local, interval, lr, momentum in QUICK if args.quick else GRID:
        started = time.monotonic()
        loss = local_steps(cfg, streams(), args.samples, batch, local, interval, lr, momentum)
        h = interval // (args.workers * local)
        name = f"local {local}, outer {interval} (H {h}), outer lr {lr} momentum {momentum}"
        common.log(f"{name}: {loss:.4f} ({time.monotonic() - started:.0f}s)")
        # averaging bytes per sample against sync's fp32 gradient at every global batch: one round per interval
        rows.append([name, local, interval, h, f"{loss:.4f}", f"{loss / sync:.3f}", f"{interval // SYNC_BATCH}"])
        results.append({"config": name, "heldout": loss, "ratio": loss / sync})
    common.table(
        f"held-out loss at equal samples ({args.samples}, {args.workers} workers, {args.data}), one process",
        ["configuration", "local batch", "outer interval", "H", "held-out", "vs sync", "fewer rounds x"],
        rows,
    )
    common.write_json(args.out, "local_steps", {"hardware": common.hardware(), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
