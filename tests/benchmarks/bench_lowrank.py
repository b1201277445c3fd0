"""Low-rank averaging's quality and bytes without a swarm: one process trains the model with its gradients replaced by
what ACP-SGD or PowerSGD would average (server/collab/lowrank.py, the same code the servers run), against the whole
gradients.

A stage group of one peer averages its own factors, so this isolates the algorithm (rank, error feedback, query reuse,
warm-up) from the swarm (staleness, the 8-bit wire, failed rounds); bench_quality measures ACP in the swarm. Same
optimizer as swarm-server (AdamW 2e-3, wd 0.01, clip 1.0), same global batch (32, `--batch`), held-out = the last 10% of the
built-in corpus. Bytes per round are the layout's: values sent in fp16 (what the servers send) against fp32 whole
gradients per epoch (ACP: one factor per epoch, averaged over P and Q epochs; PowerSGD: both factors every epoch).

`--optimizer sgd` (Nesterov momentum 0.9, lr 0.3: the optimizer of ACP-SGD's own experiments) or `adafactor`
(torch's, lr 1e-2: a factored second moment, no momentum) trains both sides with that optimizer instead of AdamW, to
measure how much of the gap is the optimizer's. `--batch N` changes the global batch (less gradient noise per step),
`--cosine` adds the servers' cosine decay of the learning rate to 10% over the run (as with --total-steps).

    python -m tests.benchmarks.bench_lowrank [--quick] [--steps 300] [--d-model 512] [--ranks 4,16] [--only "a|b"]
        [--batch 128] [--cosine]
"""

from __future__ import annotations

import sys
import time

import torch

from server.collab.lowrank import PHASE_P, PHASE_PSGD_P, PHASE_PSGD_Q, PHASE_Q, AcpState, Layout, PowerSgdState
from server.optim import build_schedule
from swarm.config import model_config
from swarm.model import GPT
from tests.benchmarks import common
from trainer.data import load_corpus

BATCH, WEIGHT_DECAY, CLIP = 32, 0.01, 1.0
OPTIMIZERS = {  # name: (class, keyword arguments)
    "adamw": (torch.optim.AdamW, {"lr": 2e-3, "weight_decay": WEIGHT_DECAY}),  # swarm-server's
    "sgd": (torch.optim.SGD, {"lr": 0.3, "momentum": 0.9, "nesterov": True, "weight_decay": WEIGHT_DECAY}),
    "adafactor": (getattr(torch.optim, "Adafactor", None), {"lr": 1e-2, "weight_decay": WEIGHT_DECAY}),  # torch >= 2.5
}


def windows(data: torch.Tensor, n: int, seq_len: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - seq_len - 1, (n,), generator=gen)
    tokens = torch.stack([data[s : s + seq_len + 1] for s in starts]).long()
    return tokens[:, :-1], tokens[:, 1:]


def train(
    cfg,
    data,
    heldout,
    steps: int,
    acp: dict | None,
    warmup: int,
    optimizer: str = "adamw",
    batch: int = BATCH,
    cosine: bool = False,
) -> float:
    """Held-out loss after `steps` steps; `acp`: the low-rank state's keyword arguments (kind: "acp" or "powersgd",
    rank, error_feedback, reuse), or None for whole gradients. `cosine`: the servers' schedule (server/optim.py)
    decays the learning rate to 10% over the `steps`, as a run with --total-steps does."""
    torch.manual_seed(0)
    model = GPT(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    make, kwargs = OPTIMIZERS[optimizer]
    optim = make(params, **kwargs)
    schedule = build_schedule(optim, 0, steps if cosine else 0)
    state: AcpState | PowerSgdState | None = None
    if acp is not None:
        rank, kind = acp.pop("rank"), acp.pop("kind", "acp")
        state = (AcpState if kind == "acp" else PowerSgdState)(Layout.of([p.shape for p in params], rank), 1, **acp)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        loss = model(*windows(data, batch, cfg.max_seq_len, gen))
        optim.zero_grad()
        loss.backward()
        if state is not None and step >= warmup:
            grads = [p.grad for p in params]
            shapes = [g.shape for g in grads]
            if isinstance(state, AcpState):
                rnd = state.compress(grads, step, float(batch))
                approx = state.decompress(rnd, rnd.factors, shapes)
                state.commit(rnd, rnd.factors, had_samples=True)
            else:
                first = state.first(grads, step, float(batch))
                second = state.second(first, first.factors)
                approx = state.finish(second, second.factors, shapes, had_samples=True)
            for i, a in zip(state.layout.matrices, approx, strict=True):
                params[i].grad = a
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optim.step()
        schedule.step()
    with torch.no_grad():
        return model(*heldout).item()


def bytes_ratio(cfg, rank: int, kind: str = "acp") -> float:
    """fp32 whole-gradient bytes over the fp16 bytes sent per epoch, for the whole model: ACP's P and Q epochs
    averaged, or PowerSGD's two rounds of one epoch."""
    shapes = [p.shape for p in GPT(cfg).parameters() if p.requires_grad]
    layout = Layout.of(shapes, rank)
    if kind == "acp":
        sent = sum(layout.sent_numel(phase, shapes) for phase in (PHASE_P, PHASE_Q)) / 2
    else:
        sent = sum(layout.sent_numel(phase, shapes) for phase in (PHASE_PSGD_P, PHASE_PSGD_Q))
    return 4 * sum(s.numel() for s in shapes) / (2 * sent)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300; --quick 40)")
    p.add_argument("--d-model", type=int, default=None, help="model width (default: the local_debug preset's)")
    p.add_argument("--ranks", default=None, help="comma-separated ranks (default 4,16,32; --quick 4)")
    p.add_argument("--warmup", type=int, default=10, help="whole-gradient steps first (swarm-server's default)")
    p.add_argument("--kinds", default="acp,powersgd", help="low-rank schemes to run at each rank (acp, powersgd)")
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS), help="both sides train with it")
    p.add_argument("--batch", type=int, default=BATCH, help="samples per step (swarm-local's global batch: 32)")
    p.add_argument("--cosine", action="store_true", help="decay the learning rate to 10%% over the steps")
    p.add_argument("--only", default=None, help="configuration names separated by '|' ('whole gradients' always runs)")
    args = p.parse_args(argv)
    common.exit_on_sigterm()
    if OPTIMIZERS[args.optimizer][0] is None:
        p.error(f"--optimizer {args.optimizer} needs a newer torch than {torch.__version__}")
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
        for kind in args.kinds.split(","):
            runs[f"{kind} rank {rank}"] = ({"kind": kind, "rank": rank}, bytes_ratio(cfg, rank, kind))
    ablate = ranks[0]
    for kind in args.kinds.split(","):
        full = f"{kind} rank {ablate}"
        runs[f"{full} without error feedback"] = (
            {"kind": kind, "rank": ablate, "error_feedback": False},
            runs[full][1],
        )
        if not args.quick:
            runs[f"{full} without query reuse"] = ({"kind": kind, "rank": ablate, "reuse": False}, runs[full][1])

    if args.only:
        wanted = {"whole gradients", *args.only.split("|")}
        if unknown := wanted - set(runs):
            p.error(f"--only names no configuration {sorted(unknown)}; they are {sorted(runs)}")
        runs = {name: run for name, run in runs.items() if name in wanted}
    results = []
    for name, (acp, ratio) in runs.items():
        started = time.monotonic()
        loss = train(
            cfg, data, heldout, steps, dict(acp) if acp else None, args.warmup, args.optimizer, args.batch, args.cosine
        )
        common.log(f"{name}: held-out loss {loss:.4f} after {steps} steps ({time.monotonic() - started:.0f}s)")
        results.append({"config": name, "heldout": loss, "fp32_over_sent": ratio})
    whole = results[0]["heldout"]
    common.table(
        f"Low-rank averaging in one process: held-out loss after {steps} steps (d_model {cfg.d_model}, warm-up "
        f"{args.warmup}, {args.optimizer}{', cosine decay' if args.cosine else ''}, batch {args.batch})",
        ["configuration", "held-out loss", "vs whole", "all-reduce bytes: fp32 / sent per epoch"],
        [
            [r["config"], f"{r['heldout']:.4f}", f"{r['heldout'] / whole:.3f}", f"{r['fp32_over_sent']:.1f}x"]
            for r in results
        ],  # fmt: skip
    )
    common.write_json(
        args.out,
        "lowrank",
        {
            "hardware": common.hardware(),
            "steps": steps,
            "d_model": cfg.d_model,
            "optimizer": args.optimizer,
            "cosine": args.cosine,
            "batch": args.batch,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
