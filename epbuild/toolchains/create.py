"""Making the environment a ``requirements`` toolchain names, once per machine.

The environment lives under ``toolchain_root()/<digest>`` (content-addressed by the
requirements, the Python version and the platform), shared by every workspace. It is made
under a file lock, so concurrent builds make it once; its marker is written last, so a
half-made environment (a crash, a failed install) is never used: the next attempt removes it
and starts again. pip installs, or ``uv`` when it is on PATH (about 10× faster cold, 30×
warm, measured in docs/research/openvino-ep.md); uv does not read pip's configuration, so
pip's index settings are handed to it. ``EPBUILD_INSTALLER=pip`` forces pip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

from epbuild.docsite import page_url
from epbuild.errors import ToolchainError
from epbuild.fs import atomic_write_bytes
from epbuild.procs import run_group
from epbuild.providers.distributions import onnxruntime_version, scanning
from epbuild.state import locks
from epbuild.toolchains.env import MARKER, Toolchain, ask, env_dir, read_marker, toolchain_root
from epbuild.toolchains.lockfile import EnvironmentLock
from epbuild.toolchains.spec import FORMAT, ToolchainSpec

LOCKED_REQUIREMENTS = "epbuild-lock-requirements.txt"
"""Written into an environment made from a lock: the pinned, hashed set pip installs."""


def ensure(
    spec: ToolchainSpec,
    provider: str,
    *,
    say: Callable[[str], None] = lambda _: None,
    locked: EnvironmentLock | None = None,
    lock_timeout: float | None = None,
) -> Toolchain:
    """The environment of a ``requirements`` spec, made now if it is not ready. With
    ``locked`` (its ``epbuild.lock`` entry), exactly the locked distributions, their hashes
    checked, in the directory named by the entry's digest. Waits at most ``lock_timeout``
    seconds for another process making the same environment."""
    directory = env_dir(spec, locked)
    ready = read_marker(spec, directory)
    if ready is not None:
        return ready
    os.makedirs(toolchain_root(), exist_ok=True)
    what = f"epbuild making the toolchain of {provider} ({spec.label})"
    with locks.hold(
        directory + ".lock", what, timeout=lock_timeout, on_wait=say, note=False
    ) as held:
        ready = read_marker(spec, directory)  # another build may have made it meanwhile
        if ready is not None:
            return ready
        say(f"making toolchain for provider {provider} ({spec.label}): {directory}")
        started = time.monotonic()
        # Installers keep the lock's descriptor: should this process die, the lock stays
        # held until they end, so the next build waits instead of using a half-made one.
        keep = () if held.fd is None else (held.fd,)
        try:
            made = _make(spec, directory, provider, locked, keep)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        say(f"toolchain for provider {provider} ready in {time.monotonic() - started:.1f} s")
        return made


def _make(
    spec: ToolchainSpec,
    directory: str,
    provider: str,
    locked: EnvironmentLock | None = None,
    keep: tuple[int, ...] = (),
) -> Toolchain:
    if locked is not None:
        _check_python(locked, provider)
    shutil.rmtree(directory, ignore_errors=True)  # what a crashed attempt left
    log = directory + ".log"
    with open(log, "w", encoding="utf-8"):
        pass  # this attempt's log only
    uv = shutil.which("uv") if os.environ.get("EPBUILD_INSTALLER", "") != "pip" else None
    python, install = _make_venv(uv, directory, log, spec, provider, keep)
    if locked is None:
        _run([*install, *spec.requirements], log, spec, provider, keep)
    else:
        pinned = os.path.join(directory, LOCKED_REQUIREMENTS)
        with open(pinned, "w", encoding="utf-8") as f:
            f.write(locked_requirements(locked))
        _run([*install, "--require-hashes", "--no-deps", "-r", pinned], log, spec, provider, keep)
    answer = ask(python, provider)
    sites = [os.path.relpath(s, directory) for s in answer["sites"]]
    inside = tuple(os.path.join(directory, s) for s in sites if not s.startswith(".."))
    with scanning(inside):
        ort = onnxruntime_version()
    if ort == "absent":
        raise ToolchainError(
            f"provider {provider!r}: toolchain ({spec.label}) installed no ONNX Runtime",
            hint=f"add the EP's ONNX Runtime package (e.g. onnxruntime-openvino, "
            f"onnxruntime-gpu, onnxruntime + onnxruntime-qnn) to "
            f"providers.{provider}.toolchain.requirements",
        )
    marker = {
        "format": FORMAT,
        "requirements": list(spec.requirements),
        "python": os.path.relpath(python, directory),
        "version": ".".join(map(str, answer["version"])),
        "sites": sites,
        "installer": "uv" if uv else "pip",
        **({"lock": locked.digest()} if locked is not None else {}),
    }
    atomic_write_bytes(os.path.join(directory, MARKER), json.dumps(marker, indent=1).encode())
    made = read_marker(spec, directory)
    assert made is not None
    return made


def _make_venv(
    uv: str | None,
    directory: str,
    log: str,
    spec: ToolchainSpec,
    provider: str,
    keep: tuple[int, ...],
) -> tuple[str, list[str]]:
    """Make an empty virtual environment (with ``uv`` where found); its interpreter and
    the command that installs into it."""
    python = os.path.join(
        directory, *(("Scripts", "python.exe") if os.name == "nt" else ("bin", "python"))
    )
    if uv:
        command = [uv, "venv", "--quiet", "--python", sys.executable, directory]
        _run(command, log, spec, provider, keep)
        return python, [uv, "pip", "install", "--python", python, *_uv_index_flags()]
    _run([sys.executable, "-m", "venv", directory], log, spec, provider, keep)
    return python, [python, "-m", "pip", "install", "--disable-pip-version-check"]


def locked_requirements(locked: EnvironmentLock) -> str:
    """A requirements file of a lock entry: every distribution it hashed, pinned with
    ``--hash`` (pip then refuses any other artifact); the seeds a new environment brings
    itself (pip, setuptools) have no hash and are not installed."""
    lines = [
        f"{name}=={d.version} --hash=sha256:{d.sha256}"
        for name, d in sorted(locked.distributions.items())
        if d.sha256
    ]
    return "\n".join(lines) + "\n"


def _check_python(locked: EnvironmentLock, provider: str) -> None:
    """A lock entry's environment is made with this Python: its minor version must match."""
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    there = ".".join(locked.python.split(".")[:2])
    if here != there:
        raise ToolchainError(
            f"provider {provider!r}: epbuild.lock pins its toolchain for Python {there}, "
            f"epbuild runs on Python {here}",
            hint=f"run epbuild with Python {there}, or run epbuild lock again on this Python",
        )


def _run(
    argv: list[str], log: str, spec: ToolchainSpec, provider: str, keep: tuple[int, ...] = ()
) -> None:
    """Run one step in its own process group (ended with the step, or when this process is
    interrupted), its output appended to the log; a failure names the step's last error."""
    with open(log, "ab") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        try:
            proc = run_group(argv, stdout=out, stderr=subprocess.STDOUT, pass_fds=keep)
            code = proc.returncode
        except OSError as exc:
            code, why = -1, str(exc)
    if code == 0:
        return
    if code != -1:
        why = _last_error(log)
    tool = "uv" if "uv" in os.path.basename(argv[0]) else "pip" if "pip" in argv else "venv"
    raise ToolchainError(
        f"provider {provider!r}: making its toolchain ({spec.label}) failed: {tool}: {why}",
        hint=f"check providers.{provider}.toolchain.requirements (package names and pins "
        f"must resolve for Python {sys.version_info[0]}.{sys.version_info[1]} on this "
        f"platform); the full log is {log} (see "
        f"{page_url('troubleshooting.md', 'toolchain-failures')})",
    )


def _last_error(log: str) -> str:
    """The installer's most telling line: its last ``ERROR``/``error`` line, else its last."""
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines()[-60:] if ln.strip()]
    except OSError:
        return "no output"
    errors = [ln for ln in lines if ln.lower().startswith(("error", "×", "╰─▶", "because"))]
    return (errors or lines or ["no output"])[-1]


def _uv_index_flags() -> list[str]:
    """pip's index settings (its config files and ``PIP_*``), as uv flags: uv reads neither,
    and a user's mirror must not be bypassed. pip resolves across all indexes, so uv is told
    to as well (``unsafe-best-match``)."""
    try:
        argv = [sys.executable, "-m", "pip", "config", "list"]
        out = run_group(argv, timeout=60).stdout.decode("utf-8", "replace")
    except (OSError, subprocess.TimeoutExpired):
        return []
    found: dict[str, str] = {}
    for line in sorted(out.splitlines(), key=lambda ln: ln.startswith(":env:")):
        name, _, value = line.partition("=")  # PIP_* (":env:") override the config files
        found[name.rpartition(".")[2]] = value.strip().strip("'\"")
    flags: list[str] = []
    if found.get("index-url"):
        flags += ["--index-url", found["index-url"]]
    for url in found.get("extra-index-url", "").split():
        flags += ["--extra-index-url", url]
    for url in found.get("find-links", "").split():
        flags += ["--find-links", url]
    if "--extra-index-url" in flags or "--find-links" in flags:
        flags += ["--index-strategy", "unsafe-best-match"]
    return flags
