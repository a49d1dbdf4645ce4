"""The README's and the guides' relative links name files that exist.

README.md is read on GitHub, which resolves a relative link against the file's folder; a guide is
read there and on the Sphinx site (MyST), where a link may leave out the page's suffix
(``../notebooks/quickstart``). Anchors are not checked, except that none points into a page
whose sections move (docs/performance.md, docs/design.md): link those pages at their top.
"""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDES = os.path.join(ROOT, "docs", "guides")
PAGES = ["README.md"] + sorted(f"docs/guides/{n}" for n in os.listdir(GUIDES) if n.endswith(".md"))
#: Markdown inline links, not images; code spans are removed first (they may hold brackets).
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
SUFFIXES = ("", ".md", ".ipynb", ".rst")
TOP_ONLY = ("docs/performance.md", "docs/design.md")


def links(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    text = open(os.path.join(ROOT, page)).read()
    found = links(text)
    assert found, f"{page} links nothing"
    here = os.path.dirname(os.path.join(ROOT, page))
    for target in found:
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(here, path))
        assert any(os.path.exists(full + s) for s in SUFFIXES), f"{page}: the link {target!r} names no file"
        where = os.path.relpath(full, ROOT)
        assert not (anchor and where in TOP_ONLY), f"{page}: link {where} at its top, not #{anchor}"


def test_links_ignore_code():
    assert links("see [the guide](a.md) and `x[0](y)`\n```python\n[b](c.md)\n```\n") == ["a.md"]
