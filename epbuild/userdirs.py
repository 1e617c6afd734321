"""The per-user directories epbuild keeps things in (a bottom module: plain paths, no
imports of epbuild): the cache directory and the toolchain environments under it."""

from __future__ import annotations

import os
import sys


def default_cache_dir() -> str:
    """The per-user cache directory for epbuild."""
    home = os.path.expanduser("~")
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.join(home, "AppData", "Local")
        return os.path.join(base, "epbuild", "Cache")
    if sys.platform == "darwin":
        return os.path.join(home, "Library", "Caches", "epbuild")
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(home, ".cache")
    return os.path.join(base, "epbuild")


def toolchain_root() -> str:
    """Where provider toolchains' environments are made (``$EPBUILD_TOOLCHAINS``, else
    ``toolchains`` in the per-user cache directory)."""
    return os.environ.get("EPBUILD_TOOLCHAINS") or os.path.join(default_cache_dir(), "toolchains")
