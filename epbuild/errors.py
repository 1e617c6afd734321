"""One exception hierarchy for epbuild.

``UserError`` subclasses are mistakes the user can fix (exit code 2); ``BuildError``
subclasses are failures of a build (exit code 1, or a more specific code).
"""

from __future__ import annotations


class EpbuildError(Exception):
    """Root of every error epbuild raises on purpose."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message


class UserError(EpbuildError):
    """A mistake in the manifest, the arguments or the inputs (exit code 2)."""

    exit_code = 2


class UsageError(UserError):
    """The command line itself is wrong: an unknown option or command, a missing or
    malformed argument (argparse's own complaints; exit code 2)."""

    def __init__(self, message: str, *, usage: str = "", prog: str = "epbuild") -> None:
        super().__init__(message)
        self.usage = usage
        self.prog = prog


class ManifestError(UserError):
    """The manifest is invalid; names the file, line and key."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        key: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.file = file
        self.line = line
        self.key = key
        where = file or "epbuild.toml"
        if line is not None:
            where += f":{line}"
        if key:
            where += f": {key}"
        super().__init__(f"{where}: {message}", hint=hint)


class EpNameMismatchError(UserError):
    """An app registers an execution provider under another name than a package's variants
    declare, so ONNX Runtime would select none of them."""


class UnsafePathError(UserError):
    """A path is absolute, climbs out with ``..`` or leads through a symlink out of bounds."""


class ModelError(UserError):
    """A source model is missing, empty, corrupt or references bad external data."""


class ProviderUnavailableError(UserError):
    """An execution provider package or device is not available on this machine."""


class ToolchainError(UserError):
    """A provider's toolchain cannot be made or used: an interpreter that does not exist, a
    requirement pip cannot resolve, an environment without the EP. Fails that provider's
    actions only."""


class BuildError(EpbuildError):
    """A build did not complete (exit code 1)."""


class ActionFailedError(BuildError):
    """One action (compile) failed."""


class VerificationError(BuildError):
    """A built output does not pass verification."""


class NotBuiltError(BuildError):
    """An action's outputs are not what a completed build committed: never built, stale, an
    interrupted commit, or outputs missing or changed since (``epbuild build`` fixes it);
    exit code 1. ``open_action``, ``open_models`` and ``package`` raise it alike."""


OutOfDateError = NotBuiltError
"""The name ``package`` first raised it under."""


class CompatibilityError(BuildError):
    """A built context does not match the installed EP (the seed's INVALID_GRAPH case)."""


class CacheMissError(BuildError):
    """``--cache-only`` was asked for and an action is not in the cache."""


class StorageError(BuildError):
    """A file epbuild must write cannot be written: permissions, a read-only directory, a full
    disk, a file-size limit. Nothing half-written is kept or recorded."""


class LockTimeoutError(BuildError):
    """Waiting for a lock took longer than ``--lock-timeout`` (exit code 3)."""

    exit_code = 3


class Interrupted(BuildError):
    """The build was interrupted (Ctrl-C, SIGTERM, SIGHUP); exit code 130."""

    exit_code = 130


class CacheUnavailableError(BuildError):
    """A remote cache tier failed: unreachable, timed out, refused, denied. Any error of a
    remote backend becomes this one at the backend seam; a build then goes on without that
    tier (one warning), and only ``--cache-only`` fails, naming it."""
