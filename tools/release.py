r"""Release one pc package, or bump its version: the logic behind ``nox -s release`` and ``nox -s bump``.

``release PACKAGE`` checks that the version in ``src/<module>/__about__.py``, the CHANGELOG (a ``## X.Y.Z``
heading) and the tag (when one is given) agree; checks that every sibling range in the package's dependencies
is satisfied by a version that exists on the target index; builds the sdist and wheel; runs ``twine check
--strict``; and uploads to ``--repository-url`` (none given: a dry run that stops after the checks and the
build). ``bump PACKAGE PART`` sets a new version (``major``, ``minor``, ``patch`` or ``X.Y.Z``) and moves the
CHANGELOG's "Unreleased" entries under a heading for it.

Run from the repository root with Python 3.11+ (tomllib) and ``build``, ``twine`` and ``packaging`` (the nox
sessions install them)::

    python tools/release.py bump pc-pickle patch
    python tools/release.py release pc-pickle --tag pc-pickle-v0.1.1 --index-url https://pypi.org/simple/
    python tools/release.py release pc-pickle --repository-url http://127.0.0.1:8080/ \\
        --index-url http://127.0.0.1:8080/simple/

Exit status 0 on success; 1 with a message naming what disagrees otherwise. Nothing is uploaded unless every
check passed.
"""

from __future__ import annotations

import argparse
import datetime
import html.parser
import re
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import tomllib

__all__ = ["Package", "ReleaseError", "bump", "index_versions", "main", "release", "sibling_problems"]

HTTP_TIMEOUT_S = 30.0
_VERSION_RE = re.compile(r'^__version__\s*=\s*"([^"]+)"', re.M)
_UNRELEASED = "## Unreleased"


class ReleaseError(Exception):
    """A check failed; the message names what disagrees."""


@dataclass(frozen=True)
class Package:
    """One distribution under ``<root>/packages/<name>``."""

    root: Path
    name: str

    @property
    def path(self) -> Path:
        """The package's folder."""
        return self.root / "packages" / self.name

    @property
    def module(self) -> str:
        """The import name (``pc_pickle``)."""
        return self.name.replace("-", "_")

    @property
    def about(self) -> Path:
        """The file holding ``__version__``."""
        return self.path / "src" / self.module / "__about__.py"

    @property
    def changelog(self) -> Path:
        """The package's CHANGELOG.md."""
        return self.path / "CHANGELOG.md"

    def version(self) -> str:
        """The version in ``__about__.py``."""
        match = _VERSION_RE.search(self.about.read_text())
        if match is None:
            raise ReleaseError(f'{self.about}: no __version__ = "X.Y.Z" line')
        return match.group(1)

    def sibling_requirements(self) -> list[str]:
        """The ``pc-*`` requirements in ``[project].dependencies``, as written."""
        project = tomllib.loads((self.path / "pyproject.toml").read_text())["project"]
        return [r for r in project.get("dependencies", []) if re.match(r"pc-[a-z]+", r)]


def load_package(root: Path, name: str) -> Package:
    package = Package(root, name)
    if not (package.path / "pyproject.toml").is_file():
        known = sorted(p.name for p in (root / "packages").iterdir() if (p / "pyproject.toml").is_file())
        raise ReleaseError(f"no package {name!r} under {root / 'packages'}; known: {known}")
    return package


# ------------------------------------------------------------------------------------------------ checks


def check_changelog(package: Package, version: str) -> None:
    """The CHANGELOG has a ``## <version>`` heading (``## 0.1.1 — 2026-11-24`` counts)."""
    if not re.search(rf"^## \[?{re.escape(version)}\]?(\s|$)", package.changelog.read_text(), re.M):
        raise ReleaseError(
            f"{package.changelog} has no '## {version}' section: "
            f"run `nox -s bump -- {package.name} {version}`"
        )


def check_tag(package: Package, version: str, tag: str | None) -> None:
    """A given tag must read ``<package>-v<version>``."""
    if tag is not None and tag != f"{package.name}-v{version}":
        raise ReleaseError(
            f"tag {tag!r} does not match {package.name} {version} (expected {package.name}-v{version})"
        )


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            href = dict(attrs).get("href") or ""
            self.names.append(href.split("#", 1)[0].rstrip("/").rsplit("/", 1)[-1])


def index_versions(index_url: str, name: str) -> set[str]:
    """Versions of ``name`` that the simple index at ``index_url`` lists (empty if it has none).

    Raises:
        ReleaseError: The index could not be read (other than a 404 for the project).
    """
    url = f"{index_url.rstrip('/')}/{name}/"
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
            page = response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return set()
        raise ReleaseError(f"cannot read {url}: HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ReleaseError(f"cannot read {url}: {exc}") from exc
    links = _Links()
    links.feed(page)
    versions = set()
    for filename in links.names:
        parsed = _name_version(filename)
        if parsed is not None and parsed[0] == _normalize(name):
            versions.add(parsed[1])
    return versions


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _name_version(filename: str) -> tuple[str, str] | None:
    """``(normalized name, version)`` of a wheel or sdist file name, else None."""
    if filename.endswith(".whl"):
        parts = filename.split("-")
        return (_normalize(parts[0]), parts[1]) if len(parts) >= 5 else None
    for suffix in (".tar.gz", ".zip"):
        if filename.endswith(suffix):
            stem, _, version = filename[: -len(suffix)].rpartition("-")
            return (_normalize(stem), version) if stem else None
    return None


def sibling_problems(package: Package, available: dict[str, set[str]]) -> list[str]:
    """Each sibling requirement that no available version satisfies, as a message."""
    from packaging.requirements import Requirement

    problems = []
    for text in package.sibling_requirements():
        req = Requirement(text)
        have = sorted(available.get(req.name, set()))
        if not any(req.specifier.contains(v, prereleases=True) for v in have):
            problems.append(
                f"{package.name} needs {text}, but the index has {have or 'no version'} of {req.name}"
            )
    return problems


def _available(root: Path, package: Package, index_url: str | None) -> dict[str, set[str]]:
    names = {re.match(r"pc-[a-z]+", r).group(0) for r in package.sibling_requirements()}  # type: ignore[union-attr]
    if index_url is None:  # a dry run without an index checks against the siblings in this checkout
        return {n: {load_package(root, n).version()} for n in names}
    return {n: index_versions(index_url, n) for n in names}


# ---------------------------------------------------------------------------------------------- commands


def _run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd, check=False).returncode != 0:
        raise ReleaseError(f"command failed: {' '.join(cmd)}")


def release(
    root: Path,
    name: str,
    *,
    tag: str | None = None,
    index_url: str | None = None,
    repository_url: str | None = None,
    dist: Path | None = None,
    no_isolation: bool = False,
) -> list[Path]:
    """Check, build, ``twine check`` and (with ``repository_url``) upload a package; return its artifacts."""
    package = load_package(root, name)
    version = package.version()
    check_tag(package, version, tag)
    check_changelog(package, version)
    if repository_url is not None and index_url is None:
        raise ReleaseError(
            "--repository-url needs --index-url (the same index's simple API) to check siblings"
        )
    problems = sibling_problems(package, _available(root, package, index_url))
    if problems:
        raise ReleaseError("refusing to release: " + "; ".join(problems))
    if repository_url is not None and version in index_versions(index_url or "", name):
        raise ReleaseError(f"{name} {version} is already on {index_url}: bump the version first")
    outdir = (dist or root / "dist") / name
    outdir.mkdir(parents=True, exist_ok=True)
    for old in outdir.iterdir():
        old.unlink()
    isolation = ["--no-isolation"] if no_isolation else []
    _run([sys.executable, "-m", "build", *isolation, "--outdir", str(outdir), str(package.path)])
    artifacts = sorted(outdir.iterdir())
    stems = {f"{package.module}-{version}.tar.gz", f"{package.module}-{version}-py3-none-any.whl"}
    if {a.name for a in artifacts} != stems:
        raise ReleaseError(f"expected {sorted(stems)} in {outdir}, found {[a.name for a in artifacts]}")
    _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, artifacts)])
    if repository_url is None:
        print(f"dry run: {name} {version} checked and built in {outdir}; nothing uploaded", flush=True)
    else:
        upload = ["twine", "upload", "--non-interactive", "--repository-url", repository_url]
        _run([sys.executable, "-m", *upload, *map(str, artifacts)])
    return artifacts


def _next_version(current: str, part: str) -> str:
    if re.fullmatch(r"\d+\.\d+\.\d+", part):
        return part
    numbers = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", current)
    if numbers is None or part not in ("major", "minor", "patch"):
        raise ReleaseError(f"cannot bump {current!r} by {part!r}: give major, minor, patch or X.Y.Z")
    major, minor, patch = map(int, numbers.groups())
    return {
        "major": f"{major + 1}.0.0",
        "minor": f"{major}.{minor + 1}.0",
        "patch": f"{major}.{minor}.{patch + 1}",
    }[part]


def bump(root: Path, name: str, part: str, today: datetime.date | None = None) -> str:
    """Set the version and move the CHANGELOG's Unreleased entries under ``## <version> — <date>``.

    The new version must be greater than the current one, or equal to it when that version has no CHANGELOG
    section yet (a package's first release). The Unreleased section must list at least one change.
    """
    from packaging.version import Version

    package = load_package(root, name)
    current = package.version()
    new = _next_version(current, part)
    text = package.changelog.read_text()
    released = re.search(rf"^## \[?{re.escape(current)}\]?(\s|$)", text, re.M) is not None
    if Version(new) < Version(current) or (Version(new) == Version(current) and released):
        raise ReleaseError(f"{name}: new version {new} must be greater than {current}")
    head, sep, rest = text.partition(_UNRELEASED + "\n")
    if not sep:
        raise ReleaseError(f"{package.changelog} has no '{_UNRELEASED}' section")
    body, nxt, tail = rest.partition("\n## ")
    if not body.strip():
        raise ReleaseError(f"{package.changelog}: nothing under '{_UNRELEASED}' to release as {new}")
    date = (today or datetime.datetime.now(datetime.timezone.utc).date()).isoformat()
    package.changelog.write_text(f"{head}{_UNRELEASED}\n\n## {new} — {date}\n\n{body.strip()}\n{nxt}{tail}")
    package.about.write_text(_VERSION_RE.sub(f'__version__ = "{new}"', package.about.read_text(), count=1))
    print(f"{name}: {current} -> {new}", flush=True)
    return new


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="tools/release.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root", type=Path, default=Path(__file__).resolve().parents[1], help="repository root"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rel = sub.add_parser("release", help="check, build, twine check and (with --repository-url) upload")
    rel.add_argument("package")
    rel.add_argument("--tag", help="the git tag being released (checked against the version)")
    rel.add_argument("--index-url", help="simple API of the target index (sibling ranges are checked there)")
    rel.add_argument("--repository-url", help="upload URL; without it nothing is uploaded (dry run)")
    rel.add_argument(
        "--dist", type=Path, help="output folder (default: <root>/dist); artifacts go in dist/<pkg>"
    )
    rel.add_argument("--no-isolation", action="store_true", help="build with this Python's hatchling")
    bmp = sub.add_parser("bump", help="new version + CHANGELOG section")
    bmp.add_argument("package")
    bmp.add_argument("part", help="major, minor, patch or X.Y.Z")
    args = parser.parse_args(argv)
    try:
        if args.command == "release":
            release(
                args.root,
                args.package,
                tag=args.tag,
                index_url=args.index_url,
                repository_url=args.repository_url,
                dist=args.dist,
                no_isolation=args.no_isolation,
            )
        else:
            bump(args.root, args.package, args.part)
    except ReleaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
