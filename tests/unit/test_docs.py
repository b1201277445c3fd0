"""The docs do not lie: README.md, deploy/README.md and docs/**/*.md name only commands, flags and files that exist.

What counts as a command line, the rule these tests enforce (in every page but the generated docs/reference/, which
the parsers print; a reference page is checked against its parser instead):
- every line of a fenced code block whose info string is `sh`, `bash`, `shell` or `console` (in `console` blocks
  only the lines that start with a `$ ` prompt; the lines without one are output);
- every inline code span whose first word, after any `NAME=value` environment prefixes, is `swarm-<letters>`,
  `python -m ...` or `pytest` (a span such as `--stage auto`, with no command, is not checked).
A line ending in `\\` continues on the next. `# comment` (at a line's start or after a space) is dropped, `$(...)` is
one value, `&&`, `||`, `;`, `|` and `&` separate commands, and a redirection (`> file`, `2>&1`) is no argument.
Then, for each simple command:
- `swarm-...` must be a console script of pyproject.toml, and every `--flag` (or `--flag=value`) an option string of
  the parser that script runs (`build_parser()`), exactly, with as many values as the flag takes; a value that is
  concrete (lowercase, no placeholder) must be one the flag accepts (its type and choices; `a|b` lists
  alternatives). `...` stands for anything elided, anywhere; an UPPERCASE word, `<...>` or `$VAR` is a placeholder;
- `python -m MODULE` must name an importable module, and if MODULE has a `build_parser()` (the tools) its flags are
  checked as above;
- `pytest` (or `python -m pytest`) must be given paths that exist.
Every relative link (`[text](path)`, `![alt](path)`, `[label]: path`) must point at a file or folder that exists, and a
`#fragment` at a heading of the Markdown file it names (GitHub's anchors). Every `swarm_server_*`/`swarm_trainer_*`
metric must be one server/metrics.py or trainer/metrics.py exports, and every `docker-compose*.yml` a file of
deploy/. Each checker is also shown failing, on a temporary copy of the README with a mistake put in (the `*_is_caught`
tests).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from tools import docs_reference

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # wherever this file lives
README = ROOT / "README.md"
SCRIPTS = docs_reference.console_scripts()  # name -> module
DOCS = sorted([README, ROOT / "deploy" / "README.md", *(ROOT / "docs").rglob("*.md")])
REFERENCE = {ROOT / "docs" / "reference" / page for page in ("README.md", *(f"{name}.md" for name in SCRIPTS))}
WRITTEN = [doc for doc in DOCS if doc not in REFERENCE]  # by hand: the reference pages are the parsers, printed

SHELL_BLOCKS = {"sh", "bash", "shell", "console"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")"}
SUBSTITUTION = re.compile(r"\$\([^()]*\)")
REDIRECT = re.compile(r"\d*(>>?|<)&?(\S*)")
ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*")
NUMBER = re.compile(r"-\d+(\.\d+)?")
CONCRETE = re.compile(r"[a-z0-9_.:/,+-]+")  # a value written out, not a placeholder (FILE, N, <x>, $VAR, ...)
PYTHON = re.compile(r"(.*/)?python[0-9.]*")
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


@functools.cache
def parser_of(module: str) -> argparse.ArgumentParser | None:
    """`module.build_parser()`, or None if it has none."""
    build = getattr(importlib.import_module(module), "build_parser", None)
    return build() if build is not None else None


def split_markdown(text: str) -> tuple[list[tuple[str, list[str]]], str]:
    """([(info string, lines) of every fenced block], the text outside the blocks)."""
    blocks: list[tuple[str, list[str]]] = []
    prose: list[str] = []
    lines = iter(text.splitlines())
    for line in lines:
        opening = FENCE.match(line)
        if opening is None:
            prose.append(line)
            continue
        indent, fence, info = opening.groups()
        body = []
        for inner in lines:
            if inner.strip().startswith(fence[0] * len(fence)) and not inner.strip().strip(fence[0]):
                break
            body.append(inner[len(indent) :] if inner.startswith(indent) else inner.lstrip())
        blocks.append((info.lower(), body))
        prose.append("")
    return blocks, "\n".join(prose)


def block_commands(info: str, lines: list[str]) -> list[str]:
    """The command lines of a fenced shell block, continuations joined."""
    out, current = [], ""
    for line in lines:
        if info == "console" and not current:
            if not line.lstrip().startswith("$ "):
                continue
            line = line.lstrip()[2:]
        current += line
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        out.append(current)
        current = ""
    return out + ([current] if current else [])


def span_commands(prose: str) -> list[str]:
    """The inline code spans that are command lines (see the module's docstring)."""
    out = []
    for _, content in SPAN.findall(prose):
        line = " ".join(content.split())
        first = next((w for w in line.split() if not ENV.fullmatch(w)), "")
        if re.fullmatch(r"swarm-[a-z]+", first) or first == "pytest" or re.match(r"python[0-9.]* -m ", line):
            out.append(line)
    return out


def simple_commands(line: str) -> list[list[str]]:
    """Words of each simple command of a shell line (comments, substitutions and redirections handled)."""
    line = re.sub(r"(^|\s)#.*", "", line)
    line = SUBSTITUTION.sub("SUBSTITUTION", line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        words = list(lexer)
    except ValueError as e:  # an unclosed quote
        return [[f"<unparsable: {e}>"]]
    commands: list[list[str]] = [[]]
    skip = False
    for word in words:
        if word in SEPARATORS:
            commands.append([])
        elif skip:
            skip = False
        elif (redirect := REDIRECT.fullmatch(word)) is not None:
            skip = not redirect[2]
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


def check_flags(name: str, parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """What is wrong with `args` for `parser` (see the module's docstring); [] if nothing."""
    problems = []
    positional = any(not a.option_strings for a in parser._actions)
    options = sorted(parser._option_string_actions)
    i = 0
    while i < len(args):
        word = args[i]
        i += 1
        if word in ("...", "--"):
            continue
        if not word.startswith("-") or word == "-" or NUMBER.fullmatch(word):
            if not positional:
                problems.append(f"{name}: unexpected argument {word!r} (it takes no positional arguments)")
            continue
        flag, has_value, value = word.partition("=")
        action = parser._option_string_actions.get(flag)
        if action is None:
            close = difflib.get_close_matches(flag, options, n=1)
            problems.append(f"{name}: no flag {flag}" + (f" (did you mean {close[0]}?)" if close else ""))
            while i < len(args) and not args[i].startswith("--"):  # its values, whatever it takes
                i += 1
            continue
        values = [value] if has_value else []
        if has_value and action.nargs == 0:
            problems.append(f"{name}: {flag} takes no value, got {value!r}")
        elif not has_value:
            most = _values_taken(action.nargs, len(args))
            while len(values) < most and i < len(args) and (args[i] == "..." or not _is_flag(args[i])):
                values.append(args[i])
                i += 1
            if action.nargs in (None, "+") and not values:
                problems.append(f"{name}: {flag} needs a value")
        problems += [f"{name}: {flag} {v!r}: {why}" for v in values if (why := _refused(action, v)) is not None]
    return problems


def _values_taken(nargs: int | str | None, most: int) -> int:
    """How many of the words after a flag are its values, at most."""
    if isinstance(nargs, int):
        return nargs
    return most if nargs in ("*", "+") else 1


def _is_flag(word: str) -> bool:
    return word.startswith("-") and word != "-" and not NUMBER.fullmatch(word)


def _refused(action: argparse.Action, value: str) -> str | None:
    """Why `action` refuses `value` written out in the docs, or None (a placeholder is never refused)."""
    for alternative in value.split("|"):
        if alternative == "..." or not CONCRETE.fullmatch(alternative):
            continue
        try:
            converted = action.type(alternative) if callable(action.type) else alternative
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            return f"not a valid {getattr(action.type, '__name__', 'value')}"
        if action.choices is not None and converted not in action.choices:
            return f"not one of {list(action.choices)}"
    return None


def check_command(words: list[str]) -> list[str]:
    """What is wrong with one simple command, as the module's docstring says; [] if nothing (or not ours)."""
    while words and (ENV.fullmatch(words[0]) or words[0] in ("sudo", "exec", "nohup", "time")):
        words = words[1:]
    if not words:
        return []
    command, args = words[0], words[1:]
    if re.fullmatch(r"swarm-[a-z]+", command):
        if command not in SCRIPTS:
            close = difflib.get_close_matches(command, SCRIPTS, n=1)
            return [f"{command} is no console script" + (f" (did you mean {close[0]}?)" if close else "")]
        parser = parser_of(SCRIPTS[command])
        assert parser is not None, f"{SCRIPTS[command]} has no build_parser()"
        return check_flags(command, parser, args)
    if command == "pytest":
        return _check_pytest(args)
    if PYTHON.fullmatch(command) and "-m" in args[:-1]:
        module, rest = args[args.index("-m") + 1], args[args.index("-m") + 2 :]
        if module == "pytest":
            return _check_pytest(rest)
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return [f"python -m {module}: no such module"]
        ours = module.startswith("tools.") or module in SCRIPTS.values()
        parser = parser_of(module) if ours else None
        return [] if parser is None else check_flags(f"python -m {module}", parser, rest)
    return []


def _check_pytest(args: list[str]) -> list[str]:
    paths = [a.split("::")[0] for a in args if not a.startswith("-") and ("/" in a or a.endswith(".py"))]
    return [f"pytest {p}: no such file or folder" for p in paths if not (ROOT / p).exists()]


def command_problems(text: str) -> list[str]:
    """Every problem of every command line in a Markdown text."""
    blocks, prose = split_markdown(text)
    lines = [line for info, body in blocks if info in SHELL_BLOCKS for line in block_commands(info, body)]
    lines += span_commands(prose)
    return [
        f"{p}   [in: {line.strip()[:120]}]" for line in lines for c in simple_commands(line) for p in check_command(c)
    ]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped (but - and _), spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in split_markdown(text)[1].splitlines():
        if (heading := HEADING.match(line)) is not None:
            base = slug(heading[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_problems(text: str, base: Path) -> list[str]:
    """Every relative link of a Markdown text (its file in folder `base`) that points nowhere."""
    prose = SPAN.sub("", split_markdown(text)[1])  # links in code are not links
    problems = []
    for target in LINK.findall(prose) + REFERENCE_LINK.findall(prose):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        where = (base / path).resolve() if path else None
        if where is not None and not where.exists():
            problems.append(f"link to {target}: no such file or folder")
        elif fragment:
            doc = text if where is None else where.read_text() if where.suffix == ".md" else None
            if doc is not None and fragment not in anchors(doc):
                problems.append(f"link to {target}: no heading with anchor #{fragment}")
    return problems


METRIC = re.compile(r"\bswarm_(?:server|trainer)_[a-z0-9_]*[a-z0-9]")
COMPOSE_FILE = re.compile(r"\bdocker-compose[\w.-]*\.ya?ml\b")


@functools.cache
def exported_metrics() -> frozenset[str]:
    """The metric names the server and the trainer export, read from the `Families` calls in their metrics modules:
    `f.gauge(NAME, ...)` is `swarm_NAME`, `f.counter(NAME, ...)` `swarm_NAME_total` (Prometheus adds the suffix),
    `f.traffic(NAME, ...)` `swarm_NAME_bytes_total` (swarm/metrics.py)."""
    suffix = {"gauge": "", "counter": "_total", "traffic": "_bytes_total"}
    names = set()
    for module in ("server/metrics.py", "trainer/metrics.py"):
        for node in ast.walk(ast.parse((ROOT / module).read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in suffix
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(f"swarm_{node.args[0].value}{suffix[node.func.attr]}")
    return frozenset(names)


def metric_problems(text: str) -> list[str]:
    """Metric names in `text` that neither the server nor the trainer exports."""
    problems = []
    for name in sorted(set(METRIC.findall(text)) - exported_metrics()):
        near = difflib.get_close_matches(name, exported_metrics(), n=1)
        problems.append(f"metric {name}: not exported" + (f" (did you mean {near[0]}?)" if near else ""))
    return problems


def compose_file_problems(text: str) -> list[str]:
    """Compose files named in `text` that deploy/ does not hold."""
    return [
        f"{name}: no such file in deploy/"
        for name in sorted(set(COMPOSE_FILE.findall(text)))
        if not (ROOT / "deploy" / name).is_file()
    ]


def test_the_reference_pages_are_generated_from_the_current_parsers():
    stale = docs_reference.stale(docs_reference.REFERENCE, docs_reference.pages())
    assert not stale, f"stale pages in docs/reference: {stale}; run python -m tools.docs_reference"


def test_a_stale_reference_page_is_caught(tmp_path, capsys):
    expected = docs_reference.pages()
    docs_reference.write(tmp_path, expected)
    assert docs_reference.stale(tmp_path, expected) == []
    page = tmp_path / "swarm-server.md"
    page.write_text(page.read_text().replace("`--lr LR` | `0.002`", "`--lr LR` | `0.001`"))
    (tmp_path / "swarm-trainer.md").unlink()
    (tmp_path / "swarm-old.md").write_text("# a command that is gone\n")
    assert docs_reference.stale(tmp_path, expected) == ["swarm-server.md", "swarm-trainer.md", "swarm-old.md"]
    with pytest.raises(SystemExit) as exit_:
        docs_reference.main(["--check", "--out", str(tmp_path)])
    assert exit_.value.code == 1
    assert "swarm-server.md, swarm-trainer.md, swarm-old.md" in capsys.readouterr().err


def test_every_console_script_has_a_reference_page_with_every_flag():
    expected = docs_reference.pages()
    assert set(expected) == {f"{name}.md" for name in SCRIPTS} | {docs_reference.INDEX}
    for name, module in SCRIPTS.items():
        parser = parser_of(module)
        assert parser is not None, f"{module} has no build_parser()"
        for action in parser._actions:
            if action.dest != "help":
                assert f"| `{action.option_strings[0]}" in expected[f"{name}.md"], (name, action.option_strings)


@pytest.mark.parametrize("doc", WRITTEN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_line_names_a_real_command_and_its_real_flags(doc):
    assert command_problems(doc.read_text()) == []


def test_the_docs_hold_command_lines_to_check():
    """The checker finds what it is meant to check (a regex that matched nothing would pass every doc)."""
    text = README.read_text()
    blocks, prose = split_markdown(text)
    assert any(info == "sh" and any("swarm-local" in line for line in body) for info, body in blocks)
    assert any(line.startswith("swarm-") for line in span_commands(prose))


def test_a_wrong_command_line_in_a_copy_of_the_readme_is_caught(tmp_path):
    copy = tmp_path / "README.md"
    copy.write_text(README.read_text())
    assert command_problems(copy.read_text()) == []
    with copy.open("a") as f:
        f.write(
            "\n```sh\nswarm-server --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW... \\\n"
            "    --stage auto --samples-per-stepp 1024   # a misspelt flag\n"
            "SWARM_DEBUG=1 swarm-trainer --codec blockwise9 && swarm-sever --stage 1\n```\n"
            "Start with `swarm-local --duration 0 --no-such-flag` or `python -m tools.nothing_here`;"
            " `swarm-dht --public yes` and `swarm-local --max-steps many`.\n"
        )
    problems = "\n".join(command_problems(copy.read_text()))
    for wrong in (
        "swarm-server: no flag --samples-per-stepp (did you mean --samples-per-step?)",
        "swarm-trainer: --codec 'blockwise9': not one of",
        "swarm-sever is no console script (did you mean swarm-server?)",
        "swarm-local: no flag --no-such-flag",
        "python -m tools.nothing_here: no such module",
        "swarm-dht: unexpected argument 'yes'",
        "swarm-local: --max-steps 'many': not a valid int",
    ):
        assert wrong in problems, f"{wrong!r} not found in:\n{problems}"
    assert len(problems.splitlines()) == 7, problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_something_that_exists(doc):
    assert link_problems(doc.read_text(), doc.parent) == []


def test_a_broken_link_in_a_copy_of_the_readme_is_caught(tmp_path):
    copy = tmp_path / "README.md"
    copy.write_text(README.read_text())
    assert link_problems(copy.read_text(), README.parent) == []
    with copy.open("a") as f:
        f.write(
            "\nSee [the protocol](docs/no-such-page.md), [its headers](docs/protocol.md#no-such-heading), "
            "[here](#nor-here) and ![a picture](docs/missing.png); [a site](https://example.org/x.md) is not "
            "checked, nor `[code](nowhere.md)`.\n\n[ref]: deploy/nothing.yml\n"
        )
    problems = link_problems(copy.read_text(), README.parent)
    assert problems == [
        "link to docs/no-such-page.md: no such file or folder",
        "link to docs/protocol.md#no-such-heading: no heading with anchor #no-such-heading",
        "link to #nor-here: no heading with anchor #nor-here",
        "link to docs/missing.png: no such file or folder",
        "link to deploy/nothing.yml: no such file or folder",
    ]


def test_github_anchors():
    text = "# SWARM\n## A real swarm, across machines\n## `--stage auto`\n## Tied embeddings\n## Tied embeddings\n"
    expected = {"swarm", "a-real-swarm-across-machines", "--stage-auto", "tied-embeddings", "tied-embeddings-1"}
    assert anchors(text) == expected


@pytest.mark.parametrize("doc", WRITTEN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_metric_and_compose_file_a_page_names_exists(doc):
    text = doc.read_text()
    assert metric_problems(text) + compose_file_problems(text) == []


def test_metric_names_come_from_the_code_and_a_wrong_one_or_a_missing_compose_file_is_caught():
    assert {"swarm_server_state", "swarm_server_moves_total", "swarm_server_pipeline_bytes_total"} <= exported_metrics()
    assert {"swarm_trainer_loss", "swarm_trainer_retries_total"} <= exported_metrics()
    text = README.read_text() + (
        '\nAlert on `swarm_trainer_lost_microbatches` and `swarm_server_requests_rejected_total{role="x"}`; run '
        "`docker compose -f deploy/docker-compose.yml -f deploy/docker-compose.gpu.yml up`.\n"
    )
    assert metric_problems(text) + compose_file_problems(text) == [
        "metric swarm_trainer_lost_microbatches: not exported (did you mean swarm_trainer_lost_microbatches_total?)",
        "docker-compose.gpu.yml: no such file in deploy/",
    ]
