"""Static checks of deploy/: the compose file, the Dockerfile and the console scripts they run agree with each other.

Fast and offline: nothing is built or started. `docker compose config` is run only where a compose binary exists.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

from server.config import ServerConfig
from swarm.cli import config_from_args, model_from_args
from trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"

SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]  # name -> "module:main"
# What the container's shell substitutes before the console script parses its flags
PLACEHOLDERS = {"$(cat /shared/dht.maddr)": "/ip4/10.0.0.2/tcp/31337/p2p/12D3KooWPlaceholder", "$(hostname)": "c0ffee"}
SHELL_SEPARATORS = {";", "&&", "||", "|", "&"}


def load_compose(path: Path = COMPOSE) -> dict:
    return yaml.safe_load(path.read_text())  # safe_load resolves the `<<: *anchor` merge keys


def services(path: Path = COMPOSE) -> dict[str, dict]:
    return load_compose(path)["services"]


def shell_script(service: dict) -> str:
    """The command as one shell string, with compose's `$$` escapes turned into the `$` the container sees."""
    command = service["command"]
    argv = shlex.split(command) if isinstance(command, str) else [str(arg) for arg in command]
    script = argv[2] if argv[:2] == ["sh", "-c"] else shlex.join(argv)
    return script.replace("$$", "$")


def shell_tokens(script: str) -> list[str]:
    """Words and operators of a simple shell script; an unquoted `$(cmd args)` is kept as one word."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    raw, tokens, i = list(lexer), [], 0
    while i < len(raw):
        if raw[i] == "$" and raw[i + 1 : i + 2] == ["("]:
            end = raw.index(")", i)
            tokens.append("$(" + " ".join(raw[i + 2 : end]) + ")")
            i = end + 1
        else:
            tokens.append(raw[i])
            i += 1
    return tokens


def invocation(service: dict) -> tuple[str, dict[str, list[str]]]:
    """(console script, {flag: values}) of the one console script a service runs."""
    tokens = shell_tokens(shell_script(service))
    starts = [i for i, token in enumerate(tokens) if token in SCRIPTS]
    assert len(starts) == 1, f"expected exactly one of {sorted(SCRIPTS)} in {tokens}"
    args: dict[str, list[str]] = {}
    flag = None
    for token in tokens[starts[0] + 1 :]:
        if token in SHELL_SEPARATORS:
            break
        if token.startswith("--"):
            flag = token
            args.setdefault(flag, [])
        else:
            assert flag is not None, f"positional argument {token!r} in {tokens}"
            args[flag].append(token)
    return tokens[starts[0]], args


def resolve(value: str, service: dict) -> str:
    """A `$VAR` / `${VAR}` argument, looked up in the service's environment."""
    match = re.fullmatch(r"\$\{?(\w+)\}?", value)
    if not match:
        return value
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    assert match[1] in env, f"{value} is not set in the service's environment"
    return str(env[match[1]])


def real_parser(script: str) -> argparse.ArgumentParser:
    """The parser the console script itself builds (each main module has `build_parser`)."""
    module = importlib.import_module(SCRIPTS[script].split(":")[0])
    return module.build_parser()


def parse_with_real_parser(service: dict) -> tuple[str, argparse.Namespace]:
    """Parse a service's command as its console script will, after the container's substitutions. Raises
    AssertionError naming the service's flags if the parser refuses them (argparse exits on an unknown flag)."""
    script, args = invocation(service)
    argv = []
    for flag, values in args.items():
        argv += [flag, *(PLACEHOLDERS.get(v, resolve(v, service)) for v in values)]
    parser = real_parser(script)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return script, parser.parse_args(argv)
    except SystemExit:
        raise AssertionError(f"{script} refuses {shlex.join(argv)}: {errors.getvalue().strip()}") from None


def check_compose(path: Path) -> None:
    """Every service's console script accepts its flags, and the configs they make are valid."""
    configs = {"swarm-server": ServerConfig, "swarm-trainer": TrainerConfig}
    for name, svc in services(path).items():
        script, args = parse_with_real_parser(svc)
        if script in configs:
            try:
                config_from_args(configs[script], args)
                model_from_args(args)
            except ValueError as e:
                raise AssertionError(f"service {name}: {e}") from None


def by_script(script: str) -> dict[str, dict]:
    return {name: svc for name, svc in services().items() if invocation(svc)[0] == script}


def test_every_service_runs_a_declared_console_script():
    for name, svc in services().items():
        script, _ = invocation(svc)
        assert script in SCRIPTS, f"service {name} runs {script}, not in [project.scripts]"


def test_compose_commands_parse_with_the_real_parsers():
    check_compose(COMPOSE)
    for name, svc in services().items():
        _, args = invocation(svc)
        assert all(values for values in args.values()), f"service {name}: a flag without a value in {args}"


def test_a_wrong_flag_in_the_compose_file_is_caught(tmp_path):
    """The check reads the real parsers: a flag that no parser takes, or a value a config refuses, fails it."""
    text = COMPOSE.read_text()
    for wrong, needle in (("--no-such-flag 1", "--no-such-flag"), ("--samples-per-step 0", "--samples-per-step")):
        broken = tmp_path / "docker-compose.yml"
        broken.write_text(text.replace("--device auto", f"--device auto {wrong}", 1))
        assert broken.read_text() != text
        with pytest.raises(AssertionError, match=needle):
            check_compose(broken)


def test_dollars_are_escaped_for_the_container_shell():
    # A single `$` is substituted by compose from the host's environment (usually to ""), silently.
    for name, svc in services().items():
        command = svc["command"]
        text = command if isinstance(command, str) else " ".join(map(str, command))
        assert "$" not in text.replace("$$", ""), f"service {name}: unescaped `$` in its command"


def test_servers_cover_every_stage_with_a_spare():
    servers = by_script("swarm-server")
    n_stages = {int(args["--n-stages"][0]) for _, args in map(invocation, services().values()) if "--n-stages" in args}
    assert len(n_stages) == 1, f"servers and trainers disagree on --n-stages: {n_stages}"
    (n_stages,) = n_stages
    replicas = dict.fromkeys(range(n_stages), 0)
    for name, svc in servers.items():
        stage = int(resolve(invocation(svc)[1]["--stage"][0], svc))
        assert stage in replicas, f"service {name} serves stage {stage}, outside 0..{n_stages - 1}"
        replicas[stage] += int((svc.get("deploy") or {}).get("replicas", 1))
    # SWARM's point: every stage survives the loss of one peer.
    assert all(count >= 2 for count in replicas.values()), f"servers per stage: {replicas}"
    assert len(by_script("swarm-trainer")) >= 1


def test_servers_announce_their_container_and_have_a_grpc_healthcheck():
    for name, svc in by_script("swarm-server").items():
        _, args = invocation(svc)
        # With replicas there is no fixed container name: the hostname (container id) is what the network resolves.
        assert args["--announce-host"] == ["$(hostname)"], f"service {name}"
        probe = " ".join(map(str, svc["healthcheck"]["test"]))
        assert "grpc_health.v1" in probe and f":{args['--port'][0]}'" in probe, f"service {name}: {probe}"


def test_peers_bootstrap_from_the_file_the_dht_writes():
    (dht_name, dht), *others = by_script("swarm-dht").items()
    assert not others, "exactly one bootstrap node"
    dht_args = invocation(dht)[1]
    (maddr_file,) = dht_args["--maddr-file"]
    (identity,) = dht_args["--identity-path"]
    shared_dir, identity_dir = str(Path(maddr_file).parent), str(Path(identity).parent)
    dht_mounts = {target: source for source, target, *_ in (v.split(":") for v in dht["volumes"])}
    assert identity_dir in dht_mounts, "the DHT key must live in a volume, else its peer id changes on every start"
    assert dht["healthcheck"]["test"], "others wait on the dht being healthy"
    for name, svc in services().items():
        args = invocation(svc)[1]
        if name == dht_name or "--initial-peers" not in args:
            continue
        assert args["--initial-peers"] == [f"$(cat {maddr_file})"], f"service {name}"
        mounts = {target: source for source, target, *_ in (v.split(":") for v in svc["volumes"])}
        assert mounts.get(shared_dir) == dht_mounts[shared_dir], f"service {name} does not see the dht's {shared_dir}"
        assert svc["depends_on"][dht_name]["condition"] == "service_healthy", f"service {name}"
        assert f"[ -s {maddr_file} ]" in shell_script(svc), f"service {name} must wait for the address file"


def dockerignore_patterns() -> list[str]:
    path = ROOT / ".dockerignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line.strip().lstrip("/") for line in lines if line.strip() and not line.startswith(("#", "!"))]


def is_ignored(relpath: str, patterns: list[str]) -> bool:
    return any(fnmatch(relpath, p) or fnmatch(relpath, p.removeprefix("**/")) for p in patterns)


def test_dockerfile_copies_files_that_exist_and_are_in_the_context():
    patterns = dockerignore_patterns()
    instructions = [line.split() for line in DOCKERFILE.read_text().splitlines() if line.strip()]
    copies = [words[1:] for words in instructions if words[0].upper() in {"COPY", "ADD"}]
    assert copies
    for words in copies:
        sources = [w for w in words if not w.startswith("--")][:-1]  # the last word is the destination
        for source in sources:
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
            assert source == "." or not is_ignored(source, patterns), f"{source} is excluded by .dockerignore"
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for package in ["pyproject.toml", *(p.rstrip("*") for p in packages["include"])]:
        assert not is_ignored(package, patterns), f"{package} is excluded by .dockerignore, `pip install .` needs it"


def test_dockerfile_runs_unprivileged_from_a_slim_python():
    text = DOCKERFILE.read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in text
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.MULTILINE)
    assert users and users[-1] not in {"root", "0"}


def test_compose_builds_from_the_repo_root_with_this_dockerfile():
    for name, svc in services().items():
        build = svc["build"]
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == ROOT, f"service {name}: build context {context}"
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE
