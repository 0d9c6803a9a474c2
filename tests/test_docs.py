"""The docs: the site builds strictly, the README's links land, the API index covers every
package, and every `domino ...` command line shown in a fenced code block of README.md or docs/
parses with the real argument parser."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}  # fenced blocks that hold command lines
SEPARATORS = {"&&", "||", ";", "|"}
RUNS_DOMINO = re.compile(r"(^|[\s;&|])domino(\s|$)|\sdomino\.cli(\s|$)")
MIN_COMMANDS = 20  # the docs show far more; fewer means the extraction broke


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def fenced_blocks(text: str):
    """Yield (line number of the block's first line, info string, lines) of each fenced code
    block; an indented fence (inside a list item) has its indentation removed from its lines."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).lower()
        body, start = [], i + 2
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i].lstrip())
            i += 1
        i += 1
        yield start, info, body


def logical_lines(body: list[str], first: int):
    """Join backslash-continued lines; yield (line number, text)."""
    buf, at = "", first
    for n, line in enumerate(body, first):
        if not buf:
            at = n
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        yield at, buf + line
        buf = ""
    if buf:
        yield at, buf


def domino_argv(tokens: list[str]) -> list[str] | None:
    """The arguments after `domino` (or after `-m domino.cli`, e.g. under torchrun) in one
    simple command, or None when it does not run domino. `...` stands for more flags."""
    while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):  # VAR=value prefixes
        tokens = tokens[1:]
    if not tokens:
        return None
    if tokens[0] == "domino":
        rest = tokens[1:]
    elif "domino.cli" in tokens:
        rest = tokens[tokens.index("domino.cli") + 1:]
    else:
        return None
    return [t for t in rest if t != "..."]


def extract_commands(text: str, name: str) -> list[tuple[str, list[str]]]:
    """Every domino command line in ``text``'s shell code blocks: (where, argv)."""
    found = []
    for first, info, body in fenced_blocks(text):
        if info not in SHELL_LANGS:
            continue
        for lineno, line in logical_lines(body, first):
            line = re.sub(r"^\s*\$\s+", "", line)  # a shell prompt
            if not RUNS_DOMINO.search(line):  # output or prose: cannot be a domino command
                continue
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError as err:  # unbalanced quotes: a broken example, not a skip
                found.append((f"{name}:{lineno}: {line.strip()}", ["<unparsable>", str(err)]))
                continue
            segment: list[str] = []
            for tok in [*tokens, "&&"]:
                if tok not in SEPARATORS:
                    segment.append(tok)
                    continue
                argv = domino_argv(segment)
                if argv is not None:
                    found.append((f"{name}:{lineno}: {line.strip()}", argv))
                segment = []
    return found


def all_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in doc_files():
        found += extract_commands(path.read_text(encoding="utf-8"),
                                  str(path.relative_to(ROOT)))
    return found


@pytest.fixture(scope="module")
def parser():
    from domino.cli import build_parser  # every subcommand's real parser (cli's registry)

    return build_parser()


def parse_error(parser, argv: list[str]) -> str | None:
    """None when ``argv`` parses (``--help`` included), else argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as exit_:
        return None if exit_.code == 0 else err.getvalue().strip() or f"exit {exit_.code}"
    return None


def test_extraction_handles_the_forms_the_docs_use():
    text = "\n".join([
        "```bash",
        "domino train --lr 3e-4        # a comment",
        "domino generate runs/X --prompt \"def \" \\",
        "    --top-p 0.9",
        "torchrun --nproc-per-node 8 -m domino.cli train --tensor-model-parallel-size 4 ...",
        "python3 -m venv .venv && pip install -e . && domino train",
        "python scripts/sp_memory.py",
        "```",
        "  ```bash",
        "  OMP_NUM_THREADS=1 domino bench --steps 2",
        "  ```",
        "```python",
        "domino = 1",
        "```",
    ])
    got = [argv for _, argv in extract_commands(text, "t.md")]
    assert got == [["train", "--lr", "3e-4"],
                   ["generate", "runs/X", "--prompt", "def ", "--top-p", "0.9"],
                   ["train", "--tensor-model-parallel-size", "4"],
                   ["train"],
                   ["bench", "--steps", "2"]]


def test_wrong_flags_are_rejected(parser):
    # The check below is only worth something if the parser refuses what it should.
    assert parse_error(parser, ["train", "--no-such-flag", "1"]) is not None
    assert parse_error(parser, ["train", "--hidden-size", "many"]) is not None
    assert parse_error(parser, ["no-such-command"]) is not None
    assert parse_error(parser, ["train", "--hidden-size", "64"]) is None


def test_every_documented_command_parses(parser):
    from domino.cli import SUBCOMMANDS

    commands = all_commands()
    assert len(commands) > MIN_COMMANDS, f"only {len(commands)} domino commands found"
    shown = {argv[0] for _, argv in commands if argv}
    assert set(SUBCOMMANDS) <= shown, f"no example of {sorted(set(SUBCOMMANDS) - shown)}"
    failures = []
    for where, argv in commands:
        error = parse_error(parser, argv) if argv else "no subcommand"
        if error is not None:
            failures.append(f"{where}\n    -> {error.splitlines()[-1]}")
    assert not failures, "stale command lines in the docs:\n" + "\n".join(failures)


def test_readme_links_land():
    """README links point at files that exist (docs pages' anchors are checked against the
    built site by test_site_builds_strictly, which mkdocs validates for the pages themselves)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    missing = [t for t in targets if not re.match(r"^[a-z]+:", t)
               and not (ROOT / t.split("#")[0]).exists()]
    assert not missing, f"README links to missing files: {missing}"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (pip install -e '.[test]' brings it)")
def test_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    # The API pages rendered the modules (an import or parse failure leaves them empty).
    api = (site / "api" / "models" / "index.html").read_text(encoding="utf-8")
    assert "TransformerLanguageModel" in api and "get_language_model" in api
    # README anchors into docs pages exist in the built pages.
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    bad = []
    for page, anchor in re.findall(r"\]\(docs/([^)#\s]+)\.md#([^)\s]+)\)", text):
        html = site / ("" if page == "index" else page) / "index.html"
        if f'id="{anchor}"' not in html.read_text(encoding="utf-8"):
            bad.append(f"docs/{page}.md#{anchor}")
    assert not bad, f"README links to anchors that do not exist: {bad}"


def test_api_index_covers_every_package():
    """docs/api/index.md names every package of the library, and each page it links to exists
    and is in the site's navigation."""
    index = (ROOT / "docs" / "api" / "index.md").read_text(encoding="utf-8")
    inits = (ROOT / "src" / "domino").glob("*/__init__.py")
    packages = sorted(f"domino.{p.parent.name}" for p in inits)
    assert packages
    named = set(re.findall(r"`(domino(?:\.\w+)*)`", index))
    assert not set(packages) - named, f"api/index.md leaves out {sorted(set(packages) - named)}"
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = re.findall(r"\]\(([\w-]+\.md)\)", index)
    assert pages
    bad = [p for p in pages if not (ROOT / "docs" / "api" / p).is_file() or f"api/{p}" not in nav]
    assert not bad, f"api/index.md links pages that are missing or not in mkdocs.yml's nav: {bad}"
