"""Packaging checks for pc-assigner: version and public names."""

import importlib.metadata

import pc_assigner


def test_version_matches_installed_metadata() -> None:
    assert pc_assigner.__version__ == importlib.metadata.version("pc-assigner")


def test_all_names_exist_and_are_documented() -> None:
    for name in pc_assigner.__all__:
        obj = getattr(pc_assigner, name)
        if not isinstance(obj, str):
            assert obj.__doc__, f"{name} has no docstring"
