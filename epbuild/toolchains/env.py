"""Finding a provider's toolchain: the interpreter its workers run and the site directories
its versions are read from. Never creates anything (``toolchains.create`` does) and, on the
no-op path, never starts the toolchain's Python: an environment epbuild made records its
site directories when it is made; an interpreter the user names is asked once and the
answer cached beside the environments, keyed by the interpreter's stat.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass
from epbuild.errors import ToolchainError
from epbuild.fs import atomic_write_bytes
from epbuild.toolchains.spec import FORMAT, ToolchainSpec
from epbuild.userdirs import toolchain_root as toolchain_root  # its name here too

if TYPE_CHECKING:
    from epbuild.toolchains.lockfile import EnvironmentLock

MARKER = "epbuild-toolchain.json"
"""Written last into an environment epbuild made: without it the environment is not used."""
MIN_PYTHON = (3, 10)
"""The oldest Python epbuild's worker runs on (``requires-python``)."""
QUERY = (
    "import json, os, sys; print(json.dumps({'version': list(sys.version_info[:3]), "
    "'prefix': sys.prefix, 'sites': [p for p in sys.path if p and os.path.isdir(p)]}))"
)
"""What an interpreter is asked (``python -I -c QUERY``): its version, prefix and path."""


@dataclass(frozen=True)
class Toolchain:
    """A ready toolchain: where its interpreter is and what is installed for it."""

    spec: ToolchainSpec
    python: str
    """Absolute path of the interpreter workers start with."""
    prefix: str
    """Its ``sys.prefix`` (the environment's directory)."""
    sites: tuple[str, ...]
    """Directories on its ``sys.path``: where its ``*.dist-info`` are scanned."""
    version: str
    """Its Python version, ``3.11.7``."""


def env_dir(spec: ToolchainSpec, locked: EnvironmentLock | None = None) -> str:
    """The directory of the environment a ``requirements`` spec makes: named by its
    requirements, or, made from an ``epbuild.lock`` entry, by that entry's digest."""
    return os.path.join(toolchain_root(), spec.digest() if locked is None else locked.digest())


def find(
    spec: ToolchainSpec, base_dir: str, provider: str, locked: EnvironmentLock | None = None
) -> Toolchain | None:
    """The ready toolchain for ``spec`` (``locked``: made from that lock entry); None when
    epbuild has yet to make it. Raises ``ToolchainError`` for an interpreter that does not
    exist or cannot run the worker."""
    if spec.python is not None:
        return _interpreter(spec, base_dir, provider)
    made = read_marker(spec, env_dir(spec, locked))
    if made is None and locked is not None:
        # The environment the lock was written from (same requirements) holds exactly the
        # locked versions: used as it is rather than made again.
        other = read_marker(spec, env_dir(spec))
        if other is not None and _holds(other, locked):
            return other
    return made


def _holds(toolchain: Toolchain, locked: EnvironmentLock) -> bool:
    """Whether a toolchain has exactly the locked distributions at their locked versions."""
    from epbuild.providers.distributions import installed_distributions, scanning

    with scanning(toolchain.sites):
        found = {n: v for n, (v, _site) in installed_distributions().items()}
    return found == {n: d.version for n, d in locked.distributions.items()}


def read_marker(spec: ToolchainSpec, directory: str) -> Toolchain | None:
    """The toolchain an environment's marker describes, if the marker is whole and its
    interpreter still exists."""
    try:
        with open(os.path.join(directory, MARKER), encoding="utf-8") as f:
            data = json.load(f)
        if data.get("format") != FORMAT:
            return None
        python = os.path.join(directory, data["python"])
        sites = tuple(os.path.join(directory, s) for s in data["sites"])
        version = str(data["version"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not os.path.exists(python):
        return None
    return Toolchain(spec, python, directory, sites, version)


def interpreter_path(spec: ToolchainSpec, base_dir: str, provider: str) -> str:
    """The absolute path of a ``python`` toolchain's interpreter (a path is relative to the
    manifest's directory; a bare name is looked up on PATH)."""
    assert spec.python is not None
    given = os.path.expanduser(spec.python)
    if os.sep in given or (os.altsep and os.altsep in given):
        path = os.path.join(base_dir, given)
    else:
        import shutil  # (only a toolchain naming its python: off every build's path)

        path = shutil.which(given) or os.path.join(base_dir, given)
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        what = (
            "is not executable"
            if os.path.isfile(path)
            else "is a directory, not an interpreter"
            if os.path.isdir(path)
            else "does not exist"
        )
        raise ToolchainError(
            f"provider {provider!r}: toolchain python {spec.python!r} {what}",
            hint=f"fix providers.{provider}.toolchain.python (relative to the manifest), or "
            "use toolchain = { requirements = [...] } to let epbuild make the environment",
        )
    return os.path.abspath(path)


def _interpreter(spec: ToolchainSpec, base_dir: str, provider: str) -> Toolchain:
    """A user's interpreter, asked for its path once per change of its stat."""
    python = interpreter_path(spec, base_dir, provider)
    stamp = ":".join(
        f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}" if (st := _stat(p)) else "-"
        for p in (python, os.path.join(os.path.dirname(os.path.dirname(python)), "pyvenv.cfg"))
    )  # the interpreter, and the venv configuration that decides its site directories
    memo_path = os.path.join(toolchain_root(), "interpreters.json")
    try:
        with open(memo_path, encoding="utf-8") as f:
            memo = json.load(f)
        answer = memo[python] if memo[python]["stamp"] == stamp else None
    except (OSError, ValueError, KeyError, TypeError):
        memo, answer = {}, None
    if not isinstance(memo, dict):
        memo = {}
    if answer is None:
        answer = {"stamp": stamp, **ask(python, provider)}
        memo[python] = answer
        try:
            os.makedirs(os.path.dirname(memo_path), exist_ok=True)
            atomic_write_bytes(memo_path, json.dumps(memo, indent=1).encode())
        except OSError:
            pass  # asked again next time
    version = ".".join(map(str, answer["version"]))
    return Toolchain(spec, python, answer["prefix"], tuple(answer["sites"]), version)


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def ask(python: str, provider: str) -> dict[str, Any]:
    """Run ``python -I -c QUERY`` (in its own process group, ended after 60 s); a
    ``ToolchainError`` saying what went wrong if it cannot run epbuild's worker."""
    import subprocess

    from epbuild.procs import run_group

    where = f"provider {provider!r}: toolchain python {python}"
    hint = f"check providers.{provider}.toolchain"
    try:
        proc = run_group([python, "-I", "-c", QUERY], timeout=60)
    except subprocess.TimeoutExpired:
        raise ToolchainError(f"{where} did not answer within 60 s", hint=hint) from None
    except OSError as exc:
        raise ToolchainError(f"{where} does not run: {exc.strerror or exc}", hint=hint) from None
    stdout = proc.stdout.decode("utf-8", "replace").strip()
    if proc.returncode != 0:
        lines = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        said = f": {lines[-1]}" if lines else " (no output)"
        raise ToolchainError(f"{where} exits with status {proc.returncode}{said}", hint=hint)
    try:
        answer = json.loads(stdout)
    except ValueError:
        answer = None
    if not _well_formed(answer):
        shown = stdout.splitlines()[0][:80] if stdout else "nothing"
        raise ToolchainError(
            f"{where} is not a Python interpreter epbuild can use: asked for its version, "
            f"prefix and path, it printed {shown!r}",
            hint=hint + ": point python at an interpreter (e.g. venv/bin/python)",
        )
    assert isinstance(answer, dict)
    version = tuple(answer["version"])
    if version[:2] < MIN_PYTHON:
        raise ToolchainError(
            f"provider {provider!r}: toolchain python {python} is Python "
            f"{'.'.join(map(str, version))}; epbuild's worker needs "
            f"{'.'.join(map(str, MIN_PYTHON))} or newer",
            hint=f"point providers.{provider}.toolchain.python at a newer interpreter",
        )
    return answer


def _well_formed(answer: Any) -> bool:
    """The answer to ``QUERY``: a version of integers, a prefix and a list of paths."""
    return (
        isinstance(answer, dict)
        and isinstance(answer.get("version"), list)
        and len(answer["version"]) == 3
        and all(isinstance(v, int) for v in answer["version"])
        and isinstance(answer.get("prefix"), str)
        and isinstance(answer.get("sites"), list)
        and all(isinstance(p, str) for p in answer["sites"])
    )


def same_interpreter(toolchain: Toolchain) -> bool:
    """Whether this process runs in the toolchain's environment."""
    return os.path.realpath(sys.prefix) == os.path.realpath(toolchain.prefix)
