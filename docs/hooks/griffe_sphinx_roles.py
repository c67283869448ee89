"""A griffe extension for the API reference: Sphinx roles in docstrings become inline code.

The docstrings say ``:class:`~pc_pool.PoolTerminatedError``` or ``:meth:`repopulate_pool``` (Sphinx style);
mkdocstrings renders Markdown, where such a role shows up literally (":class:" followed by code). This
extension rewrites each role to inline code before the docstring is parsed: the target as written, or only its
last component after a ``~`` (Sphinx's rule). The sources keep their roles; mkdocs.yml loads this file.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

__all__ = ["SphinxRoles", "strip_roles"]

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|obj|data|const):`(~?)([^`]+)`")


def strip_roles(text: str) -> str:
    """Rewrite every Sphinx role of ``text`` to inline code (``~a.b.C`` shows as ``C``)."""
    return _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)


class SphinxRoles(griffe.Extension):
    """Strip Sphinx roles from every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the docstring of ``obj`` (module, class, function or attribute) in place."""
        if obj.docstring is not None:
            obj.docstring.value = strip_roles(obj.docstring.value)
