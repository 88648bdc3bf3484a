"""The docs stay true: the README opens with the two set-up commands, docs/config.md documents every config key
and every renamed one, every relative link and anchor resolves, every path the docs name exists,
docs/architecture.md's module map names every module, and every `phalanx ...` command in README.md and
docs/*.md validates: its config file exists, its overrides are today's keys with valid values, and its flags
parse (in-process, with the placeholder files — PATH/..., FILE, RUN — left alone)."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import pytest

from conftest import REPO

from phalanx.core.config import ConfigError, check_world, describe_markdown, load_config

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def readme() -> str:
    return (REPO / "README.md").read_text()


def test_readme_opens_with_the_two_setup_commands():
    block = re.search(r"```bash\n(.*?)```", readme(), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_config_table_is_generated_from_the_schema():
    text = (REPO / "docs" / "config.md").read_text()
    start = text.index("<!-- CONFIG-KEYS -->") + len("<!-- CONFIG-KEYS -->\n")
    end = text.index("<!-- /CONFIG-KEYS -->")
    assert text[start:end].strip() == "\n".join(describe_markdown()).strip(), \
        "docs/config.md's config table is stale: regenerate it with `make docs`"
    assert "<!-- CONFIG-KEYS -->" not in readme()  # one table, in one place


def test_the_renamed_keys_are_all_documented():
    from phalanx.core import renames

    text = (REPO / "docs" / "config.md").read_text()
    section = text[text.index("## Keys renamed in 0.2"):text.index("## Every key")]
    for old, new in renames.MOVED.items():
        assert f"| `{old}` | `{new}` |" in section, old
    for old, key in renames.BY_TASK.items():
        assert f"`{old}`" in section and f"`chat.{key}`" in section and f"`preference.{key}`" in section, old
    assert f"until {renames.UNTIL}" in section and f"until {renames.UNTIL}" in readme()


# ---- links --------------------------------------------------------------------------------------------------
def prose(text: str) -> str:
    """The text with fenced code blocks blanked (line numbers kept)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def anchors(path: Path) -> set[str]:
    """The heading anchors the forge makes (GitHub's rule: lower case, punctuation but - and _ dropped, spaces
    to hyphens, repeats numbered)."""
    seen: dict[str, int] = {}
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            if n:
                seen[f"{slug}-{n}"] = 1
    return set(seen)


def broken_links(paths) -> list[str]:
    return [w for path in paths for w in broken_links_in(path, path.read_text())]


def broken_links_in(path: Path, text: str) -> list[str]:
    """'FILE:LINE: TARGET: why' for each relative link of `text` (the page `path`) whose file or heading is missing."""
    wrong, text = [], prose(text)
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}"
        if not dest.exists():
            wrong.append(f"{where}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            wrong.append(f"{where}: {target}: no such heading")
    return wrong


def test_every_relative_link_and_anchor_resolves():
    assert not broken_links(DOCS), "\n".join(broken_links(DOCS))
    page = REPO / "docs" / "chat.md"  # control: a missing page and a missing heading are found
    assert anchors(page) >= {"runfinal", "a-gguf-file-as-the-base"}
    bad = REPO / "docs" / "x.md"
    assert [w.split(": ", 1)[1] for w in broken_links_in(bad, "[a](nope.md) [b](chat.md#no-such) [c](chat.md#lora)")] \
        == ["nope.md: no such file", "chat.md#no-such: no such heading"]


def test_every_path_the_docs_name_exists():
    named = {m for p in DOCS for m in re.findall(r"\b((?:tests|examples|bench|phalanx)/[\w./-]*\w)", p.read_text())}
    assert {"tests/test_docs.py", "examples/chat.yaml", "phalanx/core/renames.py"} <= named
    assert not sorted(n for n in named if not (REPO / n).exists())


def module_map() -> dict[str, set[str]]:
    """docs/architecture.md's module map: folder -> the modules it names (`phalanx/run/`, `  data/chat/`)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text[text.index("## Layers"):text.index("## data/ by concern")]
    start = block.index("```\n") + 4
    block = block[start:block.index("\n```", start)]
    named: dict[str, set[str]] = {}
    folder = ""
    for line in block.splitlines():
        head = re.match(r"(?:phalanx/|  )([\w/]+/)\s", line)
        if head:
            folder = "phalanx/" + head.group(1) if line.startswith("phalanx/") else "phalanx/" + head.group(1).strip()
        elif line.startswith("phalanx/cli.py"):
            folder = "phalanx/"
        named.setdefault(folder, set()).update(re.findall(r"\b(\w+)\.py\b", line))
    return named


def test_the_module_map_names_every_module():
    named = module_map()
    for folder in sorted({p.parent for p in (REPO / "phalanx").rglob("*.py")}):
        key = f"{folder.relative_to(REPO)}/"
        files = {p.stem for p in folder.glob("*.py")} - {"__init__", "__main__"}
        assert files == named.get(key, set()) - ({"__init__"} if key == "phalanx/" else set()), key


# ---- documented commands ------------------------------------------------------------------------------------
def parsers() -> dict[str, tuple[argparse.ArgumentParser, argparse.ArgumentParser]]:
    """Each subcommand's (CLI parser, sub-parser), its arguments added as `phalanx CMD` builds them."""
    from phalanx.cli import build_parser

    def sub(parser):
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    out = {}
    for name in sub(build_parser()):
        parser = build_parser(name)
        out[name] = (parser, sub(parser)[name])
    return out


def documented_commands(path: Path, commands) -> list[tuple[int, str]]:
    """(line, command) for every `phalanx CMD ...` in `path`: the lines of code blocks (continued lines joined,
    comments kept for shlex to drop) and the inline code spans that start with one (a span may wrap)."""
    start = re.compile(rf"phalanx (?:{'|'.join(commands)})\b")
    text, found, fenced, pending = path.read_text(), [], False, None
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            continue
        if pending:
            pending = (pending[0], pending[1] + " " + line.strip())
        elif start.match(line.strip()):
            pending = (number, line.strip())
        if pending and pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1])
        elif pending:
            found.append(pending)
            pending = None
    body = prose(text)
    for m in re.finditer(r"`([^`]+)`", body):
        span = " ".join(m.group(1).split()).replace("\\|", "|")
        if start.match(span):
            found.append((body[:m.start()].count("\n") + 1, span))
    return sorted(found)


PLACEHOLDER = re.compile(r"[A-Z]{2,}|^[A-Z]$")  # CONFIG, RUN, FILE, PATH/..., sweeps/NAME/best.yaml, N, K


def check_command(command: str, subs) -> str | None:
    """Why a documented `phalanx ...` command would not run, or None. A synopsis (`[--flag X]`, `...`) is
    checked for its flags only; a placeholder stands for a file (a config, a run) or a flag's number."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError as e:
        return f"does not split as a shell command: {e}"
    name = words[1]
    parser, sub = subs[name]
    options = {o: a for a in sub._actions for o in a.option_strings}
    if len(words) == 2:
        return None  # the command named
    if any("[" in w or w == "..." for w in words):  # a synopsis
        unknown = [w for w in (re.sub(r"[\[\]]", "", w) for w in words) if w.startswith("-") and w not in options]
        return f"unknown flag(s) {', '.join(unknown)}" if unknown else None
    argv = list(words[1:])
    for i, word in enumerate(argv[:-1]):  # a placeholder for a number: any number does
        action = options.get(word)
        if action is not None and action.type in (int, float) and PLACEHOLDER.search(argv[i + 1]):
            argv[i + 1] = "1"
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            args, rest = parser.parse_known_args(argv)
        except SystemExit:
            return f"flags do not parse: {err.getvalue().strip().splitlines()[-1]}"
    stray = [r for r in rest if r.startswith("-")]
    if stray or (rest and not hasattr(args, "items")):
        return f"unrecognized arguments: {' '.join(rest)}"
    if name == "sweep" and not PLACEHOLDER.search(args.sweep):
        from phalanx.tools.sweepspec import load_sweep

        here = os.getcwd()
        os.chdir(REPO)  # a sweep file's config is relative to the current folder or the sweep file
        try:
            load_sweep(REPO / args.sweep, parallel=args.parallel, trials=args.trials)
        except ConfigError as e:
            return str(e)
        finally:
            os.chdir(here)
    if not hasattr(args, "items"):
        return None
    items = list(args.items) + rest
    config = next((w for w in items if "=" not in w), None)
    overrides = [w for w in items if w != config]
    if getattr(args, "run_dir", None):
        overrides.append(f"run_dir={args.run_dir}")
    if config is not None and PLACEHOLDER.search(config):
        config = None  # a placeholder for the user's config: its overrides are still checked
    elif config is not None and not (REPO / config).is_file():
        return f"config file '{config}' not found"
    notes = []
    try:
        cfg = load_config(str(REPO / config) if config else None, overrides, check_paths=False, say=notes.append)
        nproc, nnodes = getattr(args, "nproc_per_node", "auto"), getattr(args, "nnodes", "1")
        placeholder_config = config is None and any("=" not in w for w in items)
        if str(nproc).isdigit() and str(nnodes).isdigit() and not placeholder_config:
            check_world(cfg, int(nproc) * int(nnodes))
    except ConfigError as e:
        return str(e)
    return f"uses renamed keys: {notes[0]}" if notes else None


def broken_commands(paths) -> list[str]:
    subs = parsers()
    wrong = []
    for path in paths:
        for line, command in documented_commands(path, subs):
            why = check_command(command, subs)
            if why:
                wrong.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line}: "
                             f"`{command}`: {why}")
    return wrong


def test_every_documented_command_validates():
    found = {p: documented_commands(p, parsers()) for p in DOCS}
    assert sum(map(len, found.values())) > 50  # the reader finds them: code blocks and spans, every page
    assert all(found[REPO / "docs" / f"{page}.md"] for page in ("lm", "classify", "chat", "preference", "training"))
    wrong = broken_commands(DOCS)
    assert not wrong, "documented commands that would not run:\n" + "\n".join(wrong)


def test_a_broken_command_is_found_with_its_file_and_line(tmp_path):
    doc = tmp_path / "broken.md"
    doc.write_text("A page.\n\n```bash\n"
                   "phalanx train examples/chat.yaml model.lora.r=16   # fine\n"
                   "phalanx train examples/chat.yaml chat.no_such_key=1\n"
                   "phalanx train examples/chat.yaml data.chat_format=messages\n"
                   "phalanx train examples/no-such.yaml\n"
                   "phalanx prepare examples/chat.yaml \\\n    --show three\n"
                   "phalanx train --nproc-per-node 3\n"
                   "phalanx sweep examples/sweep.yaml --parallel 0\n"
                   "```\n"
                   "Inline: `phalanx chat RUN --no-such-flag`, `phalanx train CONFIG train.lr=fast`, and\n"
                   "`phalanx sweep\n--parallel 2` (wrapped), `phalanx config [CONFIG] [--shown]`; fine:\n"
                   "`phalanx chat`, `phalanx report RUN`, `phalanx doctor CONFIG --nproc-per-node N`.\n")
    wrong = broken_commands([doc])
    where = [w.split(": `")[0] for w in wrong]
    assert where == [f"{doc}:{n}" for n in (5, 6, 7, 8, 10, 11, 13, 13, 14, 15)], "\n".join(wrong)
    assert "chat.no_such_key" in wrong[0] and "renamed" in wrong[1] and "chat.format" in wrong[1]
    assert "not found" in wrong[2] and "invalid int value: 'three'" in wrong[3]
    assert "not divisible" in wrong[4]  # the default global batch of 32 on 3 processes
    assert "sweep file" in wrong[5] and "--parallel" in wrong[5]  # the sweep file is loaded and checked
    assert "--no-such-flag" in wrong[6] and "train.lr" in wrong[7] and "SWEEP.yaml" in wrong[8]
    assert "--shown" in wrong[9]


@pytest.mark.parametrize("page", ["README.md", "docs/config.md", "docs/architecture.md"])
def test_the_generated_tables_are_where_the_tests_read_them(page):
    text = (REPO / page).read_text()
    markers = {"README.md": [], "docs/config.md": ["CONFIG-KEYS"], "docs/architecture.md": ["LAYERS", "DATA-PACKAGES"]}
    for marker in markers[page]:
        assert text.count(f"<!-- {marker} -->") == 1 and text.count(f"<!-- /{marker} -->") == 1
    if page == "README.md":
        assert "<!-- LAYERS -->" not in text and "<!-- CONFIG-KEYS -->" not in text
