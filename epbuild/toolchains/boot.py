"""How a toolchain's interpreter runs epbuild's worker without epbuild installed in it.

epbuild's own package (pure Python, ``.py`` files only) is copied once per epbuild version
into ``toolchain_root()/worker-<digest>``, content-addressed and made by an atomic rename.
The toolchain's Python starts isolated (``-I``: no ``PYTHONPATH``, no user site, not the
current directory) with only that copy put in front of its own ``sys.path``: the worker
imports onnxruntime and everything else from the toolchain, nothing from the environment
epbuild runs in. The worker needs only the standard library and ONNX Runtime.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading

from epbuild.fs import new_directory
from epbuild.toolchains.env import toolchain_root

_lock = threading.Lock()
_made: dict[str, str] = {}


def _package_dir() -> str:
    """The ``epbuild`` package directory (this file is in ``epbuild/toolchains``)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sources(package: str) -> list[str]:
    """Package-relative paths of epbuild's ``.py`` files, sorted."""
    found = []
    for folder, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(folder, package)
        found += [os.path.normpath(os.path.join(rel, f)) for f in files if f.endswith(".py")]
    return sorted(found)


def worker_path() -> str:
    """The directory holding this epbuild's copy (made if needed) for toolchain workers."""
    package = _package_dir()
    with _lock:
        if package in _made:
            return _made[package]
        files = _sources(package)
        digest = hashlib.sha256()
        for rel in files:
            with open(os.path.join(package, rel), "rb") as f:
                digest.update(rel.encode() + b"\0" + f.read() + b"\0")
        final = os.path.join(toolchain_root(), f"worker-{digest.hexdigest()[:16]}")
        if not os.path.isdir(final):
            _copy(package, files, final)
        _made[package] = final
        return final


def _copy(package: str, files: list[str], final: str) -> None:
    with new_directory(final) as temp:
        for rel in files:
            target = os.path.join(temp, "epbuild", rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(package, rel), target)


def boot_command(python: str, module: str = "epbuild.executors.worker") -> list[str]:
    """The command that runs ``module``'s ``main()`` (by default the compile worker) in a
    toolchain whose interpreter is ``python``."""
    path = worker_path()
    code = f"import sys; sys.path.insert(0, {path!r}); from {module} import main; main()"
    return [python, "-I", "-c", code]
