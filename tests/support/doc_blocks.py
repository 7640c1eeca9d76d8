"""The fenced code blocks of a Markdown document, with the markers that say how to test them.

A block is a fenced code block (```` ``` ```` or ``~~~``, any indent). Its language is the
first word of the info string.

A block is the content of a file when the reader is told so in visible text: the nearest
text line above the fence (at most one blank line, and any markers, between them) is
``Save this as `PATH`:`` (any words, then ``as `PATH`:``) or ``PATH`` alone in backticks,
then a colon. It is written to PATH (relative to the repo root) in document order, not
run. A reader on GitHub or the docs site sees that line; HTML comments they do not see,
so the old ``<!-- file: PATH -->`` marker is refused.

One or more marker comments may stand alone on the lines right above the opening fence
(no blank line between them and the fence):

``<!-- illustration -->``  not run or checked: a sketch, a synopsis, a command that needs
                           another machine or minutes
``<!-- output -->``        this block is the expected output of the runnable block just
                           before it (no other block in between); ``...`` matches anything
``<!-- exit N -->``        the runnable block below must exit with status N (default 0)

Any other comment right above a fence is an error, so a misspelt marker cannot silently
turn an example off. The runner (``doc_runner``) decides what each language means.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

#: Languages that are executed. ``sh``/``bash``: one bash script; ``console``: ``$ `` prompts
#: with their output; ``python``: one program.
RUNNABLE = {"sh", "bash", "console", "python"}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")
_MARKER = re.compile(r"^[ \t]*<!--\s*(?P<body>.*?)\s*-->[ \t]*$")
_EXIT = re.compile(r"^exit (?P<code>\d{1,3})$")
_FILE = re.compile(r"^file:")
# The visible file name: "Save this as `myapp/tasks.py`:" or "`myapp/tasks.py`:" alone.
_FILE_LINE = re.compile(r"^[ \t]*(?:.*\bas[ \t]+)?`(?P<path>[^`\s]+)`:[ \t]*$")


class MarkerError(ValueError):
    """A marker the runner cannot honour (misspelt, misplaced, or pointing outside the repo)."""


@dataclass
class Block:
    path: str                  # the document, as given
    line: int                  # 1-based line of the opening fence
    lang: str                  # "" when the fence names none
    text: str                  # the content, indent of the fence removed, ends with "\n" unless empty
    illustration: bool = False
    exit_code: int = 0
    file: str | None = None    # "Save this as `PATH`:" on the line above
    is_output: bool = False    # <!-- output -->: the expected output of the block before it
    output: Block | None = field(default=None, repr=False)  # set on the runnable block

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.lang in RUNNABLE and not self.illustration and self.file is None and not self.is_output


def parse(text: str, path: str = "<doc>") -> list[Block]:
    """Every fenced block of ``text`` in order, markers applied. Raises :class:`MarkerError`."""
    lines = text.split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        info = m["info"].strip()
        lang = info.split()[0].lower() if info else ""
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close.startswith(fence[0] * len(fence)) and not close.strip(fence[0]):
                break
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        else:
            raise MarkerError(f"{path}:{start + 1}: fence never closed")
        i += 1
        block = Block(path, start + 1, lang, "".join(l + "\n" for l in body))
        markers = _markers_above(lines, start)
        _apply_markers(block, markers, blocks)
        _apply_file_line(block, lines, start - len(markers))
        blocks.append(block)
    return blocks


def _markers_above(lines: list[str], fence: int) -> list[tuple[int, str]]:
    found = []
    j = fence - 1
    while j >= 0 and (m := _MARKER.match(lines[j])):
        found.append((j + 1, m["body"]))
        j -= 1
    return found[::-1]


def _apply_markers(block: Block, markers: list[tuple[int, str]], before: list[Block]) -> None:
    for line, body in markers:
        where = f"{block.path}:{line}"
        if body == "illustration":
            block.illustration = True
        elif body == "output":
            prev = before[-1] if before else None
            if prev is None or not prev.runnable or prev.output is not None:
                raise MarkerError(f"{where}: <!-- output --> must follow a runnable block "
                                  f"(sh, bash, python) with no other block in between")
            if prev.lang == "console":
                raise MarkerError(f"{where}: a console block shows its output after each $ line")
            block.is_output = True
            prev.output = block
        elif m := _EXIT.match(body):
            block.exit_code = int(m["code"])
        elif _FILE.match(body):
            raise MarkerError(f"{where}: <!-- {body} --> is invisible to a reader on GitHub or the docs "
                              f"site: name the file in the text right above the block instead, as "
                              f"\"Save this as `PATH`:\"")
        else:
            raise MarkerError(f"{where}: unknown marker <!-- {body} --> right above a fence "
                              f"(known: illustration, output, exit N)")
    if block.exit_code and not block.runnable:
        raise MarkerError(f"{block.where}: <!-- exit N --> on a block that is not run")
    if block.exit_code and block.lang == "console":
        raise MarkerError(f"{block.where}: in a console block, show a status with `; echo \"exit $?\"`")


def _apply_file_line(block: Block, lines: list[str], above: int) -> None:
    """``block.file`` from the visible line naming it (see the module docstring); ``above``
    is the index of the first line above the fence and its markers."""
    j = above - 1
    if j >= 0 and not lines[j].strip():
        j -= 1  # one blank line between the text and the block
    if j < 0 or not (m := _FILE_LINE.match(lines[j])):
        return
    where = f"{block.path}:{j + 1}"
    rel = os.path.normpath(m["path"])
    if os.path.isabs(rel) or rel.startswith(".."):
        raise MarkerError(f"{where}: file path must stay inside the repo: {m['path']}")
    if block.illustration or block.is_output or block.exit_code:
        raise MarkerError(f"{where}: a block named as a file is written, not run: no marker on it")
    block.file = rel


def read(path: str, root: str) -> list[Block]:
    """Parse the document at ``root/path``; blocks name it by ``path``."""
    with open(os.path.join(root, path), encoding="utf-8") as f:
        return parse(f.read(), path)


_WILDCARD = re.compile(r"\\\.\\\.\\\.")


def matches(expected: str, actual: str) -> bool:
    """Whether ``actual`` output fits ``expected``: lines compared without trailing blanks,
    leading and trailing blank lines ignored, ``...`` matching any text (newlines too)."""
    exp, act = _normalise(expected), _normalise(actual)
    pattern = _WILDCARD.sub(lambda _: ".*?", re.escape(exp))
    return re.fullmatch(pattern, act, re.DOTALL) is not None


def _normalise(text: str) -> str:
    return "\n".join(l.rstrip() for l in text.strip("\n").split("\n")).strip("\n")
