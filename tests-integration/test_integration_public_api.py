"""The public API of every package is what ``public_api.json`` records: a restructuring must not change it.

For each package the snapshot holds its ``__all__`` and, for every public name, the ``inspect.signature`` text
of a function or class (or the kind of a constant), and for a class the signature of every public method and
the kind of every public attribute defined by the package itself (what a class inherits from torch or the
standard library is theirs, and differs between releases). A change fails with a diff naming each name that
appeared, disappeared or changed.

A deliberate change of the API regenerates the snapshot, and the diff of ``public_api.json`` goes into the
same commit for review::

    python tests-integration/test_integration_public_api.py --write
"""

from __future__ import annotations

import argparse
import difflib
import enum
import importlib
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

PACKAGES = ["pc_pickle", "pc_pool", "pc_sync", "pc_replicate", "pc_distributed", "pc_server", "pc_assigner"]
SNAPSHOT = Path(__file__).resolve().with_name("public_api.json")

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_SIMPLE = (bool, int, float, str, type(None))


def _signature(obj: Any) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "<no signature>"
    return _ADDRESS.sub("", text)


def _kind(value: Any) -> str:
    """How a non-callable public name is described: its type, and its value when that is a plain constant."""
    if isinstance(value, (*_SIMPLE, enum.Enum)):
        return f"{type(value).__name__} = {value!r}"
    if isinstance(value, (tuple, frozenset)) and all(isinstance(v, _SIMPLE) for v in value):
        return f"{type(value).__name__} = {value!r}"
    return type(value).__name__


def _members(cls: type, package: str) -> dict[str, str]:
    """The public attributes ``cls`` gets from classes of ``package`` (its own and its package bases')."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.split(".")[0] != package:
            continue
        for name, raw in vars(klass).items():
            if name.startswith("_"):
                continue
            if isinstance(raw, property):
                out[name] = "property"
            elif isinstance(raw, staticmethod):
                out[name] = f"staticmethod{_signature(raw.__func__)}"
            elif isinstance(raw, classmethod):
                out[name] = f"classmethod{_signature(raw.__func__)}"
            elif inspect.isfunction(raw):
                out[name] = f"def{_signature(raw)}"
            elif inspect.isclass(raw):
                out[name] = f"class{_signature(raw)}"
            elif inspect.isdatadescriptor(raw) or inspect.ismethoddescriptor(raw):
                out[name] = "descriptor"
            else:
                out[name] = _kind(raw)
    return dict(sorted(out.items()))


def describe(package: str) -> dict[str, Any]:
    """``{"__all__": [...], "names": {name: description}}`` of one package, as imported now."""
    module = importlib.import_module(package)
    exported = list(module.__all__)
    names: dict[str, Any] = {}
    for name in exported:
        value = getattr(module, name)
        if name == "__version__":
            names[name] = "str"
        elif inspect.isclass(value):
            kind = "enum" if issubclass(value, enum.Enum) else "class"
            names[name] = {
                "kind": kind,
                "signature": None if kind == "enum" else _signature(value),
                "members": _members(value, package),
            }
        elif callable(value):
            names[name] = {"kind": "function", "signature": _signature(value)}
        else:
            names[name] = _kind(value)
    return {"__all__": exported, "names": names}


def current() -> dict[str, Any]:
    """The public API of every package, as imported now."""
    return {package: describe(package) for package in PACKAGES}


def _text(api: dict[str, Any]) -> list[str]:
    return json.dumps(api, indent=1, sort_keys=True).splitlines(keepends=True)


def test_the_public_api_is_the_snapshot() -> None:
    recorded = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    now = current()
    assert sorted(recorded) == sorted(PACKAGES), "the snapshot does not cover the seven packages"
    if now != recorded:
        diff = "".join(difflib.unified_diff(_text(recorded), _text(now), "public_api.json", "now", n=2))
        raise AssertionError(
            "the public API changed (a deliberate change regenerates the snapshot with "
            f"`python tests-integration/test_integration_public_api.py --write`):\n{diff}"
        )


def test_the_snapshot_records_signatures() -> None:
    # The guard would pass vacuously on an empty snapshot: it must hold real signatures.
    recorded = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    world = recorded["pc_distributed"]["names"]["World"]
    assert world["signature"].startswith("(name")
    assert "create_rpc_group" in world["members"]
    assert "RpcGroup" in recorded["pc_distributed"]["__all__"]


def main(argv: list[str] | None = None) -> int:
    """Print the diff against the snapshot, or (``--write``) regenerate it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="regenerate public_api.json from the sources")
    args = parser.parse_args(argv)
    now = current()
    if args.write:
        SNAPSHOT.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {SNAPSHOT}")
        return 0
    recorded = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    sys.stdout.writelines(difflib.unified_diff(_text(recorded), _text(now), "public_api.json", "now", n=2))
    return 0 if now == recorded else 1


if __name__ == "__main__":
    sys.exit(main())
