"""The worker's one seam for crash tests (``EPBUILD_TEST_HOOK``); unset in normal use."""

from __future__ import annotations

import os
import sys
import time


def run_test_hook(model: str) -> None:
    """A narrow seam for crash tests: ``EPBUILD_TEST_HOOK=KIND:SUBSTRING[:ARGUMENT]``.

    Before the session of a model whose path contains SUBSTRING: ``segv`` kills the worker
    with SIGSEGV, ``oom`` grows by ARGUMENT MB and is killed by SIGKILL (as the kernel kills
    a process when memory runs out), ``memcap`` caps its address space (``ulimit -v``,
    Linux) at what it maps plus ARGUMENT MB, so that the compile itself runs out of memory,
    ``abort`` aborts it (what a crashing native SDK does),
    ``sleep`` waits SECONDS (a slow compile), ``wait`` waits until the file named by the
    argument exists (a compile a test holds open until it says go; ``wait:SUBSTRING:PATH``).
    ``noshare`` leaves out the weight-sharing session entries (as if the EP ignored
    ``ep.share_ep_contexts``; see ``_session_entries``): match every model of the group, or
    only the first, since a group whose last session lacks the stop entry never writes its
    binary. Unset in normal use.
    """
    hook = hook_for(model)
    if hook is None or hook[0] == "noshare":
        return
    kind, arg = hook
    print(f"epbuild test hook: {kind} before compiling {model}", file=sys.stderr, flush=True)
    if kind == "segv":
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "oom":  # what the kernel's out-of-memory killer does, after some growth
        import signal

        grown = bytearray(int(arg or 64) << 20)
        grown[::4096] = b"x" * len(grown[::4096])  # touched: resident
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "memcap":  # a real memory cap (ulimit -v): what it maps now + ARGUMENT MB
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (_mapped() + (int(arg or 16) << 20), hard))
    elif kind == "abort":
        os.abort()
    elif kind == "sleep":
        time.sleep(float(arg or 1))
    elif kind == "wait":
        deadline = time.monotonic() + 600
        while not os.path.exists(arg) and time.monotonic() < deadline:
            time.sleep(0.05)


def _mapped() -> int:
    """This process's mapped address space in bytes (Linux: ``VmSize``)."""
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(ln for ln in f if ln.startswith("VmSize:"))
    return int(line.split()[1]) << 10


def hook_for(model: str) -> tuple[str, str] | None:
    """(KIND, argument) of ``EPBUILD_TEST_HOOK`` when it applies to ``model``."""
    hook = os.environ.get("EPBUILD_TEST_HOOK")
    if not hook:
        return None
    kind, _, rest = hook.partition(":")
    needle, _, arg = rest.partition(":")
    if not needle or needle not in model:
        return None
    return kind, arg
