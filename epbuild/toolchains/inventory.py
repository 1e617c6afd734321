"""What the toolchain directory holds, and removing what a workspace no longer uses.

Environments are a cache: removing one costs only the time to make it again on the next
build that needs it. ``prune`` removes each environment under its own lock (never one being
made), half-made ones included, and the worker copies of other epbuild versions — but never
one a running build uses: a build holds the environment's ``.use`` lock shared for as long
as it uses it (``resolve.Toolchains``), prune takes it exclusively or skips the environment.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from typing import Any

from epbuild._dataclass import asdict, dataclass, field
from epbuild.state import locks, sharedlock
from epbuild.toolchains.boot import worker_path
from epbuild.toolchains.env import MARKER, toolchain_root
from epbuild.toolchains.resolve import USE_SUFFIX


@dataclass
class Environment:
    """One environment epbuild made (or began to make)."""

    digest: str
    path: str
    ready: bool
    """Its marker is there: complete and usable."""
    size: int
    requirements: list[str] = field(default_factory=list)
    installer: str | None = None
    python: str | None = None
    used_by: list[str] = field(default_factory=list)
    """Providers of the current manifest that use it."""

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` form."""
        return asdict(self)


def _size(path: str) -> int:
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def inventory(used: dict[str, list[str]] | None = None) -> list[Environment]:
    """The environments under ``toolchain_root()``; ``used`` maps digest → providers."""
    root, used = toolchain_root(), used or {}
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(root, name)
        if name.startswith("worker-") or not os.path.isdir(path) or "." in name:
            continue
        env = Environment(name, path, False, _size(path), used_by=used.get(name, []))
        try:
            with open(os.path.join(path, MARKER), encoding="utf-8") as f:
                marker = json.load(f)
            env.ready = True
            env.requirements = list(marker.get("requirements", []))
            env.installer, env.python = marker.get("installer"), marker.get("version")
        except (OSError, ValueError, AttributeError):
            pass
        found.append(env)
    return found


@dataclass(frozen=True)
class Pruned:
    """What ``prune`` did."""

    removed: list[str]
    """Paths removed."""
    busy: list[str]
    """Environments left alone: a running build uses one, or one is being made."""


_PRUNING = "epbuild toolchains --prune"


def prune(keep: Iterable[str]) -> Pruned:
    """Remove every environment whose digest is not in ``keep`` — unless a build uses it or
    is making it — and the worker copies of other epbuild versions."""
    kept, removed, busy = set(keep), [], []
    for env in inventory():
        if env.digest in kept:
            continue
        use = sharedlock.acquire(env.path + USE_SUFFIX, exclusive=True, timeout=0)
        if use is None:
            busy.append(env.path)  # a running build uses it
            continue
        try:
            with locks.try_hold(env.path + ".lock", _PRUNING, note=False) as held:
                if held is None:
                    busy.append(env.path)  # another epbuild is making it right now
                    continue
                shutil.rmtree(env.path, ignore_errors=True)
                removed.append(env.path)
        finally:
            use.release()
    current, root = worker_path(), toolchain_root()
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not name.startswith("worker-") or path == current or not os.path.isdir(path):
            continue
        if ".tmp-" in name and _maker_alive(name):
            continue  # another epbuild is copying itself there right now
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    ends = (".log", ".lock", USE_SUFFIX)
    strays = {n.rsplit(".", 1)[0] for n in os.listdir(root) if n.endswith(ends)}
    for digest in sorted(strays - kept):
        _remove_stray(os.path.join(root, digest))
    return Pruned(removed, busy)


def _maker_alive(name: str) -> bool:
    """Whether the process named in a worker copy's temporary name
    (``worker-<digest>.tmp-<pid>-<random>``) still runs on this host."""
    pid = name.rpartition(".tmp-")[2].partition("-")[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists (another user's)
    return True


def _remove_stray(env: str) -> None:
    """The log and lock files of an environment that is gone (a failed attempt, a pruned
    one), unless it is being made or a build is about to use it right now."""
    if os.path.isdir(env):
        return
    use = sharedlock.acquire(env + USE_SUFFIX, exclusive=True, timeout=0)
    if use is None:
        return
    try:
        with locks.try_hold(env + ".lock", _PRUNING, note=False) as held:
            if held is None:
                return
            for path in (env + ".log", env + ".lock", env + USE_SUFFIX):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass  # another prune took it
    finally:
        use.release()
