"""What is installed where: the Python distributions of this environment or of a
toolchain's (read from ``*.dist-info`` names, never by importing them), their versions and
libraries, and what the installed onnxruntime can do."""

from __future__ import annotations

import contextvars
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_DIST_INFO: dict[tuple[str, ...] | None, dict[str, tuple[str, str]]] = {}
_SITES: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "epbuild_sites", default=None
)


def _normalise(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


@contextmanager
def scanning(sites: tuple[str, ...]) -> Iterator[None]:
    """Within the block (this thread only), ``dist_version`` and ``dist_location`` look at
    another environment's site directories (a toolchain's) instead of ``sys.path``; a
    distribution not found there is ``"absent"``: this environment's is never used."""
    token = _SITES.set(tuple(sites))
    try:
        yield
    finally:
        _SITES.reset(token)


def forget_dist_info() -> None:
    """Drop the memoised scans (installs may have changed them)."""
    _DIST_INFO.clear()


def _scan_dist_info() -> dict[str, tuple[str, str]]:
    """Normalised distribution name → (version, site directory), from ``*.dist-info`` names.

    One ``listdir`` per ``sys.path`` entry (or per site directory of the environment
    ``scanning`` names): far cheaper than importing importlib.metadata, and this runs on
    every no-op build. The first directory wins, as for imports.
    """
    sites = _SITES.get()
    found = _DIST_INFO.get(sites)
    if found is None:
        found = {}
        for directory in sys.path if sites is None else sites:
            try:
                names = os.listdir(directory or ".")
            except OSError:
                continue
            for entry in names:
                if entry.endswith(".dist-info") and "-" in entry:
                    name, _, version = entry[: -len(".dist-info")].partition("-")
                    found.setdefault(_normalise(name), (version, directory))
        _DIST_INFO[sites] = found
    return found


def canonical_name(name: str) -> str:
    """A distribution's name as the lock writes it (PEP 503: ``onnxruntime-qnn``)."""
    return name.lower().replace("_", "-").replace(".", "-")


def installed_distributions() -> dict[str, tuple[str, str]]:
    """Every distribution the fast scan finds (this environment's, or within ``scanning``
    another's): canonical name → (version, site directory)."""
    return {canonical_name(n): hit for n, hit in sorted(_scan_dist_info().items())}


def shared_library(site: str, package: str, stem: str) -> str:
    """The path of a package's shared library ``stem`` as this platform names it."""
    if sys.platform == "win32":
        name = f"{stem}.dll"
    elif sys.platform == "darwin":
        name = f"lib{stem}.dylib"
    else:
        name = f"lib{stem}.so"
    return os.path.join(site, package, name)


def dist_location(dist: str) -> str | None:
    """The site directory a distribution is installed in, if found by the fast scan."""
    hit = _scan_dist_info().get(_normalise(dist))
    return hit[1] if hit else None


def dist_version(dist: str) -> str:
    """Installed version of a distribution, or ``"absent"``; never imports it."""
    hit = _scan_dist_info().get(_normalise(dist))
    if hit is not None:
        return hit[0]
    if _SITES.get() is not None:
        return "absent"  # another environment: this one's metadata says nothing about it
    import importlib.metadata  # slow path: egg-info and other layouts

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


ORT_DISTS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino", "onnxruntime-directml")
"""Distributions that install ONNX Runtime itself (plugin EP packages do not)."""
COMPILE_API_SINCE = (1, 23)
"""``onnxruntime.ModelCompiler`` came in 1.22; its ``flags`` (``ERROR_IF_NO_NODES_COMPILED``)
and ``graph_optimization_level``, which epbuild passes, in 1.23 (microsoft/onnxruntime#24695
and #25474)."""


def onnxruntime_version() -> str:
    """Version of the installed ONNX Runtime (any of ``ORT_DISTS``), or ``"absent"``."""
    for dist in ORT_DISTS:
        hit = _scan_dist_info().get(_normalise(dist))
        if hit is not None:
            return hit[0]
    return dist_version(ORT_DISTS[0])  # slow path: egg-info and other layouts


def has_compile_api(version: str | None = None) -> bool:
    """Whether ONNX Runtime ``version`` (default: the installed one) has the compile API
    epbuild uses; decided from the version alone, without importing onnxruntime."""
    import re

    match = re.match(r"(\d+)\.(\d+)", version or onnxruntime_version())
    return match is not None and (int(match[1]), int(match[2])) >= COMPILE_API_SINCE
