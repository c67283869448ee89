"""Packaging checks for pc-distributed: version and public names."""

import importlib.metadata

import pc_distributed


def test_version_matches_installed_metadata() -> None:
    assert pc_distributed.__version__ == importlib.metadata.version("pc-distributed")


def test_all_names_exist_and_are_documented() -> None:
    for name in pc_distributed.__all__:
        obj = getattr(pc_distributed, name)
        if not isinstance(obj, str):
            assert obj.__doc__, f"{name} has no docstring"
