"""The README and the docs/ pages: every relative link and picture resolves to a file in the repository."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def relative_links(page):
    with open(page) as f:
        targets = LINK.findall(f.read())
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    links = relative_links(page)
    missing = [t for t in links if not os.path.exists(os.path.join(os.path.dirname(page), t))]
    assert not missing, f"{os.path.relpath(page, ROOT)} links to files that do not exist: {missing}"


def test_the_link_check_sees_links():
    """The check above would pass vacuously if the pattern found nothing."""
    assert len(relative_links(os.path.join(ROOT, "README.md"))) >= 5
    assert len(PAGES) >= 5
