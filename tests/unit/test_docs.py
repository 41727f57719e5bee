"""The README and the docs pages against the code: every `swarmloco` command and option they
write exists, every repository path they name and every relative link resolves, and the
README's own-model script runs as written."""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarmloco.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGE_IDS = [str(page.relative_to(ROOT)) for page in PAGES]

FENCED = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
# An inline code span may wrap onto the next line of its paragraph, never across a blank line.
INLINE = re.compile(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`")
# `swarmloco SUB` or `python -m swarmloco.cli SUB`; `create/join` names two at once.
COMMAND = re.compile(r"(?<![\w.-])swarmloco(?:\.cli)?[ \t]+([a-z][a-z-]*(?:/[a-z][a-z-]*)*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)")
# Where a command's own words end: a comment, or the next command of a shell line.
COMMAND_END = re.compile(r"(?:^|\s)#|\|\||&&|[|;]")
REPO_PATH = re.compile(r"(?<![\w./~-])((?:scripts|src|docs|examples|tests|docker)/[\w.*/-]*[\w*/])")
# Modules named from the package root, as the docs' tables of pieces name them.
PACKAGE_PATH = re.compile(
    r"(?<![\w./~-])((?:core|net|runtime|train|dashboard|integrations)/[\w.*/-]*[\w*/])"
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def long_options(parser: argparse.ArgumentParser) -> set[str]:
    """The long options of ``parser``, and of its own subcommands (`data prepare`'s are
    counted as `data`'s)."""
    options = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                options |= long_options(command)
    return options


def subcommand_options() -> dict[str, set[str]]:
    """Every subcommand of the CLI and the long options it accepts, from its own parser."""
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: long_options(command) for name, command in sub.choices.items()}


OPTIONS = subcommand_options()


def without_fences(text: str) -> str:
    return FENCED.sub("", text)


def code_lines(text: str) -> list[str]:
    """The lines of every fenced block (a trailing backslash joins the next) and every
    inline code span (as one line)."""
    lines: list[str] = []
    for block in FENCED.findall(text):
        lines.extend(block.replace("\\\n", " ").splitlines())
    lines.extend(span.replace("\n", " ") for span in INLINE.findall(without_fences(text)))
    return lines


def command_problems(text: str, options: dict[str, set[str]] = OPTIONS) -> list[str]:
    """`swarmloco SUB --flag ...` written in code where SUB is no subcommand, or --flag is
    no option of SUB."""
    problems = []
    for line in code_lines(text):
        matches = list(COMMAND.finditer(line))
        for i, match in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
            words = line[match.end() : end]
            stop = COMMAND_END.search(words)
            words = words[: stop.start()] if stop else words
            for sub in match.group(1).split("/"):
                if sub not in options:
                    problems.append(f"no subcommand `swarmloco {sub}` in: {line.strip()}")
                    continue
                for flag in FLAG.findall(words):
                    if flag not in options[sub]:
                        problems.append(f"`swarmloco {sub}` has no {flag}: {line.strip()}")
    return problems


def path_problems(text: str, root: Path = ROOT) -> list[str]:
    """Repository paths named anywhere (scripts/, src/, docs/, examples/, tests/, docker/)
    and package paths named in code (core/, net/, ...) that do not exist; a glob must match
    something."""
    named = [(p, root) for p in REPO_PATH.findall(text)]
    package = root / "src" / "swarmloco"
    named += [(p, package) for line in code_lines(text) for p in PACKAGE_PATH.findall(line)]
    missing = []
    for path, base in named:
        found = bool(glob.glob(str(base / path))) if "*" in path else (base / path).exists()
        if not found:
            missing.append(str((base / path).relative_to(root)))
    return missing


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings (lowercased, punctuation dropped, spaces
    to hyphens, a repeated one numbered)."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", without_fences(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def link_problems(page: Path, text: str) -> list[str]:
    """Relative links (and images) whose file, or whose anchor in a markdown file, is not
    there."""
    prose = INLINE.sub("", without_fences(text))
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{target}: no {file}")
        elif file.suffix == ".md" and anchor:
            anchors = heading_anchors(file.read_text(encoding="utf-8"))
            if anchor not in anchors:
                problems.append(f"{target}: no heading #{anchor} in {file.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_command_and_option_written_exists(page):
    assert command_problems(page.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_repository_path_named_exists(page):
    assert path_problems(page.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_relative_link_resolves(page):
    assert link_problems(page, page.read_text(encoding="utf-8")) == []


def test_the_readme_shows_every_subcommand_and_links_every_docs_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = {m.group(1) for line in code_lines(text) for m in COMMAND.finditer(line)}
    assert set(OPTIONS) <= shown, f"not in the README: {sorted(set(OPTIONS) - shown)}"
    linked = {target.partition("#")[0] for target in LINK.findall(without_fences(text))}
    pages = {str(page.relative_to(ROOT)) for page in PAGES[1:]}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_the_checks_find_what_is_wrong(tmp_path):
    page = tmp_path / "page.md"
    text = (
        "# A page\n\n"
        "```\nswarmloco join SWARM_ID --peer HOST:1 --no-such-flag   # --also-not-checked\n"
        "swarmloco teleport --peer HOST:1\n```\n\n"
        "Run `swarmloco create --private\n--nope` or `python -m swarmloco.cli status --json`;\n"
        "see `scripts/no_such_script.py`, `docs/*.nothing`, `core/outer.py`, `net/nowhere.py`,\n"
        "[here](#a-page), [there](#elsewhere), [a file](missing.md), [web](https://example.org).\n"
    )
    page.write_text(text)
    assert command_problems(text) == [
        "`swarmloco join` has no --no-such-flag: swarmloco join SWARM_ID --peer HOST:1 "
        "--no-such-flag   # --also-not-checked",
        "no subcommand `swarmloco teleport` in: swarmloco teleport --peer HOST:1",
        "`swarmloco create` has no --nope: swarmloco create --private --nope",
    ]
    assert path_problems(text) == [
        "scripts/no_such_script.py",
        "docs/*.nothing",
        "src/swarmloco/net/nowhere.py",
    ]
    assert [p.split(":")[0] for p in link_problems(page, text)] == ["#elsewhere", "missing.md"]


def readme_script() -> str:
    """The README's first python block: the own-model script."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert blocks, "the README has no ```python block"
    return blocks[0]


@pytest.mark.timeout(300)
def test_the_readmes_own_model_script_trains_a_swarm(tmp_path):
    script = readme_script()
    assert "swarmloco.create(" in script and "swarmloco.join(" in script
    (tmp_path / "train.py").write_text(script, encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^swarm [0-9a-f]{40}$", done.stdout, re.M), done.stdout
    finished = re.search(
        r"^done: round (\d+), global step (\d+), loss ([\d.]+)$", done.stdout, re.M
    )
    assert finished is not None, done.stdout
    assert int(finished.group(1)) >= 1, "the swarm applied no round"
    assert any((tmp_path / "peer0").rglob("*")), "the peer kept nothing in its data_dir"
