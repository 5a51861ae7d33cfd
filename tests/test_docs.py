"""The documentation as a reader follows it: every relative link and every file it names exists
(with its #anchor), and every `memd ...` command it shows is one the real CLI accepts (issue 14:
configuration.md pointed to a design.md that does not exist). Parsed by the CLI's own argparse
parser, in this process: nothing runs."""
import argparse
import contextlib
import io
import pathlib
import re
import shlex

import pytest

from memd import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
NAMED = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)\b(#[\w-]+)?")
PLACEHOLDERS = {"JOB": "some-job", "PID": "1234"}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: pathlib.Path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def prose(path: pathlib.Path) -> str:
    return re.sub(r"```.*?```", "", path.read_text(), flags=re.S)


def resolve(doc: pathlib.Path, target: str):
    for base in (doc.parent, ROOT):
        if (base / target).exists():
            return base / target
    return None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves_with_its_anchor(doc):
    broken = []
    for target in LINK.findall(prose(doc)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = doc if not path else (doc.parent / path)
        if not where.exists():
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(target)
    assert not broken, "%s: %s" % (doc.name, broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_document_named_in_the_text_exists(doc):
    missing = []
    for name, anchor in NAMED.findall(prose(doc)):
        found = resolve(doc, name)
        if found is None or (anchor and anchor[1:] not in anchors(found)):
            missing.append(name + anchor)
    assert not missing, "%s names %s" % (doc.name, missing)


def _commands():
    """(doc, line, argv) for each memd command shown in a code block: at the start of a line,
    after && or --, or as a path ending in /memd; comments, pipes and what follows dropped."""
    start = re.compile(r"(?:^\s*|&&\s*|--\s+|[\w./=-]*/)memd\s+(.*)$")
    for doc in DOCS:
        inside = False
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if line.strip().startswith("```"):
                inside = not inside
                continue
            found = start.search(line) if inside else None
            if found is None or not re.match(r"[a-z]", found.group(1)):
                continue
            rest = re.split(r"\s#\s|\s\|\s|&&|;", found.group(1))[0]
            yield "%s:%d" % (doc.name, number), [PLACEHOLDERS.get(t, t) for t in shlex.split(rest)]


COMMANDS = list(_commands())


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 8 and any(argv[:1] == ["keygen"] for _, argv in COMMANDS), COMMANDS


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_command_in_a_code_block_parses(where, argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = cli._parser().parse_args(argv)
        except SystemExit:
            pytest.fail("%s: memd %s: %s" % (where, " ".join(argv), err.getvalue().strip().splitlines()[-1]))
    assert args.command == argv[0]


def _subparsers(parser: argparse.ArgumentParser):
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _inline():
    for doc in DOCS:
        text = " ".join(prose(doc).split())
        for span in re.findall(r"`memd ([^`]+)`", text):
            yield doc.name, span.split()


@pytest.mark.parametrize("doc,words", list(_inline()), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_every_inline_command_names_real_subcommands_and_flags(doc, words):
    """An inline `memd ...` may be a synopsis (`memd forget JOB`, `memd status|top --endpoint E`):
    its commands and each of its --flags must exist, its values may be placeholders."""
    for command in words[0].split("|"):
        parser = _subparsers(cli._parser()).get(command)
        assert parser is not None, "%s: no command memd %s" % (doc, command)
        rest = words[1:]
        nested = _subparsers(parser)
        if nested and rest and not rest[0].startswith("-"):
            parser = nested.get(rest[0])
            assert parser is not None, "%s: no command memd %s %s" % (doc, command, rest[0])
            rest = rest[1:]
        known = {s for a in parser._actions for s in a.option_strings}
        flags = [w.strip("[],.") for w in rest if w.startswith("-")]
        assert not [f for f in flags if f not in known], "%s: memd %s: %s" % (doc, " ".join(words), flags)
