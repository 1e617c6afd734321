"""What a provider table's ``toolchain`` asks for: packages to install, or an interpreter.

Pure data, read by the manifest loader and carried on ``ProviderConfig``; resolving it into a
usable environment is ``toolchains.env`` (find, never create) and ``toolchains.create``.
"""

from __future__ import annotations

import json
import sys

from epbuild._dataclass import dataclass
from epbuild.fs import sha256_hex

FORMAT = 1
"""Layout version of an environment epbuild creates; bump it to stop trusting old ones."""


@dataclass(frozen=True)
class ToolchainSpec:
    """``toolchain = { requirements = [...] }`` or ``toolchain = { python = "..." }``."""

    requirements: tuple[str, ...] = ()
    """pip requirement specifiers epbuild installs into an environment of its own."""
    python: str | None = None
    """An interpreter the user provides (a path, relative to the manifest, or a command)."""

    @property
    def label(self) -> str:
        """How messages name it: the requirements, or the interpreter."""
        if self.python is not None:
            return f"python {self.python}"
        return ", ".join(self.requirements)

    def digest(self) -> str:
        """Content address of the environment ``requirements`` make on this interpreter and
        platform (order and spelling of the list as normalised by ``normalise``)."""
        import platform  # here: most builds have no toolchain to address

        data = {
            "format": FORMAT,
            "requirements": sorted(self.requirements),
            "python": f"{sys.implementation.name}-{sys.version_info[0]}.{sys.version_info[1]}",
            "platform": f"{sys.platform}-{platform.machine()}",
        }
        blob = json.dumps(data, sort_keys=True).encode()
        return sha256_hex(blob)[:16]

    def key(self) -> dict[str, object]:
        """The part of an action key it contributes besides the versions it resolves to:
        the requirements (a changed pin stales the actions before the new environment is
        even made); an interpreter path is machine-specific and stays out."""
        if self.python is not None:
            return {"python": True}
        return {"requirements": sorted(self.requirements)}


def normalise(requirement: str) -> str:
    """A requirement with its whitespace collapsed (``onnx >= 1.17`` → ``onnx>=1.17``)."""
    return "".join(requirement.split())
