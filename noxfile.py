"""Sessions for the pc monorepo: tests per package and together, lint, types, docs, build, demo, bench, gpu.

Every session installs the CPU build of torch pinned in ``constraints/cpu.txt`` (or the file named by
``PC_TORCH_CONSTRAINTS``, e.g. ``constraints/cuda.txt`` on GPU runners). uv does not read pip's configuration,
so the find-links source pip uses on this machine is handed to uv through ``UV_FIND_LINKS``; it is never
passed with ``--find-links`` on a uv command line (that would replace the source rather than add to it).

Run ``nox -l`` for the list; ``nox -s tests`` is the fast path; ``nox -s tests-pc-pool`` proves that pc-pool
works with nothing but its declared dependencies installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
PACKAGES_DIR = ROOT / "packages"
PACKAGES = sorted(p.name for p in PACKAGES_DIR.iterdir() if (p / "pyproject.toml").is_file())
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.3", "psutil>=5.9", "hypothesis>=6.100"]
# Test-only needs beyond a package's runtime closure; local names are installed from packages/.
EXTRA_TEST_DEPS: dict[str, list[str]] = {
    "pc-sync": ["pc-replicate", "pc-distributed"],  # pc-distributed: run_world in the process-group tests
    "pc-assigner": ["scipy>=1.9"],
}
# What the demo, the integration tests and the benchmarks use beyond the packages themselves.
# The examples' own dependencies (never a pc package's): progress bars, the digits data, the plot, CartPole.
DEMO_DEPS = ["tqdm>=4.60", "scikit-learn>=1.2", "matplotlib>=3.7", "gymnasium>=0.29"]
BENCH_DEPS = ["tqdm>=4.60", "cloudpickle>=3", "loky>=3.4", "matplotlib>=3.7", "scipy>=1.9", "numpy>=1.24"]
# What tools/release.py needs, and the real package index the release test starts on loopback.
RELEASE_DEPS = ["build>=1.2", "twine>=5.1", "packaging>=23", "hatchling>=1.24"]
INDEX_TEST_DEPS = [*RELEASE_DEPS, "pypiserver>=2.1"]
DOCS_DEPS = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26", "ruff>=0.6"]

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.error_on_missing_interpreters = True


def _pip_find_links() -> str | None:
    """Return pip's configured find-links (environment first, then pip's config files)."""
    if os.environ.get("PIP_FIND_LINKS"):
        return os.environ["PIP_FIND_LINKS"]
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    value = out.stdout.strip()
    return value if out.returncode == 0 and value else None


_find_links = _pip_find_links()
if _find_links and not os.environ.get("UV_FIND_LINKS"):
    os.environ["UV_FIND_LINKS"] = " ".join(_find_links.split())
# uv installs without bytecode by default; with PYTHONDONTWRITEBYTECODE set (as on CI machines here) every
# spawned test process would then recompile torch's modules. Compile once at install time instead.
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")
TORCH_CONSTRAINTS = os.environ.get("PC_TORCH_CONSTRAINTS", "constraints/cpu.txt")
if not _find_links and TORCH_CONSTRAINTS.endswith("cpu.txt"):
    # Elsewhere (a laptop, GitHub's runners) the +cpu build comes from PyTorch's CPU index.
    os.environ.setdefault("PIP_EXTRA_INDEX_URL", "https://download.pytorch.org/whl/cpu")
    os.environ.setdefault("UV_INDEX", "https://download.pytorch.org/whl/cpu")
    os.environ.setdefault("UV_INDEX_STRATEGY", "unsafe-best-match")


def _local_deps(package: str) -> list[str]:
    """Sibling distributions named in a package's ``dependencies`` list."""
    text = (PACKAGES_DIR / package / "pyproject.toml").read_text()
    block = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.S | re.M)
    names = re.findall(r'"(pc-[a-z]+)', block.group(1)) if block else []
    return [n for n in names if n in PACKAGES]


def closure(package: str) -> list[str]:
    """The package and every sibling it depends on, dependencies first."""
    seen: list[str] = []

    def visit(name: str) -> None:
        for dep in _local_deps(name):
            visit(dep)
        if name not in seen:
            seen.append(name)

    visit(package)
    return seen


def _install(session: nox.Session, *requirements: str, editable: bool = False) -> None:
    """Install requirements (sibling names become local paths) under the torch constraints."""
    args: list[str] = []
    for req in requirements:
        if req in PACKAGES:
            path = str(PACKAGES_DIR / req)
            args += ["-e", path] if editable else [path]
        else:
            args.append(req)
    session.install("-c", TORCH_CONSTRAINTS, *args)


def _check_torch_build(session: nox.Session) -> None:
    """Fail if a CPU session picked up a CUDA build of torch."""
    if TORCH_CONSTRAINTS.endswith("cpu.txt"):
        session.run(
            "python",
            "-c",
            "import torch, sys; v = torch.__version__; "
            "sys.exit(0 if torch.version.cuda is None and v.endswith('+cpu') else f'not a CPU torch: {v}')",
            silent=True,
        )


_CHECK_ONLY = """
import importlib.util, sys
expected, names = sys.argv[1].split(","), sys.argv[2].split(",")
found = [n for n in names if importlib.util.find_spec(n)]
if sorted(found) != sorted(expected):
    sys.exit(f"importable siblings: {sorted(found)}; expected only: {sorted(expected)}")
"""


def _check_only(session: nox.Session, allowed: list[str]) -> None:
    """Fail unless exactly the ``allowed`` siblings are importable in the session's venv."""
    expected = ",".join(sorted({p.replace("-", "_") for p in allowed}))
    names = ",".join(p.replace("-", "_") for p in PACKAGES)
    session.run("python", "-c", _CHECK_ONLY, expected, names, silent=True)


def _install_all(session: nox.Session, *extra: str) -> None:
    _install(session, *PACKAGES, *TEST_TOOLS, *extra, editable=True)
    _check_torch_build(session)


def _pytest(session: nox.Session, *paths: str, marker: str | None = None) -> None:
    args = ["pytest", *paths]
    if marker:
        args += ["-m", marker]
    session.run(*args, *session.posargs)


for _package in PACKAGES:

    @nox.session(name=f"tests-{_package}")
    def _tests_one(session: nox.Session, package: str = _package) -> None:
        """Run one package's tests in a venv holding only its declared closure."""
        extras = EXTRA_TEST_DEPS.get(package, [])
        _install(session, *closure(package), *[d for e in extras if e in PACKAGES for d in closure(e)])
        _install(session, *[e for e in extras if e not in PACKAGES], *TEST_TOOLS)
        _check_torch_build(session)
        _check_only(session, closure(package) + [d for e in extras if e in PACKAGES for d in closure(e)])
        _pytest(session, f"packages/{package}/tests")


def _uv_for_tests(session: nox.Session) -> None:
    """Tell the release test where uv is (it makes one fresh venv per package; pip is its slow fallback)."""
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if Path(uv).is_file():
        session.env["PC_UV"] = uv


@nox.session
def tests(session: nox.Session) -> None:
    """Every package and the integration tests in one venv (the fast path used by README and CI)."""
    _install_all(session, *DEMO_DEPS, *INDEX_TEST_DEPS, "scipy>=1.9")
    _uv_for_tests(session)
    _pytest(session, *[f"packages/{p}/tests" for p in PACKAGES], "tests-integration", marker="not multihost")


# The suites that make RPC calls, run again on the c10d RPC backend (the other sessions run on the default,
# TensorPipe): pc-distributed's and pc-server's tests, the integration tests under torchrun and the docs'.
C10D_SUITES = [
    "packages/pc-distributed/tests",
    "packages/pc-server/tests",
    "tests-integration/test_integration_torchrun.py",
    "tests-integration/test_integration_server_torchrun.py",
    "tests-integration/test_integration_server_worker_death.py",
    "tests-integration/test_integration_docs.py",
]


@nox.session(name="rpc-c10d")
def rpc_c10d(session: nox.Session) -> None:
    """The RPC suites (:data:`C10D_SUITES`) on the c10d RPC backend (``PC_RPC_BACKEND=c10d``)."""
    _install_all(session, *DEMO_DEPS)
    session.env["PC_RPC_BACKEND"] = "c10d"
    _pytest(session, *C10D_SUITES, marker="not multihost")


# The support matrix (docs/support.md): the floor, the torch current GPU images ship, and the newest release,
# each on a Python it publishes wheels for. The pinned CPU build (constraints/cpu.txt) on Python 3.11 is the
# fourth point: every other session. Moving the floor or adding a release changes only this list.
COMPAT_MATRIX = [("2.4.1", "3.10"), ("2.11.0", "3.12"), ("2.15.0", "3.13")]
# The matrix's ends (the floor and the newest) also run the c10d RPC backend's suites; between them the pinned
# CPU build does (rpc-c10d). The backend's torch-facing code branches on capabilities the ends bracket.
COMPAT_C10D = (COMPAT_MATRIX[0][0], COMPAT_MATRIX[-1][0])


@nox.session(name="compat")
@nox.parametrize(("torch", "python"), COMPAT_MATRIX)
def compat(session: nox.Session, torch: str) -> None:
    """Every package's tests (not ``gpu``, not ``multihost``) on one torch release of the support matrix.

    The release comes from the package index (a CUDA build where the index serves one; it runs on CPU).
    uv does not read pip's global constraint file, so a release newer than a machine's pip cap installs.
    """
    session.install(f"torch=={torch}", *[str(PACKAGES_DIR / p) for p in PACKAGES], *TEST_TOOLS, "scipy>=1.9")
    session.run(
        "python",
        "-c",
        f"import torch, sys; sys.exit(0 if torch.__version__.startswith('{torch}') "
        f"else 'wanted torch {torch}, got ' + torch.__version__)",
        silent=True,
    )
    _pytest(
        session,
        *[f"packages/{p}/tests" for p in PACKAGES],
        "tests-integration/test_integration_imports.py",
        marker="not gpu and not multihost",
    )
    if torch in COMPAT_C10D:  # pc-distributed's and pc-server's suites again on the c10d RPC backend
        session.env["PC_RPC_BACKEND"] = "c10d"
        _pytest(session, *C10D_SUITES[:2], marker="not gpu and not multihost")


@nox.session
def adversarial(session: nox.Session) -> None:
    """The property-based adversarial suite (hypothesis): ``nox -s adversarial -- [EXAMPLES]`` (default 200).

    The same tests run in ``tests`` with a few derandomized examples each; here every property gets EXAMPLES
    of them (``PC_ADVERSARIAL_EXAMPLES``), still derandomized unless ``PC_ADVERSARIAL_SEED`` is set. A
    failure prints the falsifying example and the seed line.
    """
    examples = session.posargs[0] if session.posargs else os.environ.get("PC_ADVERSARIAL_EXAMPLES", "200")
    if not examples.isdigit():
        session.error(f"usage: nox -s adversarial -- [EXAMPLES] (an integer), got {session.posargs}")
    _install_all(session)
    session.env["PC_ADVERSARIAL_EXAMPLES"] = examples
    # the examples count is this session's argument, not pytest's
    session.run("pytest", *[f"packages/{p}/tests" for p in PACKAGES], "-m", "adversarial")


@nox.session
def integration(session: nox.Session) -> None:
    """Cross-package tests through the public APIs."""
    _install_all(session, *DEMO_DEPS, *INDEX_TEST_DEPS)
    _uv_for_tests(session)
    _pytest(session, "tests-integration", marker="not multihost")


@nox.session
def gpu(session: nox.Session) -> None:
    """The `gpu`-marked tests; a missing CUDA device is an error here, not a skip."""
    session.env["PC_REQUIRE_GPU"] = "1"
    _install(session, *PACKAGES, *TEST_TOOLS, *DEMO_DEPS, editable=True)
    _pytest(session, *[f"packages/{p}/tests" for p in PACKAGES], "tests-integration", marker="gpu")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole repository."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy (strict) on every package's src/."""
    _install(session, "mypy>=1.10", "dill>=0.3.6", "numpy>=1.24", "torch")
    session.run("mypy", *[f"packages/{p}/src" for p in PACKAGES])


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site with --strict."""
    session.install(*DOCS_DEPS)
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site"))
    # API examples must render as code: no doctest prompt left inside a blockquote.
    session.run("python", "tests-integration/integration_docs_site.py", str(ROOT / "site"))


@nox.session
def build(session: nox.Session) -> None:
    """Wheel + sdist per package, twine check --strict, then install the wheels by path and import them."""
    session.install("build[uv]>=1.2", "twine>=5.1")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for package in PACKAGES:
        session.run(
            "python", "-m", "build", "--installer", "uv", "--outdir", str(dist), f"packages/{package}"
        )
    artifacts = sorted(str(p) for p in dist.iterdir())
    expected = 2 * len(PACKAGES)
    if len(artifacts) != expected:
        session.error(f"expected {expected} artifacts in dist/, found {len(artifacts)}: {artifacts}")
    session.run("twine", "check", "--strict", *artifacts)
    wheels = [a for a in artifacts if a.endswith(".whl")]
    session.install("-c", TORCH_CONSTRAINTS, *wheels)
    _check_torch_build(session)
    modules = ", ".join(p.replace("-", "_") for p in PACKAGES)
    session.run("python", "-c", f"import {modules}; print('imported: {modules}')", external=False)


@nox.session
def demo(session: nox.Session) -> None:
    """The main demo: asynchronous training with all seven packages (``nox -s demo -- --help``)."""
    _install(session, *PACKAGES, *DEMO_DEPS)
    _check_torch_build(session)
    session.run("python", "examples/async_training.py", *session.posargs)


@nox.session
def rl(session: nox.Session) -> None:
    """A3C on CartPole-v1 until the mean greedy return of 20 episodes is >= 475 (``nox -s rl -- --help``)."""
    _install(session, *PACKAGES, *DEMO_DEPS)
    _check_torch_build(session)
    session.run("python", "examples/a3c_cartpole.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Every package's benchmark side by side with its peers; ``nox -s bench -- pc-pool`` runs one."""
    _install(session, *PACKAGES, *BENCH_DEPS)
    _check_torch_build(session)
    session.run("python", "benchmarks/run_all.py", *session.posargs)


@nox.session
def release(session: nox.Session) -> None:
    """Release one package: ``nox -s release -- pc-pickle [--tag T] [--index-url U] [--repository-url R]``.

    Checks that the tag, ``__about__.py`` and the CHANGELOG agree and that every sibling range is satisfied on
    the target index, builds, runs ``twine check --strict`` and uploads (no ``--repository-url``: a dry run).
    The release workflow runs this session; see tools/release.py.
    """
    if not session.posargs:
        session.error("name the package: nox -s release -- pc-<name> [options]")
    session.install(*RELEASE_DEPS)
    session.run("python", "tools/release.py", "release", *session.posargs)


@nox.session
def bump(session: nox.Session) -> None:
    """Bump one package: ``nox -s bump -- pc-pickle patch`` (or major, minor, X.Y.Z); CHANGELOG included."""
    if len(session.posargs) != 2:
        session.error("usage: nox -s bump -- pc-<name> major|minor|patch|X.Y.Z")
    session.install("packaging>=23")
    session.run("python", "tools/release.py", "bump", *session.posargs)


# --- pc-pickle fuzzing (issue 16) ---------------------------------------------------------------------------
@nox.session
def fuzz(session: nox.Session) -> None:
    """pc_pickle's seeded payload fuzzer, longer than in ``tests``: ``nox -s fuzz -- [CASES] [SEED]``."""
    cases = session.posargs[0] if session.posargs else "1000000"
    seed = session.posargs[1] if len(session.posargs) > 1 else "16"
    if not (cases.isdigit() and seed.isdigit()):
        session.error(f"usage: nox -s fuzz -- [CASES] [SEED] (integers), got {session.posargs}")
    _install(session, "pc-pickle", *TEST_TOOLS)
    _check_torch_build(session)
    session.env.update({"PC_PICKLE_FUZZ_CASES": cases, "PC_PICKLE_FUZZ_SEED": seed})
    tests = "packages/pc-pickle/tests/test_pickle_fuzz.py"
    options = ["-k", "test_fuzz_", "-o", "timeout=0", "-o", "faulthandler_timeout=0"]
    session.run("pytest", tests, *options)


@nox.session
def soak(session: nox.Session) -> None:
    """pc-server's chaos soak for longer: ``nox -s soak -- --duration 600 [--seed 7]`` (seconds; default 300).

    Clients are SIGKILLed mid-push and restarted for the whole duration; the ledger must balance and the
    reducers' RSS and threads stay bounded (packages/pc-server/tests/test_server_soak.py).
    """
    args = list(session.posargs)
    options = {"--duration": "300", "--seed": "14"}
    while args:
        flag = args.pop(0)
        if flag not in options or not args:
            session.error(f"usage: nox -s soak -- [--duration SECONDS] [--seed N]; got {flag!r}")
        options[flag] = args.pop(0)
    seconds = float(options["--duration"])
    _install(session, *PACKAGES, *TEST_TOOLS)
    _check_torch_build(session)
    session.env.update(PC_SERVER_SOAK_SECONDS=str(seconds), PC_SERVER_SOAK_SEED=options["--seed"])
    limit = int(seconds) + 300
    session.run(
        "pytest",
        "packages/pc-server/tests/test_server_soak.py",
        "-s",
        f"--timeout={limit}",
        "-o",
        f"faulthandler_timeout={limit - 10}",
    )


# -- multihost (issue 15): simulated hosts, needs root; kept as its own block ---
@nox.session
@nox.parametrize("rpc_backend", ["tensorpipe", "c10d"])
def multihost(session: nox.Session, rpc_backend: str) -> None:
    """pc-distributed across simulated hosts (network namespaces, torchrun) on one RPC backend; needs root.

    The elastic trainer's tests (it makes no RPC calls) run in the TensorPipe run only.
    """
    _install(session, *PACKAGES, *TEST_TOOLS, editable=True)
    _check_torch_build(session)
    session.env["PC_RPC_BACKEND"] = rpc_backend
    suites = ["tests-integration/test_integration_multihost.py"]
    if rpc_backend == "tensorpipe":
        suites.append("tests-integration/test_integration_elastic_multihost.py")
    _pytest(session, *suites, marker="multihost")
