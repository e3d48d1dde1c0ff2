"""Every fenced code block of README.md and docs/*.md runs, so that the manual cannot rot.

A block's info string (what follows the opening fence) says what the block is and whether it runs:
``LANG [needs=NAME,NAME...] [no-run=REASON]``. Where the fence line must stay as it is, the tags
go in an HTML comment on the line right above it: ``<!-- docs-test: no-run=REASON -->``.

* ``python``: run in a fresh interpreter (``python BLOCK.py``) within ``BLOCK_TIMEOUT_S``, in a
  temporary folder, with this checkout's ``extsrc`` first on the path. It passes when it exits 0.
* ``bash`` / ``sh``: run with ``bash -e -o pipefail`` in a temporary folder, ``python`` being the
  interpreter that runs the tests.
* ``text``: output, a message or a diagram; not code, never run.
* ``needs=...``: what the block needs beyond what the quick start (``pip install -e
  ".[dali,test]"``) installs; it is skipped where that is missing. ``gpu`` is an NVIDIA GPU: the
  test is marked ``cuda``, which the suite's conftest skips without one. Any other name is a
  module looked up as given (``torch``, ``ray``, ``cupy``); ``ray`` also marks the test ``ray`` and
  gives it ``RAY_BLOCK_TIMEOUT_S``. A python block that imports torch, ray or cupy (also through
  ``extsrc.torch``, ``extsrc.cupy``, ``extsrc.ray``) must say so. A block that imports DALI, which
  the quick start installs, is skipped only where DALI is missing, as the DALI tests are.
* ``no-run=REASON``: shown to the reader, never run; REASON is one of ``NO_RUN_REASONS``. The Quick
  start of README.md is one (``no-run=quick-start``): CI (``.ci/run``) runs its two commands on a
  fresh machine itself, and ``test_the_quick_start_is_what_ci_runs`` keeps the two in step.

A block with another language, an unknown tag or reason, or no info string at all fails
``test_every_block_is_marked``: every block either runs or says why not. The links between the
pages are checked too (files and ``#anchors``), and README.md is kept a front page.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
# Pages whose links are checked too (their blocks are not run here).
LINKED_PAGES = DOCS + [ROOT / name for name in ("CONTRIBUTING.md", "CHANGELOG.md", "extsrc/README.md",
                                                 "extsrc/dali/README.md", "tutorials/README.md",
                                                 "docker/README.md")]
README_MAX_LINES = 250
BLOCK_TIMEOUT_S = 60  # generous: the suite also runs beside a CPU load (.ci/run)
RAY_BLOCK_TIMEOUT_S = 180  # a block that starts a local Ray takes about 15 s on 2 idle cores

RUN_LANGUAGES = ("python", "bash", "sh")
TEXT_LANGUAGES = ("text",)
NO_RUN_REASONS = {
    "quick-start": "README's Quick start: CI (.ci/run) runs these two commands on a fresh machine",
    "install": "installs packages or creates a virtual environment",
    "long": "takes minutes (a benchmark, the demo, the full test suite)",
    "cluster": "needs several machines, or starts a cluster or Docker",
}
# Modules a block must declare with needs= when it imports them (not installed by the quick start).
DECLARED_MODULES = {"torch", "ray", "cupy", "torchvision"}
# Layers of extsrc that import one of those.
LAYER_MODULES = {"extsrc.torch": "torch", "extsrc.cupy": "cupy", "extsrc.ray": "ray"}
DALI_NAMES = {"fn", "pipeline_def", "Pipeline"}  # from extsrc import these: DALI's drop-in


_COMMENT = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    end: int  # the line of the closing fence, 1-based
    info: str
    code: str
    language: str = ""
    needs: List[str] = field(default_factory=list)
    no_run: Optional[str] = None
    problems: List[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language in RUN_LANGUAGES and self.no_run is None and not self.problems


def fenced_blocks(page: Path) -> List[Block]:
    """The fenced code blocks of a Markdown page, with their info strings parsed."""
    blocks = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening or (opening["fence"][0] == "`" and "`" in opening["info"]):
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        body: List[str] = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if (closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence)
                    and not closing["info"].strip()):
                break
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j].lstrip())
            j += 1
        info = opening["info"].strip()
        comment = _COMMENT.match(lines[i - 1]) if i else None
        if comment:  # tags in an HTML comment right above the fence, where the fence must stay as it is
            info = f"{info} {comment[1]}"
        blocks.append(parse_info(Block(page, i + 1, min(j + 1, len(lines)), info, "\n".join(body) + "\n")))
        i = j + 1
    return blocks


def parse_info(block: Block) -> Block:
    words = block.info.split()
    if not words:
        block.problems.append("no info string: say ```python, ```bash or ```text (output)")
        return block
    block.language = words[0]
    if block.language not in RUN_LANGUAGES + TEXT_LANGUAGES:
        block.problems.append(f"language {block.language!r} is none of {RUN_LANGUAGES + TEXT_LANGUAGES}")
    for word in words[1:]:
        key, _, value = word.partition("=")
        if key == "needs" and value:
            block.needs += value.split(",")
        elif key == "no-run" and value in NO_RUN_REASONS:
            block.no_run = value
        elif key == "no-run":
            block.problems.append(f"no-run needs one of the reasons {sorted(NO_RUN_REASONS)}, got {value!r}")
        else:
            block.problems.append(f"unknown tag {word!r} (known: needs=..., no-run=REASON)")
    if block.language in TEXT_LANGUAGES and (block.needs or block.no_run):
        block.problems.append("a text block is never run: it takes no needs= or no-run=")
    if block.language == "python":
        block.problems += undeclared_imports(block)
    return block


def imported_modules(code: str) -> Tuple[set, bool]:
    """The modules a block imports, and whether it imports DALI (directly or through extsrc)."""
    modules, dali = set(), False
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
            modules |= {f"{node.module}.{alias.name}" for alias in node.names}
            if node.module == "extsrc" and DALI_NAMES & {alias.name for alias in node.names}:
                dali = True
    dali = dali or any(m == "nvidia.dali" or m.startswith(("nvidia.dali.", "extsrc.dali")) for m in modules)
    return modules, dali


def undeclared_imports(block: Block) -> List[str]:
    try:
        modules, _ = imported_modules(block.code)
    except SyntaxError as error:
        return [f"not valid Python: {error}"]
    wanted = {m.split(".")[0] for m in modules} & DECLARED_MODULES
    wanted |= {need for layer, need in LAYER_MODULES.items() if layer in modules}
    return [f"imports {name} but does not say needs={name}" for name in sorted(wanted - set(block.needs))]


ALL_BLOCKS = [block for page in DOCS for block in fenced_blocks(page)]


def _param(block: Block):
    marks = [pytest.mark.slow]
    if "gpu" in block.needs:
        marks.append(pytest.mark.cuda)
    if "ray" in block.needs:
        marks.append(pytest.mark.ray)
    return pytest.param(block, id=block.where, marks=marks)


RUN_BLOCKS = [_param(block) for block in ALL_BLOCKS if block.runs]


def test_the_pages_exist():
    assert (ROOT / "docs" / "index.md").exists(), "docs/index.md lists the pages of the manual"
    assert len(DOCS) > 2, "no pages found in docs/"


def test_every_block_is_marked():
    problems = [f"{block.where}: {problem}" for block in ALL_BLOCKS for problem in block.problems]
    assert not problems, "\n".join(problems)


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_the_quick_start_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start"):]
    section = section[:section.index("\n## ")]
    blocks = [block for block in ALL_BLOCKS if block.page.name == "README.md" and block.no_run == "quick-start"]
    assert len(blocks) == 1 and blocks[0].code.strip() in section, "README.md has one Quick start block"
    commands = [line for line in blocks[0].code.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in ci, "CI (.ci/run) runs the Quick start's test command as written"
    assert "python -m extsrc demo" in commands[0]


# -- links ------------------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _without_blocks(page: Path) -> str:
    """The page with the lines of its fenced blocks blanked."""
    lines = page.read_text().splitlines()
    for block in fenced_blocks(page):
        for i in range(block.line - 1, block.end):
            lines[i] = ""
    return "\n".join(lines)


def _prose(page: Path) -> str:
    """The page without its fenced blocks and code spans (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", _without_blocks(page))


def anchors(page: Path) -> set:
    """The anchors GitHub makes of a page's headings (duplicates get -1, -2, ...)."""
    seen: Dict[str, int] = {}
    found = set()
    for line in _without_blocks(page).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading[1].lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_links_between_pages_resolve():
    problems = []
    for page in LINKED_PAGES:
        if not page.exists():
            problems.append(f"{page.relative_to(ROOT)} does not exist")
            continue
        for match in _LINK.finditer(_prose(page)):
            target = match[1] or match[2]
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                problems.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{page.relative_to(ROOT)}: {target}: no heading #{anchor} in {linked.name}")
    assert not problems, "\n".join(problems)


# -- running the blocks -----------------------------------------------------------------------------

def _environment(tmp_path: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["HOME"] = env.get("HOME") or str(tmp_path)
    env.pop("EXTSRC_STREAMING_COPY", None)
    return env


def _skip_if_missing(block: Block) -> None:
    for need in block.needs:
        if need != "gpu" and importlib.util.find_spec(need) is None:
            pytest.skip(f"needs {need}")
    if block.language == "python" and imported_modules(block.code)[1]:
        if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
            pytest.skip("needs nvidia-dali")


@pytest.mark.parametrize("block", RUN_BLOCKS)
def test_block_runs(block: Block, tmp_path: Path):
    _skip_if_missing(block)
    name = re.sub(r"\W", "_", block.where)
    if block.language == "python":
        script = tmp_path / f"{name}.py"
        script.write_text(block.code)
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    limit = RAY_BLOCK_TIMEOUT_S if "ray" in block.needs else BLOCK_TIMEOUT_S
    try:
        result = subprocess.run(command, cwd=tmp_path, env=_environment(tmp_path), capture_output=True,
                                text=True, timeout=limit)
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"{block.where}: still running after {limit} s\n{timeout.stdout}\n{timeout.stderr}")
    assert result.returncode == 0, (
        f"{block.where} ({block.language}) exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
