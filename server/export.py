"""`swarm-export`: gather every stage's checkpoint into one safetensors file that loads into the single-process
`swarm.model.GPT` (keys `stages.{i}.{name}`), and check that it does."""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import load_file, save_file

from server.checkpoint import weights_path
from swarm.cli import add_config_file_arg, add_model_args, model_from_args, parse_args
from swarm.config import ModelConfig
from swarm.model import GPT


def export_model(cfg: ModelConfig, checkpoint_dirs: list[str], out: str | Path) -> GPT:
    """Each stage is taken from the first of `checkpoint_dirs` that has it. Raises FileNotFoundError naming the
    missing stages, and RuntimeError if the weights do not fit the model."""
    weights, missing = {}, []
    for i in range(cfg.n_stages):
        found = [weights_path(d, i) for d in checkpoint_dirs if weights_path(d, i).exists()]
        if not found:
            missing.append(i)
            continue
        weights.update({f"stages.{i}.{k}": v for k, v in load_file(str(found[0])).items()})
    if missing:
        raise FileNotFoundError(f"no checkpoint of stage(s) {missing} in {checkpoint_dirs}")
    if cfg.tie_embeddings:  # a one-stage model saves its one tied weight once, as the embedding
        weights.setdefault(f"stages.{cfg.n_stages - 1}.head.weight", weights["stages.0.embed.weight"].clone())
    model = GPT(cfg)
    model.load_state_dict(weights, strict=True)
    save_file(weights, str(out))
    return model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-export", description=__doc__.split("\n\n")[0])
    add_config_file_arg(parser)
    parser.add_argument("--checkpoint-dir", nargs="+", required=True, help="folders of the stages' --checkpoint-dir")
    parser.add_argument("--out", required=True, help="safetensors file to write")
    add_model_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parse_args(build_parser(), argv)
    model = export_model(model_from_args(args), args.checkpoint_dir, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {args.out}: {model.cfg.n_stages} stages, {n / 1e6:.2f}M parameters; load it with "
        f"GPT(cfg).load_state_dict(safetensors.torch.load_file(path))"
    )


if __name__ == "__main__":
    main()
