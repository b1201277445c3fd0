"""ACP-SGD's quality and bytes without a swarm: one process trains the model with its gradients replaced by what ACP
would average (server/collab/lowrank.py, the same code the servers run), against the whole gradients.

A stage group of one peer averages its own factors, so this isolates the algorithm (rank, error feedback, query reuse,
warm-up) from the swarm (staleness, the 8-bit wire, failed rounds); bench_quality measures ACP in the swarm. Same
optimizer as swarm-server (AdamW 2e-3, wd 0.01, clip 1.0), same global batch (32), held-out = the last 10% of the
built-in corpus. Bytes per round are the layout's: values sent in fp16 (what the servers send) against fp32 whole
gradients, averaged over the P and Q rounds.

    python -m tests.benchmarks.bench_lowrank [--quick] [--steps 300] [--d-model 512] [--ranks 4,16]
"""

from __future__ import annotations

import sys
import time

import torch

from server.collab.lowrank import PHASE_P, PHASE_Q, AcpState, Layout
from swarm.config import model_config
from swarm.model import GPT
from tests.benchmarks import common
from trainer.data import load_corpus

BATCH, LR, WEIGHT_DECAY, CLIP = 32, 2e-3, 0.01, 1.0


def windows(data: torch.Tensor, n: int, seq_len: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - seq_len - 1, (n,), generator=gen)
    tokens = torch.stack([data[s : s + seq_len + 1] for s in starts]).long()
    return tokens[:, :-1], tokens[:, 1:]


def train(cfg, data, heldout, steps: int, acp: dict | None, warmup: int) -> float:
    """Held-out loss after `steps` steps; `acp`: AcpState keyword arguments (rank, error_feedback, reuse), or None
    for whole gradients."""
    torch.manual_seed(0)
    model = GPT(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    state = None
    if acp is not None:
        rank = acp.pop("rank")
        state = AcpState(Layout.of([p.shape for p in params], rank), seed=1, **acp)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        loss = model(*windows(data, BATCH, cfg.max_seq_len, gen))
        optimizer.zero_grad()
        loss.backward()
        if state is not None and step >= warmup:
            grads = [p.grad for p in params]
            rnd = state.compress(grads, step, float(BATCH))
            approx = state.decompress(rnd, rnd.factors, [g.shape for g in grads])
            state.commit(rnd, rnd.factors, had_samples=True)
            for i, a in zip(state.layout.matrices, approx, strict=True):
                params[i].grad = a
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
    with torch.no_grad():
        return model(*heldout).item()


def bytes_ratio(cfg, rank: int) -> float:
    """fp32 whole-gradient bytes over ACP's fp16 bytes per round, for the whole model, P and Q rounds averaged."""
    shapes = [p.shape for p in GPT(cfg).parameters() if p.requires_grad]
    layout = Layout.of(shapes, rank)
    sent = sum(layout.sent_numel(phase, shapes) for phase in (PHASE_P, PHASE_Q)) / 2
    return 4 * sum(s.numel() for s in shapes) / (2 * sent)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300; --quick 40)")
    p.add_argument("--d-model", type=int, default=None, help="model width (default: the local_debug preset's)")
    p.add_argument("--ranks", default=None, help="comma-separated ranks (default 4,16,32; --quick 4)")
    p.add_argument("--warmup", type=int, default=10, help="whole-gradient steps first (swarm-server's default)")
    args = p.parse_args(argv)
    common.exit_on_sigterm()
    torch.set_num_threads(1)
    steps = args.steps or (40 if args.quick else 300)
    ranks = [int(r) for r in (args.ranks or ("4" if args.quick else "4,16,32")).split(",")]
    overrides = {"d_model": args.d_model, "d_ff": 3 * args.d_model} if args.d_model else {}
    cfg = model_config("local_debug", n_stages=3, **overrides)  # the model swarm-local trains, in one process
    corpus = load_corpus(None)
    cut = int(len(corpus) * 0.9)
    data, heldout = corpus[:cut], windows(corpus[cut:], 256, cfg.max_seq_len, torch.Generator().manual_seed(123))

    runs: dict[str, tuple[dict | None, float]] = {"whole gradients": (None, 1.0)}
    for rank in ranks:
        ratio = bytes_ratio(cfg, rank)
        runs[f"acp rank {rank}"] = ({"rank": rank}, ratio)
    ablate = ranks[0]
    runs[f"acp rank {ablate} without error feedback"] = (
        {"rank": ablate, "error_feedback": False},
        runs[f"acp rank {ablate}"][1],
    )
    if not args.quick:
        runs[f"acp rank {ablate} without query reuse"] = (
            {"rank": ablate, "reuse": False},
            runs[f"acp rank {ablate}"][1],
        )

    results = []
    for name, (acp, ratio) in runs.items():
        started = time.monotonic()
        loss = train(cfg, data, heldout, steps, dict(acp) if acp else None, args.warmup)
        common.log(f"{name}: held-out loss {loss:.4f} after {steps} steps ({time.monotonic() - started:.0f}s)")
        results.append({"config": name, "heldout": loss, "fp32_over_sent": ratio})
    whole = results[0]["heldout"]
    common.table(
        f"ACP in one process: held-out loss after {steps} steps (d_model {cfg.d_model}, warm-up {args.warmup})",
        ["configuration", "held-out loss", "vs whole", "all-reduce bytes: fp32 / sent per round"],
        [
            [r["config"], f"{r['heldout']:.4f}", f"{r['heldout'] / whole:.3f}", f"{r['fp32_over_sent']:.1f}x"]
            for r in results
        ],  # fmt: skip
    )
    common.write_json(
        args.out, "lowrank", {"hardware": common.hardware(), "steps": steps, "d_model": cfg.d_model, "results": results}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
