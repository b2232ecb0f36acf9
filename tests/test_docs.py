"""The documentation's commands and links still work, so a reader who copies one is not misled.

The commands are read from README.md and docs/*.md themselves (shell blocks, and inline code that starts with a
command), so a renamed module, a dropped flag or a Makefile target gone stale fails here: every `make` target and
variable exists, every `wsgate` subcommand and flag is known to the CLI (a concrete command in a shell block also
parses), every `python -m` module imports and knows the flags it is shown with, every repository file a command
names exists, and every link and #anchor between the documents resolves. Nothing runs but `--help`; no network.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
# The commands checked (docker: only the files it names); the rest (curl, kubectl, openssl...) talk to what is
# running, or are not ours.
PROGRAMS = ("make", "pytest", "locust", "docker")
PYTHON = re.compile(r"^(?:\.venv/bin/)?python[\d.]*$")
WSGATE = re.compile(r"^(?:\.venv/bin/)?wsgate$")
# Paths a command names that the command itself or the demo makes: not in the repository.
GENERATED = ("certs/out/", "run/", "deploy/", "loadtest/out/", "/", "~")
FILE_SUFFIXES = (".py", ".wsdl", ".xsd", ".yaml", ".yml", ".toml", ".lua", ".xml", "Dockerfile")
OUTPUT_FLAGS = {"-o", "--out", ">"}
MAKE_OPTIONS = {"--jobs", "--directory", "--dry-run", "--keep-going", "--silent", "--always-make"}


@dataclass(frozen=True)
class Command:
    where: str  # file:line, for the message
    argv: tuple[str, ...]
    concrete: bool  # from a shell block (runnable as written), not a synopsis with placeholders


def without_fences(text: str) -> str:
    """Fenced blocks blanked, line numbers kept."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def without_code(text: str) -> str:
    """The prose: fenced blocks blanked, inline code removed."""
    return INLINE.sub("", without_fences(text))


def commands(name: str, text: str) -> Iterator[Command]:
    """Every command of a shell block (`sh`, `console`: `$ ` lines) and every inline code span that is one."""
    for block in FENCE.finditer(text):
        if block.group(1) not in ("sh", "console"):
            continue
        first = text.count("\n", 0, block.start(2)) + 1
        lines = block.group(2).split("\n")
        i = 0
        while i < len(lines):
            line, lineno = lines[i], first + i
            i += 1
            if block.group(1) == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            while line.endswith("\\") and i < len(lines):
                line, i = line[:-1] + " " + lines[i], i + 1
            heredoc = re.search(r"<<-?'?(\w+)'?", line)
            if heredoc:  # skip the document
                while i < len(lines) and lines[i].strip() != heredoc.group(1):
                    i += 1
                i += 1
            yield from _split(f"{name}:{lineno}", line, concrete=True)
    for lineno, line in enumerate(without_fences(text).split("\n"), 1):
        for span in INLINE.findall(line):
            # A synopsis: `[--seed N]` optional, `A\|B` alternatives (escaped in tables).
            if ": " in span:  # a message quoted (`wsgate client: HTTP 500: ...`), not a command
                continue
            span = span.replace("\\|", " ").replace("[", " ").replace("]", " ")
            yield from _split(f"{name}:{lineno}", span, concrete=False)


def _split(where: str, line: str, concrete: bool) -> Iterator[Command]:
    """The simple commands of a line (`a && b | c`), those whose program is one this test checks."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: prose, not a command
        return
    argv: list[str] = []
    for token in [*tokens, ";"]:
        if token and set(token) <= set("&|;()<>"):  # an operator or a redirection ends the command
            program = argv[0].removeprefix(".venv/bin/") if argv else ""
            if program in PROGRAMS or WSGATE.match(program) or (PYTHON.match(program) and argv[1:2] == ["-m"]):
                yield Command(where, tuple(argv), concrete)
            argv = []
        else:
            argv.append(token)


def copied_in(text: str) -> set[str]:
    """Files a document's own `cp FILE DIR/` lines make: later commands may name them."""
    made = set()
    for src, dst in re.findall(r"^cp (\S+) (\S+)$", text, flags=re.M):
        if (REPO / src).is_file():
            made.add(dst + Path(src).name if dst.endswith("/") else dst)
    return made


def problems_in(name: str, text: str) -> list[str]:
    found = []
    made = copied_in(text)
    for cmd in commands(name, text):
        problems = [
            p for p in check_command(cmd) if p.removeprefix("no file ").removesuffix(" in the repository") not in made
        ]
        found += [f"{cmd.where}: `{shlex.join(cmd.argv)}`: {p}" for p in problems]
    found += [f"{name}: {p}" for p in check_links(name, text)]
    return found


def check_command(cmd: Command) -> list[str]:
    program, args = cmd.argv[0], list(cmd.argv[1:])
    found = check_paths(args) if cmd.concrete else []
    if program == "make":
        return found + check_make(args)
    if WSGATE.match(program):
        return found + check_wsgate(args, cmd.concrete)
    if PYTHON.match(program):
        return found + (check_python_module(args[1], args[2:]) if len(args) > 1 else ["`-m` without a module"])
    return found


def check_paths(args: list[str]) -> list[str]:
    found = []
    for before, arg in zip(["", *args], args, strict=False):
        path = arg.split("=", 1)[-1]
        if before in OUTPUT_FLAGS or path.startswith(GENERATED) or not path.endswith(FILE_SUFFIXES):
            continue
        if "://" not in path and not (REPO / path).exists():
            found.append(f"no file {path} in the repository")
    return found


@functools.cache
def makefile() -> tuple[frozenset[str], str]:
    text = (REPO / "Makefile").read_text()
    targets = set()
    for line in text.split("\n"):
        rule = re.match(r"^([^\s:=#][^:=]*):(?!=)", line)
        if rule:
            targets.update(rule.group(1).split())
    return frozenset(targets), text


def check_make(args: list[str]) -> list[str]:
    targets, text = makefile()
    found = []
    for arg in args:
        if arg.startswith("--") and arg.split("=", 1)[0] not in MAKE_OPTIONS:
            found.append(f"make has no option {arg} (a target's options go in its variable, e.g. BENCH_ARGS)")
            continue
        if arg.startswith("-"):
            continue
        if "=" not in arg:
            if arg not in targets:
                found.append(f"no Makefile target {arg!r}")
            continue
        var, value = arg.split("=", 1)
        uses = [line for line in text.split("\n") if f"$({var})" in line]
        if not uses:
            found.append(f"the Makefile uses no variable {var}")
        # A variable that passes options to a module (BENCH_ARGS): the options must be that module's.
        for module in {m for line in uses for m in re.findall(r"-m\s+([\w.]+)", line)}:
            found += check_python_module(module, shlex.split(value))
    return found


@functools.cache
def wsgate_parser() -> argparse.ArgumentParser:
    """The parser of the `wsgate` entry point pyproject.toml names (wherever the CLI module lives)."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module = importlib.import_module(scripts["wsgate"].split(":")[0])
    return module.build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if re.match(r"^--?[A-Za-z]", a)]


def check_wsgate(args: list[str], concrete: bool) -> list[str]:
    parser, path = wsgate_parser(), []
    while args and subcommands(parser):
        choices = subcommands(parser)
        if args[0] not in choices:
            if args[0].startswith("-") and args[0] in parser._option_string_actions:
                break
            return [f"`wsgate {' '.join(path)}` has no subcommand {args[0]!r} (it has {', '.join(choices)})"]
        parser = choices[args[0]]
        path.append(args.pop(0))
    if parser.get_default("func") is None and path:
        # A subcommand whose own program parses the rest (wsgate filter, wsgate backend): ask it.
        shown = flags(args)
        known = help_flags(("wsgate", *path)) if shown else frozenset()
        return [f"`wsgate {' '.join(path)}` knows no {f}" for f in shown if f not in known]
    unknown = [f for f in flags(args) if f not in parser._option_string_actions]
    if unknown:
        return [f"`wsgate {' '.join(path)}` knows no {f}" for f in unknown]
    if concrete:
        try:
            wsgate_parser().parse_args([*path, *args])
        except SystemExit:
            return ["the CLI refuses it (see the usage message above)"]
    return []


@functools.cache
def help_flags(argv: tuple[str, ...]) -> frozenset[str]:
    """The options a program's `--help` lists (`wsgate SUB` or `python -m MOD`), in a fresh interpreter."""
    if argv[0] == "wsgate":
        scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
        module, func = scripts["wsgate"].split(":")
        run = [sys.executable, "-c", f"import sys; sys.argv[0] = 'wsgate'; from {module} import {func}; {func}()"]
        run += [*argv[1:], "--help"]
    else:
        run = [sys.executable, "-m", *argv, "--help"]
    out = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", out.stdout)) if out.returncode == 0 else frozenset()


def check_python_module(module: str, args: list[str]) -> list[str]:
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        return [f"no module {module}"]
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        if importlib.util.find_spec(f"{module}.__main__") is None:
            return [f"package {module} has no __main__"]
    else:
        importlib.import_module(module)
        if not re.search(r"__name__\s*==\s*[\"']__main__[\"']", Path(spec.origin or "").read_text()):
            return [f"module {module} does nothing under -m"]
    unknown = [f for f in flags(args) if f not in help_flags((module,))] if flags(args) else []
    return [f"`python -m {module}` knows no {f}" for f in unknown]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    found, count = set(), dict[str, int]()
    for match in HEADING.finditer(without_fences(path.read_text())):
        base = slug(match.group(2))
        n = count[base] = count.get(base, -1) + 1  # a repeated heading gets -1, -2...
        found.add(f"{base}-{n}" if n else base)
    return frozenset(found)


def check_links(name: str, text: str) -> list[str]:
    """Every relative link's file exists in the repository, and its #anchor is a heading there."""
    found = []
    for target in LINK.findall(without_code(text)):
        if re.match(r"^[a-z]+:", target):
            continue
        path_part, _, anchor = target.partition("#")
        path = (REPO / name).parent.joinpath(path_part).resolve() if path_part else REPO / name
        if not path.is_relative_to(REPO) or not path.exists():
            found.append(f"link to {target}: no such file")
        elif anchor and anchor not in anchors(path):
            found.append(f"link to {target}: {path.relative_to(REPO)} has no heading #{anchor}")
    return found


def test_every_command_and_link_in_the_docs_still_works() -> None:
    found = []
    for path in DOCS:
        found += problems_in(str(path.relative_to(REPO)), path.read_text())
    assert not found, "stale documentation:\n" + "\n".join(found)


def test_the_docs_show_the_commands_this_test_checks() -> None:
    """The extraction finds them: were a change to the format to hide them, the first test would pass on nothing."""
    shown = [c.argv for path in DOCS for c in commands(path.name, path.read_text())]
    programs = {a[0].removeprefix(".venv/bin/") for a in shown}
    assert {"make", "wsgate", "python", "pytest", "locust", "docker"} <= programs
    assert ("make", "run") in shown
    assert any(a[1:3] == ("certs", "revoke") for a in shown)
    assert any(a[1:3] == ("-m", "loadtest.large") and "--size-mb" in a for a in shown)


def test_every_document_in_docs_is_linked_from_the_readme() -> None:
    readme = (REPO / "README.md").read_text()
    linked = {(REPO / t.partition("#")[0]).resolve() for t in LINK.findall(without_code(readme))}
    assert [p for p in DOCS[1:] if p.resolve() not in linked] == []


def test_stale_commands_and_links_are_caught() -> None:
    """Each kind of staleness the docs could hold, in a document of its own, is reported."""
    stale = {
        "make nosuch": "no Makefile target 'nosuch'",
        "make bench --sizes small": "make has no option --sizes",
        "make bench NOSUCH_ARGS=1": "the Makefile uses no variable NOSUCH_ARGS",
        'make bench BENCH_ARGS="--nosuch 1"': "`python -m loadtest.bench` knows no --nosuch",
        ".venv/bin/wsgate nosuch": "has no subcommand 'nosuch'",
        ".venv/bin/wsgate up --nosuch": "`wsgate up` knows no --nosuch",
        "wsgate certs revoke": "the CLI refuses it",
        "wsgate render --target nosuch": "the CLI refuses it",
        "wsgate filter --nosuch": "`wsgate filter` knows no --nosuch",
        ".venv/bin/python -m filters.nosuch": "no module filters.nosuch",
        "python -m loadtest.large --nosuch": "`python -m loadtest.large` knows no --nosuch",
        ".venv/bin/pytest -q tests/test_nosuch.py": "no file tests/test_nosuch.py",
    }
    for line, expected in stale.items():
        found = problems_in("STALE.md", f"```sh\n{line}\n```\n")
        assert any(expected in p for p in found), (line, found)
    assert any("no Makefile target" in p for p in problems_in("STALE.md", "Run `make nosuch` first."))
    assert any("knows no --nosuch" in p for p in problems_in("STALE.md", "`wsgate up [--nosuch N]`"))
    links = "[a](docs/nosuch.md) [b](docs/policies.md#nosuch) [c](#set-up-two-commands) ![d](loadtest/sample/x.png)"
    found = check_links("README.md", links)
    assert len(found) == 3 and not any("set-up-two-commands" in p for p in found), found
    fine = "```sh\nmake run\nwsgate certs revoke demo-client --reason keyCompromise\n```\n"
    assert problems_in("FINE.md", fine) == []
