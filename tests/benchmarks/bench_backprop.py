"""Pipeline compression's quality and bytes without a swarm: one process runs the stages in sequence, every hidden
state and gradient between two stages encoded and decoded with the codecs the servers use, against fp32.

Each stage's gradient leaves through `encode_tensor` with the sender's `ErrorMemory`, keyed by the global batch, as
`server/service.py` does: the error of one microbatch's compression reaches the next microbatch of the same step, and
never the next step. `peers` senders per stage take microbatches in turn (in a swarm any peer of a stage may serve a
microbatch's backward, and each keeps its own error memory). `epilogue`: only the last microbatches of each step are
compressed with the backward codec, the rest travel 8-bit (Optimus-CC's epilogue-only compression, with SWARM's
"critical path" taken as the end of each global batch, when the all-reduce waits for the last gradients).

Same optimizer as swarm-server (AdamW 2e-3, wd 0.01, clip 1.0), global batch 32 in microbatches of 8, held-out = 256
windows of the last 10% of the corpus. Corpora: `builtin` (the standard library's Python source, swarm-local's
default) and `prose` (the English text of Python's own documentation topics, `pydoc_data.topics`).

    python -m tests.benchmarks.bench_backprop [--quick] [--steps 100] [--data builtin,prose] [--only REGEX] [--seed N]
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from dataclasses import dataclass

import torch

from swarm.compression import CodecContext, TensorRole, get_codec
from swarm.compression.memory import ErrorMemory
from swarm.config import model_config
from swarm.model import Stage
from swarm.pipeline import stage_backward, stage_forward
from swarm.protocol.tensors import decode_tensor, encode_tensor
from tests.benchmarks import common
from tests.benchmarks.bench_lowrank import windows
from trainer.data import load_corpus

MICROBATCH, GLOBAL_BATCH, LR, WEIGHT_DECAY, CLIP = 8, 32, 2e-3, 0.01, 1.0
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Setup:
    forward: str = "none"
    backward: str = "none"
    boundary: str = "none"
    factor: int = 2
    peers: int = 1  # senders per stage, taking microbatches in turn
    epilogue: float = 1.0  # share of each step's microbatches (the last ones) sent with `backward`; the rest 8-bit


SETUPS = {
    "fp32 (none)": Setup(),
    "blockwise8 (today)": Setup(forward="blockwise8", backward="blockwise8"),
    "piecewise4 both ways": Setup(forward="piecewise4", backward="piecewise4"),
    "8-bit fwd + piecewise4 bwd": Setup(forward="blockwise8", backward="piecewise4"),
    "8-bit fwd + piecewise3 bwd": Setup(forward="blockwise8", backward="piecewise3"),
    "8-bit fwd + lowrank8 bwd (LEP)": Setup(forward="blockwise8", backward="lowrank8"),
    "8-bit fwd + lowrank8 bwd, no LEP": Setup(forward="blockwise8", backward="lowrank8-noef"),
    "8-bit fwd + lowrank16 bwd (LEP)": Setup(forward="blockwise8", backward="lowrank16"),
    "8-bit fwd + lowrank8 bwd, epilogue 25%": Setup(forward="blockwise8", backward="lowrank8", epilogue=0.25),
    "8-bit fwd + lowrank8 bwd, 2 peers/stage": Setup(forward="blockwise8", backward="lowrank8", peers=2),
    "8-bit fwd + top-k 50% + piecewise4 bwd": Setup(forward="blockwise8", backward="topk50+piecewise4"),
    "bottleneck 2x + 8-bit": Setup(forward="blockwise8", backward="blockwise8", boundary="bottleneck"),
    "bottleneck 4x + 8-bit": Setup(forward="blockwise8", backward="blockwise8", boundary="bottleneck", factor=4),
    "maxout 2x + 8-bit": Setup(forward="blockwise8", backward="blockwise8", boundary="maxout"),
    "maxout 4x + 8-bit": Setup(forward="blockwise8", backward="blockwise8", boundary="maxout", factor=4),
    "maxout 2x + 8-bit fwd + piecewise4 bwd": Setup(forward="blockwise8", backward="piecewise4", boundary="maxout"),
    "maxout 4x + piecewise4 both ways": Setup(forward="piecewise4", backward="piecewise4", boundary="maxout", factor=4),
}
QUICK = ("fp32 (none)", "blockwise8 (today)", "8-bit fwd + piecewise4 bwd", "8-bit fwd + lowrank8 bwd (LEP)")


def corpus(name: str) -> torch.Tensor:
    if name == "builtin":
        return load_corpus(None)
    if name == "prose":
        from pydoc_data.topics import topics

        return torch.frombuffer(bytearray("\n\n".join(topics.values()).encode()), dtype=torch.uint8)
    raise ValueError(f"--data: builtin or prose, got {name!r}")


class Wire:
    """Payload bytes sent in each direction."""

    def __init__(self) -> None:
        self.sent = {"forward": 0, "backward": 0}

    def send(self, direction: str, t: torch.Tensor, codec: str, ctx: CodecContext | None = None) -> torch.Tensor:
        enc = encode_tensor("x", t, get_codec(codec), ctx)
        self.sent[direction] += len(enc.payload)
        return decode_tensor(enc, CPU)


ERROR_CODECS = ("blockwise8", "piecewise4", "piecewise3", "lowrank8", "lowrank16", "lowrank32", "topk50+none")


def compression_errors(stages: list[Stage], data: torch.Tensor, seq_len: int) -> dict[str, list[float]]:
    """codec -> relative L2 error (||decoded - g|| / ||g||) on the grad_inputs of stages 1.. (no error carried), for
    one microbatch: how much of a real activation gradient each codec keeps."""
    tokens, labels = windows(data, MICROBATCH, seq_len, torch.Generator().manual_seed(7))
    acts = [tokens]
    for stage in stages[:-1]:
        acts.append(stage_forward(stage, acts[-1]))
    grads = [stage_backward(stages[-1], acts[-1], labels=labels).grad_inputs]
    for i in range(len(stages) - 2, 0, -1):
        grads.append(stage_backward(stages[i], acts[i], grad_outputs=grads[-1]).grad_inputs)
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    out = {}
    for name in ERROR_CODECS:
        decoded = [decode_tensor(encode_tensor("g", g, get_codec(name)), CPU) for g in grads if g is not None]
        out[name] = [float((d - g).norm() / g.norm()) for d, g in zip(decoded, grads, strict=True) if g is not None]
    return out


def train(cfg, setup: Setup, data, heldout, steps: int, seed: int = 0) -> tuple[float, Wire, list[Stage]]:
    """Held-out loss after `steps` steps; `seed` picks the data order (the model initialises from its config)."""
    torch.manual_seed(seed)
    stages = [Stage(cfg, i) for i in range(cfg.n_stages)]
    params = [p for s in stages for p in s.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    memories = [[ErrorMemory() for _ in range(setup.peers)] for _ in stages]  # one per sender of each stage
    wire, gen = Wire(), torch.Generator().manual_seed(1 + seed)
    per_step = GLOBAL_BATCH // MICROBATCH
    compressed_from = per_step - max(1, round(setup.epilogue * per_step))
    for step in range(steps):
        optimizer.zero_grad()
        for mb in range(per_step):
            tokens, labels = windows(data, MICROBATCH, cfg.max_seq_len, gen)
            acts = [tokens]
            for stage in stages[:-1]:
                acts.append(wire.send("forward", stage_forward(stage, acts[-1]), setup.forward))
            backward = setup.backward if mb >= compressed_from else "blockwise8"
            result = stage_backward(stages[-1], acts[-1], labels=labels, grad_weight=MICROBATCH / GLOBAL_BATCH)
            grad = result.grad_inputs
            for i in range(cfg.n_stages - 1, 0, -1):
                memory = memories[i][(step * per_step + mb) % setup.peers]
                ctx = CodecContext(TensorRole.ACTIVATION_GRADIENTS, "grad_inputs", memory, batch=step)
                assert grad is not None
                grad = wire.send("backward", grad, backward, ctx)
                result = stage_backward(
                    stages[i - 1], acts[i - 1], grad_outputs=grad, grad_weight=MICROBATCH / GLOBAL_BATCH
                )
                grad = result.grad_inputs
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
    with torch.no_grad():
        h = heldout[0]
        for stage in stages[:-1]:
            h = stage(h)
        return stages[-1].loss(h, heldout[1]).item(), wire, stages


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 100; --quick 20)")
    p.add_argument(
        "--data", default=None, help="corpora, comma-separated: builtin, prose (default both; --quick builtin)"
    )
    p.add_argument("--only", default=None, help="run the configurations whose name matches this regex")
    p.add_argument("--seed", type=int, default=0, help="data order (run-to-run spread: compare seeds)")
    args = p.parse_args(argv)
    common.exit_on_sigterm()
    torch.set_num_threads(1)
    steps = args.steps or (20 if args.quick else 100)
    names = list(QUICK if args.quick else SETUPS)
    if args.only:
        names = [n for n in SETUPS if re.search(args.only, n)]
    corpora = (args.data or ("builtin" if args.quick else "builtin,prose")).split(",")
    base = model_config("local_debug")  # the model swarm-local trains: d_model 128, 3 stages of 2 shared layers
    results: list[dict] = []
    errors: dict[tuple[str, str], dict[str, list[float]]] = {}
    for data_name in corpora:
        text = corpus(data_name)
        cut = int(len(text) * 0.9)
        data = text[:cut]
        heldout = windows(text[cut:], 256, base.max_seq_len, torch.Generator().manual_seed(123))
        for name in names:
            setup = SETUPS[name]
            cfg = dataclasses.replace(base, boundary=setup.boundary, boundary_factor=setup.factor)
            started = time.monotonic()
            loss, wire, trained = train(cfg, setup, data, heldout, steps, args.seed)
            if setup == Setup():
                for when, stages in (("initial", [Stage(cfg, i) for i in range(cfg.n_stages)]), ("trained", trained)):
                    errors[(data_name, when)] = compression_errors(stages, data, cfg.max_seq_len)
            seconds = time.monotonic() - started
            common.log(f"{data_name} / {name}: held-out loss {loss:.4f} after {steps} steps ({seconds:.0f}s)")
            results.append({"data": data_name, "config": name, "heldout": loss, "seconds": seconds, "sent": wire.sent})
    rows = []
    for r in results:  # against fp32 at d_model: what the uncompressed model sends, boundary layers or not
        ref = next((x for x in results if x["data"] == r["data"] and x["config"] == "fp32 (none)"), None)
        if ref is None:
            continue
        ratio = {d: ref["sent"][d] / max(r["sent"][d], 1) for d in ("forward", "backward")}
        ratio["both"] = sum(ref["sent"].values()) / max(sum(r["sent"].values()), 1)
        r["fp32_over_sent"] = ratio
        r["vs_fp32"] = r["heldout"] / ref["heldout"]
        rows.append(
            [r["data"], r["config"], f"{r['heldout']:.4f}", f"{r['vs_fp32']:.3f}"]
            + [f"{ratio[d]:.1f}x" for d in ("forward", "backward", "both")]
        )
    common.table(
        f"Pipeline compression in one process: held-out loss after {steps} steps of {GLOBAL_BATCH} "
        f"(d_model {base.d_model}); bytes against fp32 at d_model",
        ["corpus", "configuration", "held-out loss", "vs fp32", "fwd fp32/sent", "bwd fp32/sent", "both"],
        rows,
    )
    if errors:
        common.table(
            "Relative L2 error of each codec on one microbatch's activation gradients (grad_inputs of the last stage, "
            "then of the middle ones), at initialisation and after the fp32 run",
            ["corpus", "model", *ERROR_CODECS],
            [
                [d, when] + ["/".join(f"{e:.3f}" for e in errs[c]) for c in ERROR_CODECS]
                for (d, when), errs in errors.items()
            ],
        )
    common.write_json(
        args.out,
        "backprop",
        {
            "hardware": common.hardware(),
            "steps": steps,
            "seed": args.seed,
            "results": results,
            "compression_errors": {f"{d} {when}": errs for (d, when), errs in errors.items()},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
