"""Gathering ``epbuild.lock`` from this machine, and comparing the two.

``gather`` reads every environment a manifest's providers compile in (package metadata
only: nothing is imported or started, except pip asked for a toolchain's artifact hashes);
``outdated`` says why a lock no longer fits its manifest (a provider or toolchain changed);
``drift`` says how the environments differ from it (``build --locked``).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterable

from epbuild.errors import ToolchainError
from epbuild.manifest.model import Manifest
from epbuild.providers import get_provider
from epbuild.providers.contract import ProviderConfig
from epbuild.providers.distributions import canonical_name, installed_distributions, scanning
from epbuild.providers.library import KEY as LIBRARY_KEY
from epbuild.providers.library import library_sha256
from epbuild.toolchains.env import Toolchain
from epbuild.toolchains.lockfile import (
    DEFAULT_ENV,
    Distribution,
    EnvironmentLock,
    Lock,
    LockError,
    ProviderLock,
)
from epbuild.toolchains.resolve import Toolchains

SEEDS = frozenset({"pip", "setuptools", "wheel"})
"""What a new virtual environment brings by itself: locked by version, never installed."""


def machine_platform() -> str:
    """``linux-x86_64``: what a lock's environments were made on."""
    return f"{sys.platform}-{platform.machine().lower()}"


def environment_names(manifest: Manifest) -> dict[str, str]:
    """Provider → the name of its environment in the lock: ``epbuild``, or (for a
    toolchain) the first provider, by name, that uses the same toolchain."""
    first: dict[object, str] = {}
    names: dict[str, str] = {}
    for name in sorted(manifest.providers):
        spec = manifest.providers[name].toolchain
        names[name] = DEFAULT_ENV if spec is None else first.setdefault(spec, name)
    return names


def gather(manifest: Manifest, toolchains: Toolchains) -> Lock:
    """The lock of ``manifest``'s providers as installed now (``toolchains`` may make
    missing environments)."""
    from epbuild.planning.keys import read_versions

    toolchains.keys_from_lock = False  # read every environment as it is
    lock = Lock()
    names = environment_names(manifest)
    for name in sorted(manifest.providers):
        cfg = manifest.providers[name]
        env_name = names[name]
        toolchain = toolchains.get(cfg)
        if env_name not in lock.environments:
            lock.environments[env_name] = _environment(env_name, cfg, toolchain)
        versions = read_versions(cfg, toolchains)
        library, digest = _library(cfg, toolchain)
        lock.providers[name] = ProviderLock(name, cfg.ep, env_name, versions, library, digest)
    return lock


def _environment(name: str, cfg: ProviderConfig, toolchain: Toolchain | None) -> EnvironmentLock:
    if toolchain is None:
        found = installed_distributions()
        dists = {n: Distribution(v) for n, (v, _site) in found.items()}
        return EnvironmentLock(name, platform.python_version(), machine_platform(), dists)
    spec = toolchain.spec
    with scanning(toolchain.sites):
        found = installed_distributions()
    if spec.python is not None:
        dists = {n: Distribution(v) for n, (v, _site) in found.items()}
        return EnvironmentLock(
            name, toolchain.version, machine_platform(), dists, interpreter=spec.python
        )
    hashes = resolved_hashes(toolchain, {n: v for n, (v, _s) in found.items()}, cfg.name)
    dists = {n: Distribution(v, hashes.get(n)) for n, (v, _site) in found.items()}
    reqs = tuple(sorted(spec.requirements))
    return EnvironmentLock(name, toolchain.version, machine_platform(), dists, requirements=reqs)


def resolved_hashes(
    toolchain: Toolchain, installed: dict[str, str], provider: str
) -> dict[str, str]:
    """Distribution → sha256 of the artifact pip resolves for a toolchain's requirements,
    pinned to the versions installed in it (``pip install --dry-run --report``: metadata
    and, where an index gives no hash, the artifact are downloaded, nothing installed)."""
    pins = [f"{n}=={v}" for n, v in sorted(installed.items()) if n not in SEEDS]
    with tempfile.TemporaryDirectory(prefix="epbuild-lock-") as tmp:
        constraints, report = os.path.join(tmp, "pins.txt"), os.path.join(tmp, "report.json")
        with open(constraints, "w", encoding="utf-8") as f:
            f.write("\n".join(pins) + "\n")
        argv = [
            *_pip(toolchain, installed),
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--disable-pip-version-check",
            "--report",
            report,
            "--constraint",
            constraints,
            *toolchain.spec.requirements,
        ]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
            with open(report, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            tail = ""
            if "proc" in locals():
                tail = (proc.stderr.strip().splitlines() or [""])[-1]
            raise ToolchainError(
                f"provider {provider!r}: pip could not resolve its toolchain's artifact "
                f"hashes ({toolchain.spec.label}): {tail or exc}",
                hint="check that the package index is reachable, then run epbuild lock again",
            ) from exc
    hashes: dict[str, str] = {}
    for item in data.get("install", []):
        info = item.get("download_info", {}).get("archive_info", {})
        digest = info.get("hashes", {}).get("sha256")
        if digest:
            hashes[canonical_name(item["metadata"]["name"])] = digest
    return hashes


def _pip(toolchain: Toolchain, installed: dict[str, str]) -> list[str]:
    """The toolchain's own pip, else this environment's pointed at it (``--python``)."""
    if "pip" in installed:
        return [toolchain.python, "-m", "pip"]
    return [sys.executable, "-m", "pip", "--python", toolchain.python]


def _library(cfg: ProviderConfig, toolchain: Toolchain | None) -> tuple[str | None, str | None]:
    """The EP library (relative to the site directory holding it, else to the manifest's
    directory) and its sha256; (None, None) when the EP has no library file of its own."""
    adapter = get_provider(cfg.ep)
    finder = adapter.library_path
    if toolchain is None:
        path = finder(cfg)
        sites: Iterable[str] = sys.path
    else:
        with scanning(toolchain.sites):
            path = finder(cfg)
        sites = toolchain.sites
    if path is None or not os.path.isfile(path):
        return None, None
    full = os.path.abspath(path)
    rel = os.path.relpath(full, os.path.abspath(cfg.base_dir or "."))
    inside = [
        os.path.abspath(s) for s in sites if s and full.startswith(os.path.abspath(s) + os.sep)
    ]
    if inside:  # the deepest: "" on sys.path is the current directory
        rel = os.path.relpath(full, max(inside, key=len))
    return rel.replace(os.sep, "/"), library_sha256(full)


def outdated(lock: Lock, manifest: Manifest) -> list[str]:
    """Why the lock no longer describes the manifest's providers (empty: it does)."""
    reasons: list[str] = []
    names = environment_names(manifest)
    for name in sorted(set(lock.providers) - set(manifest.providers)):
        reasons.append(f"provider {name} is locked but no longer in the manifest")
    for name in sorted(manifest.providers):
        cfg, locked = manifest.providers[name], lock.providers.get(name)
        if locked is None:
            reasons.append(f"provider {name} is not in the lock")
            continue
        if locked.ep != cfg.ep:
            reasons.append(f"provider {name}: ep {locked.ep} (lock) ≠ {cfg.ep} (manifest)")
        env = lock.environments[locked.environment]
        spec = cfg.toolchain
        if spec is None and (env.requirements is not None or env.interpreter is not None):
            reasons.append(f"provider {name}: its toolchain was removed from the manifest")
        elif spec is not None and spec.python is not None and env.interpreter != spec.python:
            reasons.append(f"provider {name}: toolchain python changed")
        elif spec is not None and spec.python is None:
            if env.requirements != tuple(sorted(spec.requirements)):
                was = ", ".join(env.requirements or ()) or "none"
                reasons.append(
                    f"provider {name}: toolchain requirements {was} (lock) ≠ "
                    f"{', '.join(sorted(spec.requirements))} (manifest)"
                )
        elif spec is not None and locked.environment != names[name]:
            reasons.append(f"provider {name}: its toolchain changed")
    return reasons


def check_current(lock: Lock, manifest: Manifest, path: str) -> None:
    """Raise ``LockError`` when the lock is out of date with the manifest (named by its file
    name: it is always beside the manifest)."""
    reasons = outdated(lock, manifest)
    if reasons:
        raise LockError(
            f"{os.path.basename(path)} is out of date with the manifest: " + "; ".join(reasons),
            hint="run epbuild lock to write it again, and commit it",
        )


def drift(
    lock: Lock, manifest: Manifest, toolchains: Toolchains, providers: Iterable[str]
) -> list[str]:
    """How the environments ``providers`` compile in differ from the lock: each a line like
    ``onnxruntime-qnn 2.7.0 (lock) ≠ 2.8.0 (installed)``; empty when they match."""
    from epbuild.planning.keys import read_versions

    lines: list[str] = []
    seen_envs: set[str] = set()
    for name in sorted(set(providers)):
        cfg, locked = manifest.providers[name], lock.providers[name]
        where = f"provider {name}"
        versions = read_versions(cfg, toolchains)
        for key in sorted(set(locked.versions) | set(versions)):
            a, b = locked.versions.get(key, "absent"), versions.get(key, "absent")
            if a != b:
                if key == LIBRARY_KEY:  # a digest: its head tells them apart
                    key, a, b = f"EP library {locked.library or ''} sha256", a[:12], b[:12]
                lines.append(f"{where}: {key} {a} (lock) ≠ {b} (installed)")
        toolchain = toolchains.lookup(cfg)
        if toolchain is None or locked.environment in seen_envs:
            # epbuild's own environment: its providers' versions are compared above; a
            # toolchain not made yet: it will be made from the lock, hashes checked
            continue
        seen_envs.add(locked.environment)
        with scanning(toolchain.sites):
            found = {n: v for n, (v, _s) in installed_distributions().items()}
        env = lock.environments[locked.environment]
        for dist in sorted(set(env.distributions) | set(found)):
            a = env.distributions[dist].version if dist in env.distributions else "absent"
            b = found.get(dist, "absent")
            if a != b:
                lines.append(f"toolchain {locked.environment}: {dist} {a} (lock) ≠ {b} (installed)")
    return lines


def enforce(
    lock: Lock | None,
    path: str,
    manifest: Manifest,
    toolchains: Toolchains,
    providers: Iterable[str],
) -> None:
    """``--locked``: raise ``LockError`` (exit 2) unless there is a lock, it fits the
    manifest and the environments match it."""
    if lock is None:
        raise LockError(
            f"--locked: there is no {os.path.basename(path)} beside the manifest",
            hint="run epbuild lock on the machine whose build is the reference, and commit it",
        )
    check_current(lock, manifest, path)
    lines = drift(lock, manifest, toolchains, providers)
    if lines:
        raise LockError(
            f"--locked: the environment differs from {os.path.basename(path)}:\n    "
            + "\n    ".join(lines),
            hint="install the locked versions (or run epbuild lock to accept these, and commit "
            "the lock)",
        )
