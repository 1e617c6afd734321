"""Resolving the toolchains of one command's providers (see the package docstring)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from epbuild.errors import ToolchainError
from epbuild.toolchains.env import Toolchain, env_dir, find
from epbuild.toolchains.spec import ToolchainSpec

if TYPE_CHECKING:
    from epbuild.providers.contract import ProviderConfig
    from epbuild.state.sharedlock import Held
    from epbuild.toolchains.lockfile import EnvironmentLock, Lock

USE_SUFFIX = ".use"
"""Beside an environment: the lock a build holds shared for as long as it uses the
environment, and ``toolchains --prune`` takes exclusively before removing it."""

__all__ = ["Toolchain", "ToolchainPending", "Toolchains"]


class ToolchainPending(ToolchainError):
    """The environment is not made yet (only a build makes it): stale, not broken."""


class Toolchains:
    """Resolves the toolchains of one command's providers, each at most once (failures
    too, so a broken toolchain costs one attempt per build). A build (``create``) holds a
    shared lock on each environment epbuild made that it uses, until ``release``, so that
    a prune elsewhere leaves it alone."""

    def __init__(
        self,
        *,
        create: bool,
        say: Callable[[str], None] = lambda _: None,
        keys_from_lock: bool = True,
        lock_timeout: float | None = None,
    ) -> None:
        self.create = create
        """Make missing environments (a build) or report them pending (status)."""
        self.say = say
        self.keys_from_lock = keys_from_lock
        """Take the key versions of a toolchain not made yet from ``epbuild.lock``
        (``locked_versions``): restoring from the cache never makes it."""
        self.lock_timeout = lock_timeout
        """How long to wait for another process making the same thing (``--lock-timeout``;
        None: as long as it takes)."""
        self._lock = threading.Lock()
        self._done: dict[tuple[ToolchainSpec, str], Toolchain | ToolchainError] = {}
        self._locks: dict[str, Lock | None] = {}
        self._held: list[Held] = []

    def lock_of(self, base_dir: str) -> Lock | None:
        """The ``epbuild.lock`` beside the manifest in ``base_dir`` (read once), if any."""
        from epbuild.toolchains.lockfile import LOCK_NAME, read_lock

        path = os.path.join(base_dir or ".", LOCK_NAME)
        if path not in self._locks:
            self._locks[path] = read_lock(path)
        return self._locks[path]

    def locked_entry(self, config: ProviderConfig) -> EnvironmentLock | None:
        """The lock entry a ``requirements`` toolchain is made from: the provider's
        environment in ``epbuild.lock`` when the lock has its current requirements (a lock
        out of date for this provider is not used for it)."""
        spec = config.toolchain
        if spec is None or spec.python is not None:
            return None
        lock = self.lock_of(config.base_dir)
        entry = lock.providers.get(config.name) if lock is not None else None
        if lock is None or entry is None:
            return None
        env = lock.environments[entry.environment]
        return env if env.requirements == tuple(sorted(spec.requirements)) else None

    def locked_versions(self, config: ProviderConfig) -> dict[str, str] | None:
        """The key versions ``epbuild.lock`` pins for a provider whose ``requirements``
        toolchain is not made yet (it will be made from the lock, exactly), or whose EP is
        not installed in epbuild's own environment; None when keys are read from the
        environment (no current lock entry, or it is made or installed)."""
        if not self.keys_from_lock:
            return None
        if config.toolchain is None:
            return self._absent_ep_versions(config)
        locked = self.locked_entry(config)
        if locked is None or self.lookup(config) is not None:
            return None
        lock = self.lock_of(config.base_dir)
        assert lock is not None  # locked_entry found it
        return dict(lock.providers[config.name].versions)

    def _absent_ep_versions(self, config: ProviderConfig) -> dict[str, str] | None:
        """A provider in epbuild's own environment whose EP package is not installed here
        (a machine that only restores): the key versions the lock pins for it, if any."""
        from epbuild.providers import get_provider
        from epbuild.providers.distributions import dist_version

        ep_dists = get_provider(config.ep).ep_dists
        if not ep_dists or any(dist_version(d) != "absent" for d in ep_dists):
            return None
        from epbuild.toolchains.lockfile import DEFAULT_ENV

        lock = self.lock_of(config.base_dir)
        entry = lock.providers.get(config.name) if lock is not None else None
        if entry is None or entry.ep != config.ep or entry.environment != DEFAULT_ENV:
            return None
        return dict(entry.versions)

    def lookup(self, config: ProviderConfig) -> Toolchain | None:
        """The provider's toolchain if it is ready; never makes one (None: not made, or
        the provider runs in epbuild's own environment)."""
        spec = config.toolchain
        if spec is None:
            return None
        hit = self._done.get((spec, config.base_dir))
        if isinstance(hit, Toolchain):
            return hit
        return find(spec, config.base_dir, config.name, self.locked_entry(config))

    def release(self) -> None:
        """Let go of the environments this command used (the OS does it at exit, too)."""
        with self._lock:
            held, self._held = self._held, []
        for h in held:
            h.release()

    def get(self, config: ProviderConfig) -> Toolchain | None:
        """The provider's toolchain (None: it runs in epbuild's own environment)."""
        spec = config.toolchain
        if spec is None:
            return None
        memo = (spec, config.base_dir)
        with self._lock:  # one thread makes an environment; the others wait for it
            hit = self._done.get(memo)
            if hit is None:
                hit = self._resolve(spec, config)
                if not isinstance(hit, ToolchainPending):
                    self._done[memo] = hit
        if isinstance(hit, ToolchainError):
            raise hit
        return hit

    def _resolve(self, spec: ToolchainSpec, config: ProviderConfig) -> Toolchain | ToolchainError:
        try:
            locked = self.locked_entry(config)
            if self.create and spec.python is None:
                from epbuild.state import sharedlock

                # Before looking: a prune that holds it exclusively is removing it right now.
                # Made from the lock, or the one the lock was written from: both are held.
                for directory in sorted({env_dir(spec), env_dir(spec, locked)}):
                    held = sharedlock.acquire(directory + USE_SUFFIX, exclusive=False)
                    assert held is not None  # no timeout: waits for the prune to finish
                    self._held.append(held)
            found = find(spec, config.base_dir, config.name, locked)
            if found is not None:
                return found
            if not self.create:
                return ToolchainPending(
                    f"toolchain of provider {config.name!r} ({spec.label}) is not made yet",
                    hint="epbuild build makes it",
                )
            from epbuild.toolchains.create import ensure

            return ensure(
                spec, config.name, say=self.say, locked=locked, lock_timeout=self.lock_timeout
            )
        except ToolchainError as exc:
            return exc
        except OSError as exc:
            return ToolchainError(
                f"provider {config.name!r}: toolchain ({spec.label}): {exc}",
                hint="check that the per-user cache directory is writable (or set "
                "EPBUILD_TOOLCHAINS)",
            )
