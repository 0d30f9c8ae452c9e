"""The commands quoted in the benchmark docs exist and accept their flags (issue 13).

Every `python bench/X.py ...`, `python -m <repo module> ...` and `tokenfleet ...` command in
bench/*.md and deploy/scenarios/README.md — in fenced or indented code blocks, and in inline
code spans — is parsed (continuation lines joined, `NAME="..."` assignments of the block
expanded, `&&`, `|`, `;`, redirections and comments cut), then:

* the script or module must exist;
* its argparse parser, captured in this process without running the command (the first
  `parse_known_args` call raises), must accept the quoted arguments;
* a script without argparse takes no `--flags` in the docs.

Nothing is executed beyond the scripts' imports and parser construction.
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "bench").glob("*.md")) + [ROOT / "deploy" / "scenarios" / "README.md"]
PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}
TOKENFLEETS = {"tokenfleet", ".venv/bin/tokenfleet"}
REPO_PACKAGES = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {"bench"}


@dataclass(frozen=True)
class Quoted:
    doc: str
    line: int
    kind: str  # "script" | "module" | "tokenfleet" | "shell"
    target: str  # path relative to the repo, module name, or "tokenfleet"
    args: tuple[str, ...]
    text: str
    full: bool = True  # a code block's command (complete); False: a mention in inline code

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _code_lines(text: str) -> list[tuple[int, list[str], bool]]:
    """(first line number, lines, is_block) of each code block and inline code span."""
    out: list[tuple[int, list[str], bool]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            start, block = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                block.append(lines[i])
                i += 1
            out.append((start + 1, block, True))
            i += 1
            continue
        if line.startswith("    ") and line.strip():
            start, block = i, []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                block.append(lines[i][4:])
                i += 1
            out.append((start + 1, block, True))
            continue
        for m in re.finditer(r"`([^`]+)`", line):
            out.append((i + 1, [m.group(1)], False))
        i += 1
    return out


def _commands(doc: Path) -> list[Quoted]:
    rel = str(doc.relative_to(ROOT))
    found: list[Quoted] = []
    for start, block, is_block in _code_lines(doc.read_text()):
        env: dict[str, str] = {}
        joined: list[tuple[int, str]] = []
        buf, buf_line = "", start
        for k, raw in enumerate(block):
            if not buf:
                buf_line = start + k
            if raw.rstrip().endswith("\\"):
                buf += raw.rstrip()[:-1] + " "
                continue
            joined.append((buf_line, buf + raw))
            buf = ""
        if buf:
            joined.append((buf_line, buf))
        for line_no, cmd in joined:
            m = re.match(r"\s*([A-Z_][A-Z0-9_]*)=(\"[^\"]*\"|'[^']*'|\S+)\s*$", cmd)
            if m:
                env[m.group(1)] = m.group(2).strip("\"'")
                continue
            cmd = re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda mm: env.get(mm.group(1), mm.group(0)), cmd)
            try:
                tokens = shlex.split(cmd, comments=True)
            except ValueError:
                continue  # not shell (prose in backticks)
            segment: list[str] = []
            for tok in tokens + ["&&"]:
                if tok in {"&&", "||", "|", ";", "&"}:
                    q = _classify(rel, line_no, segment, cmd.strip(), is_block)
                    if q is not None:
                        found.append(q)
                    segment = []
                else:
                    segment.append(tok)
    return found


def _classify(doc: str, line: int, seg: list[str], text: str, full: bool) -> Quoted | None:
    # cut redirections
    for k, tok in enumerate(seg):
        if re.fullmatch(r"\d?>>?|<|<<.*|\d?>&\d", tok) or re.match(r"\d?>", tok):
            seg = seg[:k]
            break
    if not seg:
        return None
    head, rest = seg[0], seg[1:]
    if head in PYTHONS and rest:
        if rest[0] == "-m" and len(rest) > 1:
            if rest[1].split(".")[0] not in REPO_PACKAGES:
                return None  # a stdlib or third-party module (e.g. cProfile): not ours to check
            return Quoted(doc, line, "module", rest[1], tuple(rest[2:]), text, full)
        if rest[0].endswith(".py"):
            return Quoted(doc, line, "script", rest[0], tuple(rest[1:]), text, full)
        return None
    if head in TOKENFLEETS:
        return Quoted(doc, line, "tokenfleet", "tokenfleet", tuple(rest), text, full)
    if head == "bash" and rest and rest[0].endswith(".sh"):
        return Quoted(doc, line, "shell", rest[0], tuple(rest[1:]), text, full)
    if re.fullmatch(r"(bench|deploy)/[\w./-]+\.py", head):
        return Quoted(doc, line, "script", head, tuple(rest), text, full)
    return None


ALL = [q for doc in DOCS for q in _commands(doc)]


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


_PARSERS: dict[str, argparse.ArgumentParser | None] = {}


def _capture(key: str, run) -> argparse.ArgumentParser | None:
    """Run `run()` until its first parse_known_args; return that parser (None: no argparse)."""
    if key in _PARSERS:
        return _PARSERS[key]
    real = argparse.ArgumentParser.parse_known_args

    def fake(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        raise _Captured(self)

    argparse.ArgumentParser.parse_known_args = fake  # type: ignore[method-assign]
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    parser = None
    try:
        with warnings.catch_warnings():  # runpy: "found in sys.modules after import of package"
            warnings.simplefilter("ignore", RuntimeWarning)
            run()
    except _Captured as c:
        parser = c.parser
    finally:
        argparse.ArgumentParser.parse_known_args = real  # type: ignore[method-assign]
        sys.argv[:], sys.path[:] = saved_argv, saved_path
    _PARSERS[key] = parser
    return parser


def _known_flags(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """For a mention (`tokenfleet simulate --policy tokenpilot`): every --flag is the parser's."""
    known = set(parser._option_string_actions)
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                if name in args:
                    known |= set(sub._option_string_actions)
    unknown = [f for f in (a.split("=", 1)[0] for a in args) if f.startswith("--") and f not in known]
    return f"unknown flags {unknown}" if unknown else None


def _accepts(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """None when `parser` parses `args`; else argparse's complaint."""
    errors: list[str] = []

    def error(message: str) -> None:  # argparse would print and exit(2)
        errors.append(message)
        raise SystemExit(2)

    parsers = [parser]
    for a in parser._actions:  # subcommand parsers report through their own .error
        if isinstance(a, argparse._SubParsersAction):
            parsers += list(a.choices.values())
    saved = [(p, p.error) for p in parsers]
    for p in parsers:
        p.error = error  # type: ignore[method-assign]
    try:
        parser.parse_args(args)
    except SystemExit:
        return errors[0] if errors else "exited"
    finally:
        for p, e in saved:
            p.error = e  # type: ignore[method-assign]
    return None


def test_docs_quote_commands() -> None:
    kinds = {q.kind for q in ALL}
    assert {"script", "tokenfleet"} <= kinds, kinds
    # the commands added for issue 13 are quoted where their figures are
    targets = {q.target for q in ALL}
    assert {"bench/decision_replay.py", "bench/profile_gateway.py"} <= targets


def test_checker_catches_a_wrong_flag() -> None:
    q = Quoted("x.md", 1, "script", "bench/soak.py", ("--requests", "5", "--no-such-flag"), "", True)
    with pytest.raises(AssertionError, match="no-such-flag"):
        test_quoted_command_exists_and_parses(q)
    q = Quoted("x.md", 1, "script", "bench/no_such_script.py", (), "", True)
    with pytest.raises(AssertionError, match="no such file"):
        test_quoted_command_exists_and_parses(q)
    q = Quoted("x.md", 1, "tokenfleet", "tokenfleet", ("simulate", "--polcy", "x"), "", False)
    with pytest.raises(AssertionError, match="polcy"):
        test_quoted_command_exists_and_parses(q)


@pytest.mark.parametrize("q", ALL, ids=lambda q: f"{q.doc}:{q.line}:{q.target}")
def test_quoted_command_exists_and_parses(q: Quoted) -> None:
    if q.kind in {"script", "shell"}:
        path = ROOT / q.target
        assert path.is_file(), f"{q}: no such file {q.target}"
        if q.kind == "shell":
            return
        src = path.read_text()
        if "argparse" not in src:
            flags = [a for a in q.args if a.startswith("--")]
            assert not flags, f"{q}: {q.target} has no argparse parser but is quoted with {flags}"
            return
        parser = _capture(q.target, lambda: (sys.argv.__setitem__(slice(None), [str(path), "--help"]),
                                             sys.path.insert(0, str(path.parent)),
                                             runpy.run_path(str(path), run_name="__main__")))
    elif q.kind == "module":
        parser = _capture(q.target, lambda: (sys.argv.__setitem__(slice(None), [q.target, "--help"]),
                                             runpy.run_module(q.target, run_name="__main__", alter_sys=False)))
    else:
        from tokenfleet.cli import build_parser

        sub = q.args[0] if q.args and not q.args[0].startswith("-") else None
        parser = build_parser(sub)
    assert parser is not None, f"{q}: {q.target} never built an argparse parser"
    full = q.full and not {"-h", "--help"} & set(q.args)  # `X --help` would print and exit
    problem = (_accepts if full else _known_flags)(parser, list(q.args))
    assert problem is None, f"{q}: {problem}"
