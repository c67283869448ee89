"""Packaging checks for pc-pickle: version and public names."""

import importlib.metadata

import pc_pickle


def test_version_matches_installed_metadata() -> None:
    assert pc_pickle.__version__ == importlib.metadata.version("pc-pickle")


def test_all_names_exist_and_are_documented() -> None:
    for name in pc_pickle.__all__:
        obj = getattr(pc_pickle, name)
        if not isinstance(obj, str):
            assert obj.__doc__, f"{name} has no docstring"
