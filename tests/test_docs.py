"""README.md and docs/*.md: every relative link resolves, and every `poet`/`poet-agent` command they show parses.

Links: a relative link must name an existing file (or directory) of the repository and, with a ``#anchor`` into a
Markdown file, a heading of that file (GitHub's slugs). Commands: a command line in a fenced code block (``poet ...``
or ``$ poet ...``) is parsed by the parser the CLI builds (``host.cli.main.build_parser``,
``device_agent.cli.build_parser``), as ``main`` does, cross-flag checks included. A line with placeholders (``...``,
``<NAME>``) or synopsis brackets (``[--json]``, ``(--a | --b)``, ``A|B``), and a command quoted inline in the text,
cannot be parsed as written: its subcommands and the names of its flags are checked instead.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
COMMAND = re.compile(r"^(?:\$\s+)?(poet(?:-agent)?)\s")
SYNOPSIS = re.compile(r"[\[\]()|{}]")
FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")


# ---------------------------------------------------------------------------------------- Markdown
def split_fences(text: str) -> tuple[list[str], list[list[str]]]:
    """(the lines outside fenced code blocks, each fenced block's lines)."""
    prose: list[str] = []
    blocks: list[list[str]] = []
    fence: str | None = None
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
                blocks.append([])
            else:
                prose.append(line)
        elif match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                and not line.strip()[len(match.group(1)):].strip():
            fence = None
            prose.append("")  # a paragraph break where the block was
        else:
            blocks[-1].append(line)
    return prose, blocks


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation but hyphens dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and underscores, as GitHub does
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    result = set()
    for line in prose:
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def links(path: Path) -> list[str]:
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    text = CODE_SPAN.sub(" ", "\n".join(prose))  # `[--json](x)` in code is not a link
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def link_errors(path: Path, root: Path = ROOT) -> list[str]:
    errors = []
    for target in links(path):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc:
            continue  # https:, mailto: ...: not checked here
        where = f"{path.relative_to(root)}: ({target})"
        if parts.path.startswith("/"):
            errors.append(f"{where}: an absolute path; link relative to the file")
            continue
        file = (path.parent / unquote(parts.path)).resolve() if parts.path else path
        if not file.exists():
            errors.append(f"{where}: no file {file.relative_to(root) if file.is_relative_to(root) else file}")
            continue
        if not file.is_relative_to(root):
            errors.append(f"{where}: outside the repository")
            continue
        if parts.fragment and file.suffix == ".md" and unquote(parts.fragment) not in anchors(file):
            errors.append(f"{where}: no heading #{parts.fragment} in {file.relative_to(root)} "
                          f"(it has: {', '.join(sorted(anchors(file)))})")
    return errors


# ---------------------------------------------------------------------------------------- commands
@dataclass(frozen=True)
class Command:
    where: str
    text: str
    exact: bool  # parse it as written; else check its subcommands and flag names only


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a `#` starting a word outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def block_commands(path: Path, root: Path = ROOT) -> list[Command]:
    """Every `poet`/`poet-agent` command line of the fenced blocks, continuations joined, comments dropped."""
    _, blocks = split_fences(path.read_text(encoding="utf-8"))
    commands = []
    for block in blocks:
        i = 0
        while i < len(block):
            line = _strip_comment(block[i].strip())
            i += 1
            if not COMMAND.match(line):
                continue
            joined = True
            while line.endswith("\\"):
                if i == len(block):
                    joined = False
                    break
                line = line[:-1].rstrip() + " " + _strip_comment(block[i].strip())
                i += 1
            # a synopsis wraps without a backslash: indented lines of further flags
            while i < len(block) and block[i][:1].isspace() and block[i].strip()[:1] in ("[", "-"):
                line += " " + _strip_comment(block[i].strip())
                i += 1
            if not joined:
                continue  # a continuation the block does not finish
            line = COMMAND.sub(r"\1 ", line, count=1)
            placeholder = "..." in line or "…" in line or "<" in line or ">" in line or SYNOPSIS.search(line)
            # `poet fleet list [--json]   |   poet fleet remove NAME`: alternatives on one line
            for part in re.split(r"\s\|\s+(?=poet(?:-agent)?\s)", line):
                commands.append(Command(str(path.relative_to(root)), part.strip(), exact=not placeholder))
    return commands


def inline_commands(path: Path, root: Path = ROOT) -> list[Command]:
    """Commands quoted in the text (`poet serve --no-refine`): checked by name only, they are often partial."""
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    found = []
    for match in CODE_SPAN.finditer("\n".join(prose)):
        code = " ".join(match.group(2).split())
        if COMMAND.match(code + " "):
            found.append(Command(f"{path.relative_to(root)} (inline)", code, exact=False))
    return found


def parsers() -> dict[str, argparse.ArgumentParser]:
    from device_agent.cli import build_parser as agent_parser
    from host.cli.main import build_parser as poet_parser

    return {"poet": poet_parser(), "poet-agent": agent_parser()}


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def parse_error(command: Command, parser: argparse.ArgumentParser) -> str | None:
    """None when the CLI would take the command: as written (and with its flags' full names, which argparse would
    also take abbreviated), or, for a command that is not exact, by the names of its subcommands and flags."""
    if command.exact:
        argv = shlex.split(command.text)[1:]
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                args = parser.parse_args(argv)
                check = getattr(args, "check", None)
                if check is not None:
                    check(args)  # host.cli.main.main's checks across flags
        except SystemExit as exit_:
            return f"exit {exit_.code}: {(stderr.getvalue().strip().splitlines() or [''])[-1]}"
    words = command.text.split()[1:]
    for word in words:
        sub = _subparsers(parser)
        if sub is None or word.startswith("-") or not re.fullmatch(r"[a-z][a-z0-9-]*", word):
            break
        if word not in sub.choices:
            return f"no subcommand {word!r} (choices: {', '.join(sub.choices)})"
        parser = sub.choices[word]
    unknown = [flag for flag in FLAG.findall(command.text) if flag not in parser._option_string_actions]
    return f"{parser.prog} has no {', '.join(unknown)}" if unknown else None


# ---------------------------------------------------------------------------------------- tests
def test_the_docs_exist():
    names = {path.relative_to(ROOT).as_posix() for path in DOCS}
    assert {"README.md", "docs/architecture.md", "docs/cli.md", "docs/fine-tuning.md", "docs/fleet.md",
            "docs/board-install.md", "docs/microcontrollers.md", "docs/flower.md", "docs/benchmarks.md"} <= names


@pytest.mark.parametrize(("heading", "slug"), [
    ("The coordinator's commands", "the-coordinators-commands"),
    ("Microcontrollers: Cortex-M firmware and the serial bridge",
     "microcontrollers-cortex-m-firmware-and-the-serial-bridge"),
    ("`poet solve` under a binding budget", "poet-solve-under-a-binding-budget"),
    ("How the solver is fast, and honest", "how-the-solver-is-fast-and-honest"),
    ("Flower: see [the site](https://flower.ai)", "flower-see-the-site"),
    ("snake_case and  two spaces", "snake_case-and--two-spaces"),
])
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_every_relative_link_resolves():
    errors = [error for path in DOCS for error in link_errors(path)]
    assert not errors, "\n".join(errors)
    assert sum(len(links(path)) for path in DOCS) >= 20  # the extraction found the links


def test_every_command_shown_parses(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # path flags are checked against what exists: not this checkout's files
    known = parsers()
    commands = [command for path in DOCS for command in block_commands(path) + inline_commands(path)]
    errors = []
    for command in commands:
        error = parse_error(command, known[command.text.split()[0]])
        if error:
            errors.append(f"{command.where}: {command.text}\n    {error}")
    assert not errors, "\n".join(errors)
    exact = [command for command in commands if command.exact]
    assert len(exact) >= 10 and any(c.text.startswith("poet-agent") for c in commands)  # extraction works


def test_the_checks_catch_breakage(tmp_path):
    """A broken anchor, a missing file and a misspelt flag are reported, by the same code the tests above run."""
    (tmp_path / "a.md").write_text("# A\n\n## Real heading\n")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md#real-heading) [bad anchor](a.md#no-such) [gone](missing.md)\n\n"
                   "```\n$ poet solve --model mlp --platform a72 --ram-budgett 50%   # misspelt\n"
                   "poet solve --model mlp --platform a72 --ram-budget 50%\n```\n")
    errors = link_errors(doc, root=tmp_path)
    commands = block_commands(doc, root=tmp_path)
    assert len(errors) == 2 and "#no-such" in errors[0] and "missing.md" in errors[1]
    poet = parsers()["poet"]
    assert [bool(parse_error(c, poet)) for c in commands] == [True, False]
    abbreviated = Command("x", "poet solve --model mlp --platform a72 --ram 50%", exact=True)
    assert poet.parse_args(abbreviated.text.split()[1:]).ram_budget  # argparse takes it...
    assert "--ram" in parse_error(abbreviated, poet)  # ...the docs must not
    assert parse_error(Command("x", "poet solve ... --ram-budgett 50%", exact=False), poet)
    assert parse_error(Command("x", "poet slove --json", exact=False), poet)
