"""Where the documentation lives: the addresses of its pages, for hints and ``--help``.

A hint names the site's page rather than a path in the repository, so that it works for a
user who installed epbuild with pip. ``mkdocs.yml``'s ``site_url`` is this ``SITE_URL`` (a
test holds them equal, and every page and anchor a hint names to an existing one).
Standard library only: imported on the no-op fast path.
"""

from __future__ import annotations

SITE_URL = "https://epbuild.readthedocs.io/en/latest/"


def page_url(page: str, anchor: str = "") -> str:
    """The address of ``page`` (a path under ``docs/``, e.g. ``troubleshooting.md``) on the
    site, at ``anchor`` if given (mkdocs' directory URLs: ``troubleshooting/``)."""
    path = page.removesuffix(".md")
    path = "" if path == "index" else path.removesuffix("/index") + "/"
    return SITE_URL + path + (f"#{anchor}" if anchor else "")
