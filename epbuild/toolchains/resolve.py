"""Resolving the toolchains of one command's providers (see the package docstring)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from epbuild.errors import ToolchainError
from epbuild.toolchains.env import Toolchain, env_dir, find
from epbuild.toolchains.spec import ToolchainSpec

if TYPE_CHECKING:
    from epbuild.providers.base import ProviderConfig
    from epbuild.state.sharedlock import Held

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

    def __init__(self, *, create: bool, say: Callable[[str], None] = lambda _: None) -> None:
        self.create = create
        """Make missing environments (a build) or report them pending (status)."""
        self.say = say
        self._lock = threading.Lock()
        self._done: dict[tuple[ToolchainSpec, str], Toolchain | ToolchainError] = {}
        self._held: list[Held] = []

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
            if self.create and spec.python is None:
                from epbuild.state import sharedlock

                # Before looking: a prune that holds it exclusively is removing it right now.
                held = sharedlock.acquire(env_dir(spec) + USE_SUFFIX, exclusive=False)
                assert held is not None  # no timeout: waits for the prune to finish
                self._held.append(held)
            found = find(spec, config.base_dir, config.name)
            if found is not None:
                return found
            if not self.create:
                return ToolchainPending(
                    f"toolchain of provider {config.name!r} ({spec.label}) is not made yet",
                    hint="epbuild build makes it",
                )
            from epbuild.toolchains.create import ensure

            return ensure(spec, config.name, say=self.say)
        except ToolchainError as exc:
            return exc
        except OSError as exc:
            return ToolchainError(
                f"provider {config.name!r}: toolchain ({spec.label}): {exc}",
                hint="check that the per-user cache directory is writable (or set "
                "EPBUILD_TOOLCHAINS)",
            )
