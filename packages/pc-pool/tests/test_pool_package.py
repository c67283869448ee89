"""Packaging checks for pc-pool: version and public names."""

import importlib.metadata

import pc_pool


def test_version_matches_installed_metadata() -> None:
    assert pc_pool.__version__ == importlib.metadata.version("pc-pool")


def test_all_names_exist_and_are_documented() -> None:
    for name in pc_pool.__all__:
        obj = getattr(pc_pool, name)
        if not isinstance(obj, str):
            assert obj.__doc__, f"{name} has no docstring"
