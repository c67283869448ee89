"""Check a built documentation site: no doctest prompt (``>>>``) may end up inside a blockquote.

A Google-style docstring section that griffe does not know (``Example:`` instead of ``Examples:``) becomes an
admonition whose Markdown reads each ``>>>`` as three blockquote markers: the example renders as three nested
blockquotes with its lines merged into one paragraph, and the prompt itself disappears. So two things are
reported: a ``>>>`` inside a blockquote, and any text three blockquotes deep (what a ``>>>`` line becomes).
Examples belong in ``Examples:`` sections, which mkdocstrings renders as code blocks.

It also reports Sphinx roles left in the text (``:class:`` followed by code), which docs/hooks/
griffe_sphinx_roles.py rewrites to inline code for the API reference.

Run ``python tests-integration/integration_docs_site.py site/`` after ``mkdocs build`` (``nox -s docs`` does);
it exits with status 1 and names every offending page.
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

__all__ = ["find_quoted_prompts", "find_sphinx_roles", "main"]

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|obj|data|const):")


class _QuotedPrompts(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth = 0
        self.code = 0
        self.found: list[str] = []
        self.roles: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "blockquote":
            self.depth += 1
        elif tag in ("code", "pre"):
            self.code += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "blockquote" and self.depth:
            self.depth -= 1
        elif tag in ("code", "pre") and self.code:
            self.code -= 1

    def handle_data(self, data: str) -> None:
        text = " ".join(data.split())
        if text and (self.depth >= 3 or (self.depth and ">>>" in text)):
            self.found.append(text[:120])
        if not self.code and _ROLE.search(text):
            self.roles.append(text[:120])


def find_quoted_prompts(html: str) -> list[str]:
    """Text (whitespace collapsed, cut at 120 characters) that is a doctest rendered as a blockquote.

    That is every text holding ``>>>`` inside a ``<blockquote>``, and every text three blockquotes deep.
    """
    parser = _QuotedPrompts()
    parser.feed(html)
    parser.close()
    return parser.found


def find_sphinx_roles(html: str) -> list[str]:
    """Text (outside code) that still holds a Sphinx role such as ``:class:``."""
    parser = _QuotedPrompts()
    parser.feed(html)
    parser.close()
    return parser.roles


def main(argv: list[str]) -> int:
    """Check every HTML page under the site directory ``argv[0]``; print the offenders; 0 when clean."""
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: integration_docs_site.py SITE_DIR", file=sys.stderr)
        return 2
    pages = sorted(Path(argv[0]).rglob("*.html"))
    if not pages:
        print(f"no HTML pages under {argv[0]}", file=sys.stderr)
        return 2
    bad = 0
    for page in pages:
        html = page.read_text(encoding="utf-8")
        for text in find_quoted_prompts(html):
            print(f"{page}: doctest prompt in a blockquote: {text}", file=sys.stderr)
            bad += 1
        for text in find_sphinx_roles(html):
            print(f"{page}: Sphinx role rendered as text: {text}", file=sys.stderr)
            bad += 1
    print(f"checked {len(pages)} pages: {bad} problems (doctests inside blockquotes, Sphinx roles as text)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
