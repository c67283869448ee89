"""Packaging checks for pc-server: version and public names."""

import importlib.metadata

import pc_server


def test_version_matches_installed_metadata() -> None:
    assert pc_server.__version__ == importlib.metadata.version("pc-server")


def test_all_names_exist_and_are_documented() -> None:
    for name in pc_server.__all__:
        obj = getattr(pc_server, name)
        if not isinstance(obj, str):
            assert obj.__doc__, f"{name} has no docstring"
