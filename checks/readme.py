"""The code of README.md and docs/*.md as a reader meets it: fenced blocks, their sections, their commands.

`blocks()` yields every fenced block with the heading it stands under and the marker line above it, if
any: `<!-- test: preamble=NAME ranks=N -->` (a Python fragment that assumes what the named preamble of
checks/readme_preambles.py defines; N ranks under horovodrun). `commands(block)` splits a shell
block into commands as a shell reads them (a trailing backslash continues a line; a `#` outside quotes
starts a comment).
"""

import collections
import glob
import os
import re

from tests.support import REPO

Block = collections.namedtuple("Block", "path line section lang text marker")

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*test:(?P<body>.*?)-->\s*$")


def documents():
    """README.md, then docs/*.md in sorted order, as paths relative to the repository."""
    return [
        "README.md",
        *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md"))),
    ]


def blocks(path):
    """Every fenced block of the Markdown file `path` (relative to the repository) as a `Block`: its first
    line's number (1-based, the fence's), the heading it stands under ("" before any), its language, its
    text, and the test marker directly above its fence parsed into a dict (empty without one)."""
    with open(os.path.join(REPO, path)) as f:
        lines = f.read().splitlines()
    found, section, i = [], "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            section = line.lstrip("#").strip()
        fence = _FENCE.match(line)
        if fence:
            start = i
            i += 1
            body = []
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            marker = _MARKER.match(lines[start - 1]) if start else None
            found.append(
                Block(path, start + 1, section, fence.group(1), "\n".join(body) + "\n", _parse(marker))
            )
        i += 1
    return found


def _parse(marker):
    if marker is None:
        return {}
    return dict(part.split("=", 1) for part in marker.group("body").split())


def commands(block):
    """The commands of a shell block, each with its continuation lines joined and its comment removed."""
    joined, current = [], ""
    for line in block.text.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        text = _without_comment(current).strip()
        if text:
            joined.append(" ".join(text.split()))
        current = ""
    return joined


def _without_comment(line):
    # A '#' that starts a word outside quotes starts a comment ('#' inside a word, as in a URL, does not).
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def find_command(path, section, startswith):
    """The one command of `path`'s section `section` that starts with `startswith` (as written there)."""
    found = [
        c
        for b in blocks(path)
        if b.section == section and b.lang in ("sh", "bash", "")
        for c in commands(b)
        if c.startswith(startswith)
    ]
    if len(found) != 1:
        raise LookupError(
            f"{path}, section {section!r}: {len(found)} commands start with {startswith!r}: {found}"
        )
    return found[0]
