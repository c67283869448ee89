"""Packaging checks for pc-sync: version and public names."""

import importlib.metadata

import pc_sync


def test_version_matches_installed_metadata() -> None:
    assert pc_sync.__version__ == importlib.metadata.version("pc-sync")


def test_all_names_exist_and_are_documented() -> None:
    for name in pc_sync.__all__:
        obj = getattr(pc_sync, name)
        if not isinstance(obj, str):
            assert obj.__doc__, f"{name} has no docstring"
