"""Command lines generated from config dataclasses, so every default lives in exactly one place (the dataclass)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, TypeVar

from swarm.config import PRESETS, ModelConfig, model_config

T = TypeVar("T")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _nested_prefix(f: dataclasses.Field) -> str:
    """A field whose type is itself a config dataclass gets its own flags, prefixed: `--rebalance-period-s`."""
    return f.metadata.get("prefix", f.name + "_")


def add_config_args(
    parser: argparse.ArgumentParser, cls: type, suppress_defaults: bool = False, prefix: str = ""
) -> None:
    """One flag per field; help text from `field(metadata={"help": ...})`. `suppress_defaults`: flags not given are
    absent from the namespace (used for overrides on top of a preset)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False:
            continue
        typ: Any = hints[f.name]
        if dataclasses.is_dataclass(typ):
            add_config_args(parser, typing.cast(type, typ), suppress_defaults, prefix + _nested_prefix(f))
            continue
        default = argparse.SUPPRESS if suppress_defaults else _default(f)
        kwargs: dict[str, Any] = {"default": default, "help": f.metadata.get("help", "")}
        if typ is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(typ) in (list, tuple):
            kwargs.update(nargs="*", type=typing.get_args(typ)[0])
        elif typing.get_origin(typ) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            inner = [a for a in typing.get_args(typ) if a is not type(None)][0]
            kwargs["type"] = inner
        else:
            kwargs["type"] = typ
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if not suppress_defaults and kwargs["help"] is not None and default is not None:
            kwargs["help"] += f" (default: {default})"
        group.add_argument(_flag(prefix + f.name), dest=prefix + f.name, **kwargs)


def config_from_args(cls: type[T], args: argparse.Namespace, prefix: str = "") -> T:
    hints, values, kwargs = typing.get_type_hints(cls), vars(args), {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # cls is a config dataclass
        if not f.init or f.metadata.get("cli") is False:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = config_from_args(hints[f.name], args, prefix + _nested_prefix(f))
        elif prefix + f.name in values:
            kwargs[f.name] = values[prefix + f.name]
    return cls(**kwargs)


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def to_argv(cfg: Any, base: Any = None, changed_only: bool = True, prefix: str = "") -> list[str]:
    """The inverse of `config_from_args`: flags that parse back to `cfg`. Only those whose values differ from `base` (a
    config of the same class; default: the class defaults), unless `changed_only` is False. Used to start processes
    from config objects, so that no argv is written by hand."""
    hints, out = typing.get_type_hints(type(cfg)), []
    for f in dataclasses.fields(cfg):
        if not f.init or f.metadata.get("cli") is False:
            continue
        value, typ = getattr(cfg, f.name), hints[f.name]
        if dataclasses.is_dataclass(typ):
            sub_base = None if base is None else getattr(base, f.name)
            out += to_argv(value, sub_base, changed_only, prefix + _nested_prefix(f))
            continue
        if changed_only and value == (_default(f) if base is None else getattr(base, f.name)):
            continue
        flag = _flag(prefix + f.name)
        if typ is bool:
            out.append(flag if value else "--no-" + flag[2:])
        elif typing.get_origin(typ) in (list, tuple):
            out += [flag, *map(str, value)]
        elif value is None and (_default(f) if base is None else getattr(base, f.name)) is None:
            continue  # as in the base: there is no flag for None
        elif value is None:
            raise ValueError(f"{flag}: None has no command-line form (leave it at its default)")
        else:
            out += [flag, str(value)]
    return out


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", default="local_debug", choices=sorted(PRESETS), help="model preset (default: local_debug)"
    )
    add_config_args(parser, ModelConfig, suppress_defaults=True)


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig) if hasattr(args, f.name)}
    return model_config(args.preset, **overrides)
