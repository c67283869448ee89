"""Every code example of the READMEs and the docs runs as a reader runs it (rules in integration_docs)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from integration_docs import (
    ROOT,
    Block,
    DocsMarkupError,
    Script,
    check_shell_block,
    doc_files,
    parse_blocks,
    run_script,
    scripts,
)
from integration_docs_site import find_quoted_prompts, find_sphinx_roles
from integration_docs_site import main as site_main
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Generous: a chain of three 3-rank worlds took 90 s on a 2-core machine at load 8. The test's own timeout
# (pytest-timeout) covers the wait for its script plus the one started just before it.
SCRIPT_TIMEOUT = 240.0
# Examples run two at a time (most of their time is importing torch, on one core); each test awaits its own.
PARALLEL = max(1, min(2, os.cpu_count() or 1))


def _collect() -> tuple[list[Script], list[Block], list[str]]:
    found: list[Script] = []
    shell: list[Block] = []
    errors: list[str] = []
    for path in doc_files():
        try:
            blocks = parse_blocks(path)
            found += scripts(blocks)
        except DocsMarkupError as exc:
            errors.append(str(exc))
            continue
        shell += [b for b in blocks if b.lang in ("bash", "sh", "shell", "console") and b.action != "skip"]
    return found, shell, errors


SCRIPTS, SHELL_BLOCKS, MARKUP_ERRORS = _collect()


def _declared_extras(package_dir: Path) -> set[str]:
    text = (package_dir / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[|\Z)", text, re.S | re.M)
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*=", section.group(1), re.M)) if section else set()


def _check_requirement(text: str) -> None:
    """A ``pc-*`` requirement must name a package of this repository and only extras it declares."""
    req = Requirement(text)
    name = canonicalize_name(req.name)
    if not name.startswith("pc-"):
        return  # a third-party tool (nox, uv): nothing of ours to resolve
    package_dir = ROOT / "packages" / name
    assert (package_dir / "pyproject.toml").is_file(), f"{text!r}: no package {name} in packages/"
    unknown = set(req.extras) - _declared_extras(package_dir)
    assert not unknown, f"{text!r}: {name} declares no extra {sorted(unknown)}"


def test_docs_markers_and_fences_are_valid() -> None:
    assert not MARKUP_ERRORS, "\n".join(MARKUP_ERRORS)
    assert len(SCRIPTS) >= 25, [s.where for s in SCRIPTS]  # the collector finds the examples


@pytest.fixture(scope="module")
def example_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """Start every selected example, PARALLEL at a time, in collection order."""
    selected = [
        item.callspec.params["script"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_docs_python_example_runs"
    ]
    with ThreadPoolExecutor(PARALLEL, thread_name_prefix="docs-example") as pool:
        runs = {
            s.where: pool.submit(run_script, s.source, tmp_path_factory.mktemp("docs"), SCRIPT_TIMEOUT)
            for s in selected
        }
        yield runs
        for run in runs.values():
            run.cancel()


@pytest.mark.timeout(SCRIPT_TIMEOUT + 60)
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.where for s in SCRIPTS])
def test_docs_python_example_runs(
    script: Script, example_runs: dict[str, Future[subprocess.CompletedProcess[str]]]
) -> None:
    proc = example_runs[script.where].result(timeout=2 * SCRIPT_TIMEOUT)
    report = (
        f"{script.where} exited with {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    assert proc.returncode == 0, report
    assert "Traceback (most recent call last)" not in proc.stderr, report


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[b.where for b in SHELL_BLOCKS])
def test_docs_shell_block_resolves_or_runs(block: Block) -> None:
    check = check_shell_block(block)
    for requirement in check.requirements:
        _check_requirement(requirement)
    for command in check.commands:
        nox = shutil.which("nox") or shutil.which("nox", path=str(Path(sys.executable).parent))
        if nox is None:
            pytest.skip("nox is not on PATH (nox -s tests runs with it)")
        proc = subprocess.run(
            [nox, *command[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


# The collector and the runner themselves: a broken example must fail, markers must mean what they say.


def _doc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


def test_docs_runner_reports_a_failing_example(tmp_path: Path) -> None:
    (script,) = scripts(parse_blocks(_doc(tmp_path, "```python\nraise SystemExit('broken example')\n```\n")))
    proc = run_script(script.source, tmp_path, 60)
    assert proc.returncode == 1
    assert "broken example" in proc.stderr


def test_docs_continue_joins_skip_drops_and_shell_is_separate(tmp_path: Path) -> None:
    page = _doc(
        tmp_path,
        "```python\nx = 1\n```\n\ntext\n\n<!-- docs-test: continue -->\n\n```python\nprint(x + 1)\n```\n"
        "<!-- docs-test: skip (needs a GPU) -->\n```python\nimport nothing_here\n```\n"
        "```py\nprint('alone')\n```\n```bash\npip install pc-pool\n```\n",
    )
    blocks = parse_blocks(page)
    assert [b.lang for b in blocks] == ["python", "python", "python", "py", "bash"]
    assert blocks[2].action == "skip"
    assert blocks[2].reason == "needs a GPU"
    joined, alone = scripts(blocks)
    assert [b.line for b in joined.blocks] == [1, 9]
    proc = run_script(joined.source, tmp_path, 60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "2\n"
    assert alone.source.endswith("print('alone')\n")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- docs-test: skip () -->\n```python\npass\n```\n", "needs a reason"),
        ("<!-- docs-test: skip -->\n```python\npass\n```\n", "unknown marker"),
        ("<!-- docs-test: continue -->\n```python\npass\n```\n", "no Python block before it"),
        ("```python\npass\n", "never closed"),
    ],
)
def test_docs_bad_markers_are_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(DocsMarkupError, match=message):
        scripts(parse_blocks(_doc(tmp_path, text)))


def test_docs_shell_checks(tmp_path: Path) -> None:
    (block,) = parse_blocks(
        _doc(
            tmp_path,
            "```bash\npip install --find-links dist pc-pool \\\n  'pc-assigner[solver]'  # x\nnox -l\n```\n",
        )
    )
    check = check_shell_block(block)
    assert check.requirements == ["pc-pool", "pc-assigner[solver]"]
    assert check.commands == [["nox", "-l"]]
    for good in check.requirements:
        _check_requirement(good)
    with pytest.raises(AssertionError, match="no package pc-nope"):
        _check_requirement("pc-nope")
    with pytest.raises(AssertionError, match="declares no extra"):
        _check_requirement("pc-pool[solver]")
    (expensive,) = parse_blocks(_doc(tmp_path, "```bash\nnox -s tests\n```\n"))
    with pytest.raises(DocsMarkupError, match="cannot run 'nox -s tests'"):
        check_shell_block(expensive)


# The API reference: examples in docstrings must render as code (the site itself is checked by nox -s docs).

_BROKEN = """<details class="example" open><summary>Example</summary>
<blockquote>
<blockquote>
<blockquote>
<p>with BasePool(2) as pool:
...     pool.map(lambda x: x * 2, range(4))
[0, 2, 4, 6]</p>
</blockquote>
</blockquote>
</blockquote>
</details>"""
_GOOD = """<details class="quote"><summary>Examples</summary><div class="language-pycon highlight"><pre><code>
<span class="gp">&gt;&gt;&gt; </span><span class="n">pool</span></code></pre></div></details>
<blockquote><p>A quotation, with no prompt.</p></blockquote>"""


def test_docs_site_check_finds_doctests_rendered_as_blockquotes(tmp_path: Path) -> None:
    assert find_quoted_prompts(_BROKEN) == [
        "with BasePool(2) as pool: ... pool.map(lambda x: x * 2, range(4)) [0, 2, 4, 6]"
    ]
    assert find_quoted_prompts("<blockquote><p>&gt;&gt;&gt; f(1)</p></blockquote>") == [">>> f(1)"]
    assert find_quoted_prompts(_GOOD) == []
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "index.html").write_text(_GOOD)
    assert site_main([str(tmp_path)]) == 0
    (tmp_path / "api" / "bad.html").write_text(_BROKEN)
    assert site_main([str(tmp_path)]) == 1


def test_docs_docstrings_use_the_examples_section() -> None:
    """griffe knows ``Examples:``; a bare ``Example:`` becomes an admonition that mangles ``>>>`` lines."""
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted(ROOT.glob("packages/*/src/**/*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.fullmatch(r"\s*Example:\s*", line)
    ]
    assert not offenders, f"write 'Examples:' (plural) in: {offenders}"


def test_docs_site_check_finds_sphinx_roles_left_as_text() -> None:
    html = "<p>Public API: :class: <code>Pickler</code>, :func: <code>dumps</code></p>"
    assert find_sphinx_roles(html) == ["Public API: :class:", ", :func:"]
    assert find_sphinx_roles("<p>see <code>:class:`x`</code></p><pre>:func:</pre>") == []  # code is code


def test_docs_griffe_extension_rewrites_sphinx_roles() -> None:
    spec = importlib.util.spec_from_file_location(
        "griffe_roles", ROOT / "docs" / "hooks" / "griffe_sphinx_roles.py"
    )
    assert spec is not None
    assert spec.loader is not None
    if importlib.util.find_spec("griffe") is None:
        pytest.skip("griffe is installed by nox -s docs, not in the test venv")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "Raises :class:`~pc_pool.PoolTerminatedError`; see :meth:`repopulate_pool` and :py:mod:`torch.mp`."
    assert module.strip_roles(text) == "Raises `PoolTerminatedError`; see `repopulate_pool` and `torch.mp`."
