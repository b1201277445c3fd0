"""Command lines generated from config dataclasses, so every default lives in exactly one place (the dataclass).

Every command also reads its flags from a TOML file. A command's `build_parser` calls `add_config_file_arg(parser)`
and its `main` calls `parse_args(parser, argv)` instead of `parser.parse_args(argv)`:

    # swarm-server --config server.toml --lr 1e-3   (the command line overrides the file)
    stage = "auto"
    initial-peers = ["/ip4/10.0.0.1/tcp/31337/p2p/Qm..."]
    batch_size = 16          # either spelling: batch-size or batch_size
    delay-optimizer-step = true
    rebalance-period-s = 30  # a nested section's flags are flat, as on the command line

A key is a flag's name without its dashes; a value goes through the flag's own `type=` and `choices`, so the file
accepts exactly what the command line does. `config_values` and `write_config_file` write such a file from a config
dataclass (`swarm-local --write-config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import tomllib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import tomli_w

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


# Stage 0 admits each microbatch into a global batch when it serves the microbatch's Forward, and every later call
# carries that signed admission. A one-stage pipeline has no Forward (its one call is the last stage's Backward), so
# nothing would be admitted and every call refused: a swarm that never trains. Said at start instead.
ONE_STAGE = "stage 0 admits microbatches on their Forward, which a one-stage pipeline never calls"


def pipeline_model_from_args(args: argparse.Namespace) -> ModelConfig:
    """The model of a swarm's server or trainer (`model_from_args`): cut into 2 or more stages."""
    cfg = model_from_args(args)
    if cfg.n_stages < 2:
        raise ValueError(f"--n-stages must be >= 2 for a swarm, got {cfg.n_stages}: {ONE_STAGE}")
    return cfg


CONFIG_FLAG = "--config"


def add_config_file_arg(parser: argparse.ArgumentParser) -> None:
    """Adds `--config FILE` to `parser`; read it with `parse_args(parser, argv)`."""
    parser.add_argument(
        CONFIG_FLAG,
        metavar="FILE",
        help="TOML file of flag values, keyed by flag name without dashes (batch-size = 16); flags given on the "
        "command line override it. Relative paths in it are relative to the working directory, not to FILE",
    )


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, after the values of the `--config` file named in `argv`, if any: the file's values
    become flags placed before `argv`, so a flag on the command line overrides the file (the last occurrence wins),
    and a required flag may come from the file. `parser` must have `add_config_file_arg`'s flag.

    Exits through `parser.error` (status 2, a message naming the file) if the file is missing or not TOML, names a key
    that is no flag of `parser`, or holds a value the flag would refuse (its type, its choices, a list where the flag
    takes several values and only there, a boolean for an on/off flag and only there)."""
    if CONFIG_FLAG not in parser._option_string_actions:
        raise ValueError(f"{parser.prog}: call add_config_file_arg(parser) before parse_args")
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(prog=parser.prog, add_help=False, exit_on_error=False)
    pre.add_argument(CONFIG_FLAG)
    try:
        path = pre.parse_known_args(argv)[0].config
    except argparse.ArgumentError:  # `--config` without a file: the real parser says so
        path = None
    if path is None:
        return parser.parse_args(argv)
    return parser.parse_args([*config_file_argv(parser, path), *argv])


def config_file_argv(parser: argparse.ArgumentParser, path: str | Path) -> list[str]:
    """The flags of `parser` that TOML file `path` sets, checked as `parse_args` documents (`parser.error` if not)."""

    def fail(message: str) -> NoReturn:
        parser.error(f"{CONFIG_FLAG} {path}: {message}")

    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        fail(e.strerror or str(e))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        fail(f"not valid TOML: {e}")
    flags = _file_keys(parser)
    out: list[str] = []
    seen: dict[str, str] = {}
    for key, value in table.items():
        name = key.replace("_", "-")
        if name not in flags:
            close = difflib.get_close_matches(name, flags, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            fail(f"unknown key {key!r}: {parser.prog} has no flag --{name}{hint}")
        if name in seen:
            fail(f"{seen[name]!r} and {key!r} set the same flag")
        seen[name] = key
        out += _flag_tokens(*flags[name], key, value, fail)
    return out


def _file_keys(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.Action, str]]:
    """The keys a config file of `parser` may hold, with underscores as dashes, each with its action and flag: the
    long flags without their dashes, but not --no-X, --help nor --config itself."""
    keys = {}
    for action in parser._actions:
        if action.dest == "help" or CONFIG_FLAG in action.option_strings:
            continue
        negative = action.option_strings[1:] if isinstance(action, argparse.BooleanOptionalAction) else []
        for option in action.option_strings:
            if option.startswith("--") and option not in negative:
                keys[option[2:].replace("_", "-")] = (action, option)
    return keys


def _flag_tokens(
    action: argparse.Action, flag: str, key: str, value: Any, fail: typing.Callable[[str], NoReturn]
) -> list[str]:
    """The command-line tokens that set `value` through `action`, or `fail` naming the key and what is wrong."""
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            fail(f"{key} = {value!r}: must be true or false")
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:  # store_true / store_false: leaving the flag out gives the other value
        if not isinstance(value, bool) or not isinstance(action.const, bool):
            fail(f"{key} = {value!r}: must be true or false")
        return [flag] if value == action.const else []
    several = action.nargs in ("*", "+") or isinstance(action.nargs, int)
    if several != isinstance(value, list):
        fail(f"{key} = {value!r}: must be " + ("a list" if several else "a single value, not a list"))
    items = value if several else [value]
    if action.nargs == "+" and not items or isinstance(action.nargs, int) and len(items) != action.nargs:
        fail(f"{key} = {value!r}: must have " + ("at least 1" if action.nargs == "+" else str(action.nargs)) + " items")
    tokens = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            fail(f"{key} = {item!r}: must be {_type_name(action)}")
        token = str(item)
        try:
            converted = action.type(token) if callable(action.type) else token
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            fail(f"{key} = {item!r}: must be {_type_name(action)}")
        if action.choices is not None and converted not in action.choices:
            fail(f"{key} = {item!r}: must be one of {', '.join(map(repr, action.choices))}")
        tokens.append(token)
    return [flag, *tokens] if several else [f"{flag}={tokens[0]}"]  # `=`: a value may start with "-"


def _type_name(action: argparse.Action) -> str:
    name = getattr(action.type, "__name__", "str")
    return {"int": "an integer", "float": "a number", "str": "a string"}.get(name, f"a valid {name}")


def config_values(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Every flag of config dataclass `cfg` with its value, keyed as in a `--config` file (`batch-size`), nested
    sections flat: the inverse of `config_from_args` through a file, as `to_argv(cfg, changed_only=False)` is through
    argv. A None field is left out (TOML has no null), which parses back only where None is the default."""
    hints, out = typing.get_type_hints(type(cfg)), {}
    for f in dataclasses.fields(cfg):
        if not f.init or f.metadata.get("cli") is False:
            continue
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(config_values(value, prefix + _nested_prefix(f)))
        elif value is not None:
            out[_flag(prefix + f.name)[2:]] = list(value) if isinstance(value, tuple) else value
        elif _default(f) is not None:
            raise ValueError(f"{_flag(prefix + f.name)}: None has no config-file form (leave it at its default)")
    return out


def write_config_file(path: str | Path, values: Mapping[str, Any]) -> None:
    """Writes `values` (e.g. `config_values(cfg)`) as a TOML file that `--config` reads back."""
    Path(path).write_text(tomli_w.dumps(dict(values)))
