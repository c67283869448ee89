"""Find the code blocks of the documentation and run them as a reader would (see test_integration_docs.py).

The rules, also stated in CONTRIBUTING.md:

* Files: ``README.md``, ``CONTRIBUTING.md``, ``packages/*/README.md`` and ``docs/**/*.md``.
* Every fenced ```` ```python ```` block runs as a script (``python file.py`` in a temporary directory, with
  the interpreter running the tests) and must exit with status 0 and print no traceback.
* A block preceded by ``<!-- docs-test: continue -->`` is a fragment: it is appended to the block before it,
  and the joined blocks run once, as one script. Every other block is a script of its own.
* A block preceded by ``<!-- docs-test: skip (reason) -->`` does not run; the reason is mandatory.
* Shell blocks (```` ```bash ````, ``sh``, ``shell``, ``console``; in ``console`` only the lines after a
  ``$`` prompt) are checked command by command:
  ``pip install ...`` lines are resolved against the clone (every ``pc-*`` name must be a package of this
  repository and every extra one it declares; nothing is downloaded); ``nox -l`` runs. Any other command
  makes the test fail unless the block is marked skip with a reason (they install things, or take minutes).

The marker is an HTML comment on the last non-blank line before the opening fence: visible in the source,
invisible on the rendered page.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from integration_procs import run_group

__all__ = [
    "ROOT",
    "Block",
    "DocsMarkupError",
    "Script",
    "ShellCheck",
    "check_shell_block",
    "doc_files",
    "parse_blocks",
    "run_script",
    "run_under_torchrun",
    "scripts",
]

ROOT = Path(__file__).resolve().parents[1]
PYTHON_LANGS = frozenset({"python", "py"})
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
_SKIP = re.compile(r"^skip\s*\((?P<reason>.*)\)$")


class DocsMarkupError(ValueError):
    """A docs-test marker or a fence that the rules above do not allow."""


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its code and its marker."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    action: str = "run"  # "run", "continue" or "skip"
    reason: str = ""

    @property
    def where(self) -> str:
        """``path:line``, relative to the repository root when the file is inside it."""
        return f"{_rel(self.path)}:{self.line}"


@dataclass
class Script:
    """Python blocks joined into one script: a block and the fragments continuing it."""

    blocks: list[Block] = field(default_factory=list)

    @property
    def where(self) -> str:
        """Where the script's first block is, and how many blocks it joins."""
        first = self.blocks[0].where
        return first if len(self.blocks) == 1 else f"{first}+{len(self.blocks) - 1}"

    @property
    def source(self) -> str:
        """The blocks' code, each preceded by a comment naming where it comes from."""
        return "\n".join(f"# --- {b.where}\n{b.code}" for b in self.blocks)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def doc_files(root: Path = ROOT) -> list[Path]:
    """Every Markdown file whose code blocks are tested, in a stable order."""
    files = [root / "README.md", root / "CONTRIBUTING.md"]
    files += sorted(root.glob("packages/*/README.md"))
    files += sorted((root / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


def _marker(lines: list[str], fence_index: int, where: str) -> tuple[str, str]:
    """The action and reason given by the marker just above the fence at ``fence_index``."""
    i = fence_index - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    match = _MARKER.match(lines[i]) if i >= 0 else None
    if match is None:
        return "run", ""
    body = match.group("body")
    if body == "continue":
        return "continue", ""
    skip = _SKIP.match(body)
    if skip is None:
        raise DocsMarkupError(f"{where}: unknown marker {body!r}; use 'continue' or 'skip (reason)'")
    reason = skip.group("reason").strip()
    if not reason:
        raise DocsMarkupError(f"{where}: 'docs-test: skip' needs a reason in the parentheses")
    return "skip", reason


def parse_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of one Markdown file, with their markers.

    Raises:
        DocsMarkupError: a fence is never closed, or a marker is malformed.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence, lang = opening.group("indent"), opening.group("fence"), opening.group("lang").lower()
        where = f"{_rel(path)}:{i + 1}"
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence[0] * len(fence)) and not lines[j].strip().strip(fence[0])
        ):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        if j == len(lines):
            raise DocsMarkupError(f"{where}: the code fence is never closed")
        action, reason = _marker(lines, i, where)
        blocks.append(Block(path, i + 1, lang, "\n".join(body) + "\n", action, reason))
        i = j + 1
    return blocks


def scripts(blocks: list[Block]) -> list[Script]:
    """Join a file's Python blocks into the scripts that run (skipped blocks are left out).

    Raises:
        DocsMarkupError: a fragment marked ``continue`` has no Python block before it.
    """
    out: list[Script] = []
    for block in blocks:
        if block.lang not in PYTHON_LANGS or block.action == "skip":
            continue
        if block.action == "continue":
            if not out:
                raise DocsMarkupError(f"{block.where}: 'docs-test: continue' but no Python block before it")
            out[-1].blocks.append(block)
        else:
            out.append(Script([block]))
    return out


@dataclass(frozen=True)
class ShellCheck:
    """What a shell block asks for: requirements to resolve against the clone, and commands to run."""

    requirements: list[str]
    commands: list[list[str]]


def _commands(code: str, lang: str) -> list[list[str]]:
    """A shell block's commands: continuation lines joined, comments dropped, ``&&`` split.

    In a ``console`` block only the lines after a ``$ `` prompt are commands; the rest is their output.
    """
    text = code.replace("\\\n", " ")
    commands: list[list[str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if lang == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", ";"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(word)
    return commands


def check_shell_block(block: Block) -> ShellCheck:
    """Sort a shell block's commands into what the test can check or run.

    Raises:
        DocsMarkupError: a command that is neither ``pip install`` nor ``nox -l`` in a block not marked skip.
    """
    requirements: list[str] = []
    run: list[list[str]] = []
    for words in _commands(block.code, block.lang):
        prog = Path(words[0]).name
        if prog in ("pip", "pip3") and words[1:2] == ["install"]:
            args = words[2:]
        elif prog.startswith("python") and words[1:4] == ["-m", "pip", "install"]:
            args = words[4:]
        elif prog == "nox" and words[1:] in (["-l"], ["--list"]):
            run.append(["nox", "-l"])
            continue
        else:
            raise DocsMarkupError(
                f"{block.where}: the docs test cannot run {' '.join(words)!r}; "
                "mark the block <!-- docs-test: skip (reason) --> if it is expensive"
            )
        skip_next = False
        for arg in args:
            if skip_next:
                skip_next = False
            elif arg in ("--find-links", "-f", "-c", "--constraint", "-r", "--requirement"):
                skip_next = True
            elif not arg.startswith("-"):
                requirements.append(arg)
    return ShellCheck(requirements, run)


def run_script(source: str, directory: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as ``python docs_example.py`` in ``directory`` with the interpreter running the tests.

    The script gets its own process group, killed as a whole on timeout, so that the processes an example
    starts (pools, worlds) never outlive it. ``OMP_NUM_THREADS=1`` keeps examples that start several torch
    processes from oversubscribing small machines; nothing else in the environment changes.

    Raises:
        subprocess.TimeoutExpired: the script ran longer than ``timeout`` seconds (its group is killed).
    """
    script = directory / "docs_example.py"
    script.write_text(source, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_group([sys.executable, script.name], cwd=directory, env=env, timeout=timeout)


def run_under_torchrun(
    guide: Path, name: str, directory: Path, nproc: int = 2, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run the one block of ``guide`` that starts with ``# <name>`` under ``torchrun --standalone``.

    The script is taken from the page itself, so a guide and its test cannot drift apart. torchrun's agent
    serves the rendezvous on loopback on a free port; the rendezvous variables of the test's own environment
    are dropped, so that every rank reads the ones torchrun sets.

    Raises:
        AssertionError: The page holds no such block, or more than one.
        subprocess.TimeoutExpired: The run took longer than ``timeout`` seconds (its group is killed).
    """
    wanted = f"# {name}"
    blocks = [b for b in parse_blocks(guide) if b.lang == "python" and b.code.startswith(wanted)]
    assert len(blocks) == 1, f"{guide} should hold exactly one {wanted!r} block, found {len(blocks)}"
    (directory / name).write_text(blocks[0].code)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        name,
    ]
    rendezvous = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    return run_group(command, cwd=directory, env=env, timeout=timeout)
