"""Training quality per sample: the swarm against one process training the same model on the same samples.

For each configuration a local swarm (`tools.local`, the same code path as `swarm-local`) trains until its
trainers have completed a fixed number of samples, then every server saves its stage (SIGTERM). One process then
trains the same model from the same seed on exactly those samples (each trainer's data stream, as many microbatches as
it completed, interleaved), with the same optimizer, learning rate, weight decay, per-stage clipping and global batch.
Both are evaluated on the same held-out sequences (the last 10% of the corpus, never trained on).

Two one-process references: the samples taken round-robin from the trainers' streams, `--samples-per-step` to a
step (what one process would do with the same samples), and, where the trainers log them, the very global batches
stage 0 formed (isolates what the swarm itself changes, compression and staleness, from the order of the samples).

Reported per configuration: held-out loss of the swarm (the model of each replica column: stage i's peer r, for r = 0
and 1) and of the one-process runs, their ratios, the optimizer steps each stage took against samples / global
batch, how far apart the peers of a stage ended (relative L2 of their parameters), and samples/s.

    python -m tests.benchmarks.bench_quality [--quick] [--data builtin,licences] [--samples 3232] [--only "a|b"]
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from swarm.config import ModelConfig
from swarm.model import GPT, clip_gradients
from tests.benchmarks import common
from tools.local import LocalConfig, start_peers
from tools.processes import LocalSwarm
from trainer.data import load_corpus, microbatches

HOLDOUT = 0.1  # the corpus' last 10% is held out
EVAL_SEQUENCES = 256
CLIP, WEIGHT_DECAY = 1.0, 0.01  # swarm-server's defaults


def configurations() -> dict[str, LocalConfig]:
    """swarm-local's defaults, each switched off or turned in turn, and the diagnostic baseline (one microbatch in
    flight, nothing compressed or delayed)."""
    d = LocalConfig()
    return {
        "defaults": d,
        "exact (1 trainer, 1 in flight, sync, no compression)": dataclasses.replace(
            d, trainers=1, in_flight=1, delay_optimizer_step=False, codec="none", allreduce_codec="none"
        ),
        "delayed updates": dataclasses.replace(d, delay_optimizer_step=True),
        "no delayed updates": dataclasses.replace(d, delay_optimizer_step=False),
        "wire codec none": dataclasses.replace(d, codec="none"),
        "all-reduce codec none": dataclasses.replace(d, allreduce_codec="none"),
        "no compression": dataclasses.replace(d, codec="none", allreduce_codec="none"),
        "1 in flight per trainer": dataclasses.replace(d, in_flight=1),
        "1 trainer": dataclasses.replace(d, trainers=1),
        "1 peer per stage": dataclasses.replace(d, servers_per_stage="1"),
        "lookahead 8": dataclasses.replace(d, lookahead_samples=8),
        "lookahead 16": dataclasses.replace(d, lookahead_samples=16),
        "lookahead 32": dataclasses.replace(d, lookahead_samples=32),
        # ACP-SGD stage averaging (server/collab/lowrank.py), and the paper's ablations
        "all-reduce acp": dataclasses.replace(d, allreduce_codec="acp"),
        "acp rank 1": dataclasses.replace(d, allreduce_codec="acp", allreduce_rank=1),
        "acp rank 16": dataclasses.replace(d, allreduce_codec="acp", allreduce_rank=16),
        "acp without warm-up": dataclasses.replace(d, allreduce_codec="acp", allreduce_warmup_epochs=0),
        "acp without error feedback": dataclasses.replace(d, allreduce_codec="acp", allreduce_error_feedback=False),
        "acp without query reuse": dataclasses.replace(d, allreduce_codec="acp", allreduce_query_reuse=False),
        # PowerSGD: both factors every epoch (two rounds); rank 2 sends what ACP's rank 4 sends
        "all-reduce powersgd": dataclasses.replace(d, allreduce_codec="powersgd"),
        "powersgd rank 2": dataclasses.replace(d, allreduce_codec="powersgd", allreduce_rank=2),
        "powersgd without error feedback": dataclasses.replace(
            d, allreduce_codec="powersgd", allreduce_error_feedback=False
        ),
        # selective stage compression (Optimus-CC): low-rank on the earliest stages only
        "acp on stage 0": dataclasses.replace(d, allreduce_codec="acp", allreduce_compress_stages="0"),
        "acp on stages 0,1": dataclasses.replace(d, allreduce_codec="acp", allreduce_compress_stages="0,1"),
        # pipeline compression (issue 12): the hidden states' gradients, and compression-aware boundaries
        "backward piecewise4": dataclasses.replace(d, backward_codec="piecewise4"),
        "backward lowrank8": dataclasses.replace(d, backward_codec="lowrank8"),
        "backward lowrank8 without error feedback": dataclasses.replace(d, backward_codec="lowrank8-noef"),
        "backward lowrank8, epilogue 25%": dataclasses.replace(d, backward_codec="lowrank8", backward_epilogue=0.25),
        "maxout 2x": dataclasses.replace(d, boundary="maxout"),
        "maxout 2x, backward piecewise4": dataclasses.replace(d, boundary="maxout", backward_codec="piecewise4"),
        # tied embeddings (issue 11): the head is the embedding, synced by one all-reduce over stages 0 and 2
        "tied embeddings": dataclasses.replace(d, tie_embeddings=True),
        "tied embeddings, no compression": dataclasses.replace(
            d, tie_embeddings=True, codec="none", allreduce_codec="none"
        ),
        # local-step training (issue 50): H inner steps per peer between outer rounds = outer / (2 peers x local)
        # DiLoCo's outer optimizer (lr 0.7, Nesterov momentum 0.9)
        **{
            f"local {lb}, outer {outer} (H {outer // (2 * lb)}), all-reduce {codec}, outer lr 0.7 momentum 0.9": (
                dataclasses.replace(
                    d, local_batch=lb, samples_per_step=outer, allreduce_codec=codec, outer_lr=0.7, outer_momentum=0.9
                )
            )
            for lb, outer, codec in [
                (8, 128, "none"),
                (8, 128, "blockwise8"),
                (8, 512, "none"),
                (8, 512, "blockwise8"),
                (32, 512, "blockwise8"),
                (8, 2048, "blockwise8"),
            ]
        },
        # the outer step as plain averaging (outer lr 1, no momentum: the servers' defaults), which bench_local_steps
        # found better than DiLoCo's at these short runs
        **{
            f"local {lb}, outer {outer} (H {outer // (2 * lb)}), all-reduce {codec}, outer lr 1 momentum 0": (
                dataclasses.replace(d, local_batch=lb, samples_per_step=outer, allreduce_codec=codec)
            )
            for lb, outer, codec in [(8, 128, "blockwise8"), (8, 512, "blockwise8"), (32, 512, "blockwise8")]
        },
        # every version a microbatch in flight can name kept: its Backward recomputes at its Forward's parameters
        "local 8, outer 128 (H 8), all-reduce blockwise8, outer lr 1 momentum 0, stash 32": dataclasses.replace(
            d, local_batch=8, samples_per_step=128, stash_versions=32
        ),
    }


QUICK = ("defaults", "exact (1 trainer, 1 in flight, sync, no compression)", "no compression")


def licence_texts(max_bytes: int = 5 << 20) -> bytes:
    """A text corpus that is not code: the licence texts of the system's packages (Debian keeps them as files)."""
    files = sorted(Path("/usr/share/common-licenses").glob("*")) + sorted(Path("/usr/share/doc").glob("*/copyright"))
    chunks, total = [], 0
    for path in files:
        if path.is_file():
            data = path.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
    if total < 1 << 20:
        raise SystemExit("--data licences: fewer than 1 MB of licence texts under /usr/share on this machine")
    return b"\n".join(chunks)[:max_bytes]


def prepare_corpus(name: str, out: Path) -> tuple[Path, torch.Tensor]:
    """-> (file with the training part, held-out bytes). `name`: builtin (the stdlib, as the trainer reads it),
    licences, or a path."""
    if name == "builtin":
        data = bytes(load_corpus(None).numpy())
    elif name == "licences":
        data = licence_texts()
    else:
        data = bytes(load_corpus(name).numpy())
    cut = int(len(data) * (1 - HOLDOUT))
    out.mkdir(parents=True, exist_ok=True)
    train_path = out / f"{Path(name).name}-train.txt"
    train_path.write_bytes(data[:cut])
    return train_path, torch.frombuffer(bytearray(data[cut:]), dtype=torch.uint8)


def held_out_batch(heldout: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, labels = next(microbatches(heldout, EVAL_SEQUENCES, seq_len, seed=12345))
    return tokens, labels


@torch.no_grad()
def evaluate(model: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    tokens, labels = batch
    losses = [model(t, y).item() for t, y in zip(tokens.split(32), labels.split(32), strict=True)]
    return sum(losses) / len(losses)


def one_process(
    cfg: ModelConfig, train: torch.Tensor, local: LocalConfig, groups: list[list[tuple[int, int]]], batch: tuple
) -> dict:
    """Train on the given global batches, each a list of (trainer t, index i): the i-th microbatch of trainer t's
    data stream (seed t). One AdamW step per global batch, clipping each stage's gradient like its server does."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=local.lr, weight_decay=WEIGHT_DECAY)
    trainers = 1 + max(t for g in groups for t, _ in g)
    streams = [microbatches(train, local.batch_size, cfg.max_seq_len, seed=t) for t in range(trainers)]
    drawn: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(trainers)]
    for group in groups:
        for t, i in group:
            while len(drawn[t]) <= i:
                drawn[t].append(next(streams[t]))
            tokens, labels = drawn[t][i]
            (model(tokens, labels) * tokens.shape[0] / local.samples_per_step).backward()
        for stage in model.stages:  # a tied weight apart, as the servers of both its stages clip it
            clip_gradients([p for p in stage.parameters() if p is not model.tied], CLIP)
        if model.tied is not None:
            clip_gradients([model.tied], CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"heldout_loss": evaluate(model, batch), "steps": len(groups)}


def round_robin(completed: list[int], per_batch: int) -> list[list[tuple[int, int]]]:
    """The trainers' microbatches (trainer t: the first completed[t] of its stream) taken in turn, `per_batch` to a
    global batch, the incomplete last one left out: what one process given the same samples would do."""
    order = [(t, i) for i in range(max(completed, default=0)) for t in range(len(completed)) if i < completed[t]]
    return [order[k : k + per_batch] for k in range(0, len(order) - per_batch + 1, per_batch)]


def swarm_batches(records: list[dict], samples_per_step: int) -> list[list[tuple[int, int]]] | None:
    """The global batches stage 0 formed, from the trainers' loss logs (None where the swarm does not log them);
    the last one left out if it is incomplete, as the swarm did not step it."""
    if any(r.get("global_batch") is None for r in records):
        return None
    groups: dict[int, list[dict]] = {}
    for r in records:
        groups.setdefault(r["global_batch"], []).append(r)
    batches = [[(r["trainer"], r["index"]) for r in groups[g]] for g in sorted(groups)]
    last = groups[max(groups)]
    return batches[:-1] if sum(r["batch"] for r in last) < samples_per_step else batches


def run_swarm(name: str, local: LocalConfig, train_path: Path, samples: int, out: Path, timeout: float) -> dict:
    """Train until the trainers completed `samples` in all; every server then saves its stage. Returns the trainers'
    completed microbatches, throughput and the per-server checkpoint folders."""
    tag = "".join(c if c.isalnum() else "-" for c in name)[:40]
    log_dir = out / "logs" / f"{tag}-{time.strftime('%H%M%S')}"
    per_trainer = math.ceil(samples / local.batch_size / local.trainers)

    def ckpt(server: str) -> list[str]:
        return ["--checkpoint-dir", str(log_dir / f"ckpt-{server}"), "--checkpoint-period", "1e9"]

    def feed(trainer: str) -> list[str]:
        log = str(log_dir / f"{trainer}-losses.jsonl")
        return ["--data", str(train_path), "--max-steps", str(per_trainer), "--loss-log", log]

    started = time.monotonic()
    with LocalSwarm(log_dir, local.swarm_name, local.model_args()) as swarm:
        swarm.start_dht()
        start_peers(swarm, local, server_extra=ckpt, trainer_extra=feed)
        trainers = [c for n, c in swarm.children.items() if n.startswith("trainer")]
        deadline = time.monotonic() + timeout
        last = 0.0
        while any(t.alive() for t in trainers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: trainers did not finish in {timeout:.0f}s; logs in {log_dir}")
            if time.monotonic() - last > 15:
                last = time.monotonic()
                done = sum(s.get("samples", 0) for s in swarm.trainer_stats())
                common.log(f"  {name}: {done}/{per_trainer * local.batch_size * local.trainers} samples")
            time.sleep(0.5)
        swarm.stop_all()  # SIGTERM: every server writes its stage
    stats = [json.loads((log_dir / f"trainer-{t}.json").read_text()) for t in range(local.trainers)]
    records = [
        {**json.loads(line), "trainer": t}
        for t in range(local.trainers)
        for line in (log_dir / f"trainer-{t}-losses.jsonl").read_text().splitlines()
    ]
    return {"stats": stats, "records": records, "log_dir": log_dir, "wall_s": time.monotonic() - started}


def swarm_models(cfg: ModelConfig, log_dir: Path, allocation: list[int]) -> tuple[list[GPT], list[float]]:
    """The model of each replica column r (stage i from server-s{i}-r{min(r, peers-1)}), and per stage the largest
    relative L2 distance between the parameters of its peers."""
    weights = {
        (s, r): load_file(str(log_dir / f"ckpt-server-s{s}-r{r}" / f"stage{s}.safetensors"))
        for s, n in enumerate(allocation)
        for r in range(n)
    }
    models = []
    for r in range(max(allocation)):
        model = GPT(cfg)
        state = {f"stages.{s}.{k}": v for s, n in enumerate(allocation) for k, v in weights[(s, min(r, n - 1))].items()}
        model.load_state_dict(state, strict=True)
        models.append(model)
    gaps = []
    for s, n in enumerate(allocation):
        ref = torch.cat([v.flatten() for _, v in sorted(weights[(s, 0)].items())])
        gaps.append(
            max(
                (torch.cat([v.flatten() for _, v in sorted(weights[(s, r)].items())]) - ref).norm().item()
                / ref.norm().item()
                for r in range(n)
            )
        )
    return models, gaps


STATUS = re.compile(r"epoch (\d+), .* all-reduce ([\d.]+) MB \(fp32 ([\d.]+) MB\)")


def allreduce_bytes(log_dir: Path) -> tuple[float, float, int]:
    """(MB the servers' averaging sent and received, MB whole fp32 tensors would have, epochs), summed over servers
    from the last status line each logged."""
    sent = fp32 = epochs = 0
    for path in log_dir.glob("server-*.log"):
        found = STATUS.findall(path.read_text())
        if found:
            epoch, mb, fp32_mb = found[-1]
            sent, fp32, epochs = sent + float(mb), fp32 + float(fp32_mb), epochs + int(epoch)
    return sent, fp32, epochs


def throughput(log_dir: Path, trainers: int) -> float:
    """Samples/s of the trainers over their last 80% of microbatches (start-up excluded), summed over trainers."""
    total = 0.0
    for t in range(trainers):
        records = [json.loads(line) for line in (log_dir / f"trainer-{t}-losses.jsonl").read_text().splitlines()]
        first = records[len(records) // 5]
        span = records[-1]["t"] - first["t"]
        total += (records[-1]["step"] - first["step"]) * records[-1]["batch"] / span if span > 0 else float("nan")
    return total


def allreduce_cell(mb: float, fp32_mb: float, epochs: int) -> str:
    if not epochs or not mb:
        return "-"
    return f"{mb / epochs:.3f} ({fp32_mb / mb:.1f}x)"


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, help="comma-separated corpora: builtin, licences, or paths")
    p.add_argument("--samples", type=int, default=None, help="samples per run (default 3232; --quick 1024)")
    p.add_argument("--only", default=None, help="configuration names separated by '|' (see configurations())")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per swarm run")
    args = p.parse_args(argv)
    common.exit_on_sigterm()
    samples = args.samples or (1024 if args.quick else 3232)
    corpora = (args.data or ("builtin" if args.quick else "builtin,licences")).split(",")
    configs = configurations()
    names = args.only.split("|") if args.only else (list(QUICK) if args.quick else list(configs))
    unknown = set(names) - set(configs)
    if unknown:
        p.error(f"unknown configuration(s) {sorted(unknown)}; choose from {list(configs)}")
    out = Path(args.out) / "quality"
    results = []
    for corpus in corpora:
        train_path, heldout = prepare_corpus(corpus, out)
        train = load_corpus(str(train_path))
        reference_cache: dict[tuple, dict] = {}
        for name in names:
            local = configs[name]
            cfg = local.model()
            batch = held_out_batch(heldout, cfg.max_seq_len)
            common.log(f"{corpus} / {name}: swarm run")
            run = run_swarm(name, local, train_path, samples, out, args.timeout)
            completed = [s["steps"] for s in run["stats"]]  # trainer t reads the stream of seed t
            # local steps: the one process is synchronous training's, at the default global batch (an outer interval
            # is not a batch), and there are no global batches of the swarm's own to replay
            reference = dataclasses.replace(local, samples_per_step=LocalConfig().samples_per_step, local_batch=0)
            per_batch = reference.samples_per_step // local.batch_size
            key = (
                tuple(completed),
                local.lr,
                reference.samples_per_step,
                local.batch_size,
                repr(cfg),
            )  # cfg: the model
            if key not in reference_cache:
                common.log(f"{corpus} / {name}: one process on the same {sum(completed)} microbatches, round-robin")
                reference_cache[key] = one_process(cfg, train, reference, round_robin(completed, per_batch), batch)
            ref = reference_cache[key]
            same = None if local.local_batch else swarm_batches(run["records"], local.samples_per_step)
            if same is not None:
                common.log(f"{corpus} / {name}: one process on the swarm's own {len(same)} global batches")
            ref_same = one_process(cfg, train, local, same, batch) if same is not None else None
            models, gaps = swarm_models(cfg, run["log_dir"], local.allocation)
            swarm_losses = [evaluate(m, batch) for m in models]
            swarm_loss = sum(swarm_losses) / len(swarm_losses)
            row = {
                "corpus": corpus,
                "config": name,
                "samples": sum(s["samples"] for s in run["stats"]),
                "swarm_heldout": swarm_losses,
                "one_process_heldout": ref["heldout_loss"],
                "ratio": swarm_loss / ref["heldout_loss"],
                "same_batches_heldout": ref_same and ref_same["heldout_loss"],
                "ratio_same_batches": ref_same and swarm_loss / ref_same["heldout_loss"],
                "stage_steps": [max(s["param_versions"][i] for s in run["stats"]) for i in range(local.stages)],
                "one_process_steps": ref["steps"],
                "peer_gap": gaps,
                "samples_per_second": throughput(run["log_dir"], local.trainers),
                "allreduce_mb_fp32_mb_epochs": allreduce_bytes(run["log_dir"]),
                "lost": sum(s["lost_microbatches"] for s in run["stats"]),
                "log_dir": str(run["log_dir"]),
            }
            results.append(row)
            common.log(f"{corpus} / {name}: swarm {swarm_losses} vs one process {ref['heldout_loss']:.4f}")
    common.table(
        f"held-out loss at equal samples ({samples}), swarm vs one process",
        [
            "corpus",
            "configuration",
            "swarm (r0/r1)",
            "one process",
            "swarm/one",
            "same batches",
            "stage steps",
            "peer gap",
            "samples/s",
            "all-reduce MB/peer-epoch (fp32/sent)",
            "all-reduce kB/sample",
        ],
        [
            [
                r["corpus"],
                r["config"],
                "/".join(f"{x:.3f}" for x in r["swarm_heldout"]),
                f"{r['one_process_heldout']:.3f}",
                f"{r['ratio']:.3f}",
                f"{r['ratio_same_batches']:.4f}" if r["ratio_same_batches"] else "-",
                "/".join(map(str, r["stage_steps"])) + f" ({r['one_process_steps']})",
                "/".join(f"{g:.1e}" for g in r["peer_gap"]),
                f"{r['samples_per_second']:.1f}",
                allreduce_cell(*r["allreduce_mb_fp32_mb_epochs"]),
                f"{1e3 * r['allreduce_mb_fp32_mb_epochs'][0] / max(1, r['samples']):.2f}",
            ]
            for r in results
        ],
    )
    common.write_json(args.out, "quality", {"hardware": common.hardware(), "samples": samples, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
