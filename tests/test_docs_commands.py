"""Every command line that README.md and docs/*.md show parses with today's options, so that the docs cannot drift
from cli.py and the benchmark scripts. Commands are read from the docs' code blocks (a trailing backslash continues a
line; a comment counts only when it is a whole `python ...`/`sparsify ...` command, else it is a fragment) and from
inline code spans; shell variables are expanded from the assignments the same doc makes, in its code lines or in
comments (`B=$LC,...`, `# SC=...`; ${VAR/pattern/replacement} too). Nothing runs: a `sparsify` command goes through
Click's make_context (the group's, then the sub-command's: options and their types, no command body), a benchmark
script's main() stops at its first parse_args. Prose abbreviates (`sparsify sample --with-data`), and code may elide
arguments (ARGS, ...): there a required option may be missing, but what is shown must parse."""
from __future__ import annotations

import argparse
import functools
import re
import shlex
import sys
from pathlib import Path

import click
import pytest

import cli
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}  # code blocks by language; others hold Python, JSON, file trees
ELIDED = {"...", "ARGS"}  # words that stand for arguments left out of a command
SHELL_KEYWORDS = {"do", "then", "else"}  # they precede a command within a line: `while true; do python ...`
# target_sparsity.py hands the arguments after `--` to each `sparsify convert` it runs
FORWARDS_TO_CONVERT = {"benchmarks/target_sparsity.py"}
SKIPPED = {"sparsify COMMAND --help": "COMMAND stands for each sub-command"}
ASSIGNMENT = re.compile(r"([A-Z_][A-Z0-9_]*)=(\S+)")
VARIABLE = re.compile(r"\$\{(\w+)(?:/([^/}]*)/([^}]*))?\}|\$(\w+)")
INLINE_CODE = re.compile(r"`((?:[^`\n]|\n(?!\s*\n))+)`")  # a span may wrap, but not across a blank line


def shell_commands(line: str) -> list[list[str]]:
    """The words of each command in a shell line that runs a `sparsify` command or a benchmark script."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)  # ; && || | apart, # starts a comment
    lexer.whitespace_split = True
    commands, words = [], []
    for word in [*lexer, ";"]:
        if word.strip(lexer.punctuation_chars):
            words.append(word)
            continue
        while words and words[0] in SHELL_KEYWORDS:
            words.pop(0)
        if words[:1] == ["sparsify"] or (words[:1] == ["python"] and len(words) > 1
                                         and re.fullmatch(r"benchmarks/[\w/]+\.py", words[1])):
            commands.append(words)
        words = []
    return commands


def code_lines(text: str):
    """(line number, logical line) of the shell code blocks, a line that ends in a backslash joined to the next (in
    a comment, to the next comment line)."""
    language, joined = None, None  # the open block's language ("" unnamed), None outside the blocks
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            language = line.strip("` ") if language is None else None
        elif language in SHELL_BLOCKS:
            if joined is None:
                start, joined = number, line.strip()
            else:
                joined += " " + (line.strip().lstrip("#") if joined.startswith("#") else line.strip())
            if joined.endswith("\\"):
                joined = joined[:-1]
            else:
                yield start, joined
                joined = None


def inline_spans(text: str):
    """(line number, text) of the inline code spans outside the code blocks."""
    in_block, prose = False, []
    for line in text.splitlines():  # code blocks blanked, so that the line numbers stay
        in_block ^= line.lstrip().startswith("```")
        prose.append("" if in_block or line.lstrip().startswith("```") else line)
    prose = "\n".join(prose)
    for span in INLINE_CODE.finditer(prose):
        yield prose.count("\n", 0, span.start()) + 1, " ".join(span[1].split())


def doc_commands(doc: Path):
    """A pytest param per command, (words, partial, the doc's variables), named doc:line."""
    text = doc.read_text()
    variables, found = {}, []
    for number, line in code_lines(text):
        body = line.lstrip("#").strip()
        if assignment := ASSIGNMENT.match(body):
            variables[assignment[1]] = assignment[2]
        if line.startswith("#") and not body.startswith(("python ", "sparsify ")):
            continue  # a fragment of a command, or prose
        found += [(number, words, False) for words in shell_commands(body)]
    for number, span in inline_spans(text):
        if span.startswith(("sparsify ", "python benchmarks/")):
            found += [(number, words, True) for words in shell_commands(span)]
    params = []
    for number, words, partial in found:
        skipped = SKIPPED.get(" ".join(words))
        params.append(pytest.param(words, partial, variables, id=f"{doc.relative_to(ROOT)}:{number}",
                                   marks=pytest.mark.skip(reason=skipped) if skipped else ()))
    return params


COMMANDS = [command for doc in DOCS for command in doc_commands(doc)]


def expand(word: str, variables: dict[str, str]) -> str:
    """`word` with $VAR, ${VAR} and ${VAR/pattern/replacement} (the first match, as bash) replaced."""
    def value(match):
        name = match[1] or match[4]
        if name not in variables:
            pytest.fail(f"${name}: no assignment in this doc")
        assigned = expand(variables[name], variables)
        return assigned if match[2] is None else assigned.replace(match[2], match[3], 1)

    return VARIABLE.sub(value, word)


def parse_sparsify(args: list[str], partial: bool, monkeypatch) -> None:
    problem = None
    try:
        group = cli.main.make_context("sparsify", list(args))
        name, command, rest = cli.main.resolve_command(group, list(args))
        if partial:  # else Click reports a missing option before an extra argument
            for param in command.params:
                monkeypatch.setattr(param, "required", False)
        command.make_context(name, rest, parent=group)
    except click.exceptions.Exit as exit:  # --help
        assert exit.exit_code == 0
    except click.UsageError as error:
        problem = error.format_message()
    if problem:  # failed outside the handler, so that the report is the message alone
        pytest.fail(f"sparsify {' '.join(args)}\n{problem}", pytrace=False)


class Parsed(Exception):
    """Raised by a script's first parse_args once it has parsed: main() goes no further."""


@functools.cache
def script(path: str):
    return load_benchmark(path.removeprefix("benchmarks/"))


def parse_script(path: str, args: list[str], partial: bool, monkeypatch) -> None:
    parse_args = argparse.ArgumentParser.parse_args

    def parse_only(parser, *given):
        parser.allow_abbrev = False  # the docs write whole option names: a renamed option's prefix must not pass
        if partial:
            for action in parser._actions:  # else argparse reports a missing option, not an unknown one
                action.required = False
        raise Parsed(parse_args(parser, *given))

    def fail(parser, message):
        pytest.fail(f"python {path} {' '.join(args)}\n{message}", pytrace=False)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(argparse.ArgumentParser, "error", fail)
    monkeypatch.setattr(sys, "argv", [path, *args])
    with pytest.raises((Parsed, SystemExit)) as stopped:
        script(path).main()
    assert stopped.type is Parsed or stopped.value.code == 0  # --help exits 0


@pytest.mark.parametrize("words, partial, variables", COMMANDS)
def test_doc_command_parses(words, partial, variables, monkeypatch):
    words = [expand(word, variables).strip("[]") for word in words]  # [--json F]: a synopsis's optional part
    shown = [word for word in words if word not in ELIDED]
    partial = partial or len(shown) < len(words)
    if words[0] == "sparsify":
        parse_sparsify(shown[1:], partial, monkeypatch)
        return
    path, args = shown[1], shown[2:]
    if path in FORWARDS_TO_CONVERT and "--" in args:
        parse_sparsify(["convert", *args[args.index("--") + 1:]], True, monkeypatch)
    parse_script(path, args, partial, monkeypatch)
