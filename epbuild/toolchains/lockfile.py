"""``epbuild.lock``: the environments a workspace compiles in, pinned (pure data).

Written by ``epbuild lock`` beside the manifest (``planning.lock`` gathers it), reviewed in
diffs, committed. One ``[environments.<name>]`` table per environment (``epbuild``: the one
epbuild runs in; a toolchain: named after the first provider using it) with its Python,
platform and every distribution's version (a toolchain's with the sha256 of the artifact
pip resolved), and one ``[providers.<name>]`` table per provider with the versions that go
into its action keys and the EP library file with its sha256. Everything is sorted, so the
same environments always give the same bytes.
"""

from __future__ import annotations

import json
import os
from typing import Any

from epbuild._dataclass import dataclass, field
from epbuild.errors import UserError
from epbuild.fs import sha256_hex

LOCK_NAME = "epbuild.lock"
FORMAT = 1
"""Layout version of the lock file."""
DEFAULT_ENV = "epbuild"
"""The environment epbuild itself runs in (providers without a ``toolchain``)."""
HEADER = (
    "# epbuild.lock: written by `epbuild lock`; commit it. `epbuild build --locked` (or\n"
    "# EPBUILD_LOCKED=1) refuses to compile or restore in an environment that differs.\n"
)


class LockError(UserError):
    """The lock file is unreadable, out of date with the manifest, or the environment
    differs from it (exit code 2)."""


@dataclass(frozen=True)
class Distribution:
    """One installed distribution: its version and, where pip resolved it, its artifact's
    sha256 (a toolchain epbuild makes)."""

    version: str
    sha256: str | None = None


@dataclass
class EnvironmentLock:
    """One Python environment: epbuild's own, or a provider's toolchain."""

    name: str
    python: str
    """Its full Python version, ``3.11.7``."""
    platform: str
    """``sys.platform``-machine, ``linux-x86_64``."""
    distributions: dict[str, Distribution] = field(default_factory=dict)
    """Canonical distribution name (``onnxruntime-qnn``) → version (and hash)."""
    requirements: tuple[str, ...] | None = None
    """A ``requirements`` toolchain's requirements (sorted); None otherwise."""
    interpreter: str | None = None
    """A ``python`` toolchain's interpreter, as the manifest names it; None otherwise."""

    def digest(self) -> str:
        """Content address of the locked set: names the environment a lock makes."""
        data = {
            "requirements": list(self.requirements or ()),
            "python": ".".join(self.python.split(".")[:2]),
            "platform": self.platform,
            "distributions": {n: [d.version, d.sha256] for n, d in self.distributions.items()},
        }
        blob = json.dumps(data, sort_keys=True).encode()
        return "lock-" + sha256_hex(blob)[:16]


@dataclass
class ProviderLock:
    """One provider: where it compiles and what it compiles with."""

    name: str
    ep: str
    environment: str
    versions: dict[str, str] = field(default_factory=dict)
    """Exactly the versions its action keys hold (ONNX Runtime, the EP, the SDK, ...)."""
    library: str | None = None
    """The EP library file that compiles, relative to its site directory (or to the
    manifest's directory); None where the EP has none of its own."""
    library_sha256: str | None = None


@dataclass
class Lock:
    """A whole ``epbuild.lock``."""

    environments: dict[str, EnvironmentLock] = field(default_factory=dict)
    providers: dict[str, ProviderLock] = field(default_factory=dict)

    def to_toml(self) -> str:
        """The file's text (stable: sorted everywhere)."""
        import tomlkit

        doc = tomlkit.document()
        doc.add(tomlkit.comment(HEADER.splitlines()[0][2:]))
        doc.add(tomlkit.comment(HEADER.splitlines()[1][2:]))
        doc.add("format", FORMAT)
        envs = tomlkit.table(is_super_table=True)
        for name in sorted(self.environments):
            envs.add(name, _env_table(self.environments[name]))
        doc.add(tomlkit.nl())
        doc.add("environments", envs)
        provs = tomlkit.table(is_super_table=True)
        for name in sorted(self.providers):
            provs.add(name, _provider_table(self.providers[name]))
        doc.add("providers", provs)
        return tomlkit.dumps(doc)

    @classmethod
    def from_toml(cls, text: str, path: str = LOCK_NAME) -> Lock:
        """Parse a lock file's text; a ``LockError`` naming the file for anything malformed."""
        import tomlkit

        try:
            data: dict[str, Any] = tomlkit.parse(text).unwrap()
        except Exception as exc:  # tomlkit's parse errors share no useful base class
            raise LockError(f"{path}: not valid TOML: {exc}", hint=_REWRITE) from exc
        if data.get("format") != FORMAT:
            raise LockError(
                f"{path}: lock format {data.get('format')!r}, this epbuild reads {FORMAT}",
                hint=_REWRITE,
            )
        try:
            envs = {n: _env_from(n, t) for n, t in data.get("environments", {}).items()}
            provs = {n: _provider_from(n, t) for n, t in data.get("providers", {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LockError(f"{path}: malformed entry ({exc!r})", hint=_REWRITE) from exc
        for p in provs.values():
            if p.environment not in envs:
                raise LockError(
                    f"{path}: providers.{p.name}.environment names {p.environment!r}, "
                    "which has no [environments] table",
                    hint=_REWRITE,
                )
        return cls(envs, provs)


_REWRITE = "run epbuild lock to write it again"


def lock_path(manifest_path: str | os.PathLike[str]) -> str:
    """Where the lock of a manifest lives: beside it."""
    return os.path.join(os.path.dirname(os.path.abspath(manifest_path)), LOCK_NAME)


def read_lock(path: str) -> Lock | None:
    """The lock at ``path``; None when there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LockError(f"{path}: cannot read: {exc.strerror}") from exc
    return Lock.from_toml(text, path)


def _env_table(env: EnvironmentLock) -> Any:
    import tomlkit

    t = tomlkit.table()
    t.add("python", env.python)
    t.add("platform", env.platform)
    if env.requirements is not None:
        t.add("requirements", list(env.requirements))
        t.add("digest", env.digest())
    if env.interpreter is not None:
        t.add("interpreter", env.interpreter)
    dists = tomlkit.table()
    for name in sorted(env.distributions):
        d = env.distributions[name]
        if d.sha256 is None:
            dists.add(name, d.version)
        else:
            inline = tomlkit.inline_table()
            inline.update({"version": d.version, "sha256": d.sha256})
            dists.add(name, inline)
    t.add("distributions", dists)
    return t


def _env_from(name: str, t: dict[str, Any]) -> EnvironmentLock:
    dists = {}
    for dist, value in t.get("distributions", {}).items():
        if isinstance(value, str):
            dists[dist] = Distribution(value)
        else:
            dists[dist] = Distribution(str(value["version"]), value.get("sha256"))
    reqs = t.get("requirements")
    return EnvironmentLock(
        name=name,
        python=str(t["python"]),
        platform=str(t["platform"]),
        distributions=dists,
        requirements=tuple(str(r) for r in reqs) if reqs is not None else None,
        interpreter=t.get("interpreter"),
    )


def _provider_table(p: ProviderLock) -> Any:
    import tomlkit

    t = tomlkit.table()
    t.add("ep", p.ep)
    t.add("environment", p.environment)
    if p.library is not None:
        t.add("library", p.library)
        t.add("library_sha256", p.library_sha256 or "")
    versions = tomlkit.table()
    for name in sorted(p.versions):
        versions.add(name, p.versions[name])
    t.add("versions", versions)
    return t


def _provider_from(name: str, t: dict[str, Any]) -> ProviderLock:
    return ProviderLock(
        name=name,
        ep=str(t["ep"]),
        environment=str(t["environment"]),
        versions={str(k): str(v) for k, v in t.get("versions", {}).items()},
        library=t.get("library"),
        library_sha256=t.get("library_sha256"),
    )
