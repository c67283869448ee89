"""Packaging checks for pc-replicate: version and public names."""

import importlib.metadata

import pc_replicate


def test_version_matches_installed_metadata() -> None:
    assert pc_replicate.__version__ == importlib.metadata.version("pc-replicate")


def test_all_names_exist_and_are_documented() -> None:
    for name in pc_replicate.__all__:
        obj = getattr(pc_replicate, name)
        if not isinstance(obj, str):
            assert obj.__doc__, f"{name} has no docstring"
