"""What the worker asks the platform: its peak memory, and whether a directory can take
more bytes (a file-size limit, a full disk)."""

from __future__ import annotations

import os
import sys
from typing import Any


def peak_rss() -> int:
    """This process's peak resident memory in bytes (0 where the platform does not say)."""
    if sys.platform == "win32":
        return _peak_working_set()
    try:
        import resource
    except ImportError:
        return 0
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes; else KiB


def _peak_working_set() -> int:
    """Windows: ``GetProcessMemoryInfo(...).PeakWorkingSetSize``."""
    import ctypes
    from ctypes import wintypes

    class Counters(ctypes.Structure):
        _fields_ = [
            ("cb", wintypes.DWORD),
            ("PageFaultCount", wintypes.DWORD),
            ("PeakWorkingSetSize", ctypes.c_size_t),
            ("WorkingSetSize", ctypes.c_size_t),
            ("QuotaPeakPagedPoolUsage", ctypes.c_size_t),
            ("QuotaPagedPoolUsage", ctypes.c_size_t),
            ("QuotaPeakNonPagedPoolUsage", ctypes.c_size_t),
            ("QuotaNonPagedPoolUsage", ctypes.c_size_t),
            ("PagefileUsage", ctypes.c_size_t),
            ("PeakPagefileUsage", ctypes.c_size_t),
        ]

    try:
        counters = Counters()
        counters.cb = ctypes.sizeof(counters)
        windll: Any = getattr(ctypes, "windll")  # noqa: B009  (absent off Windows: mypy)
        process = windll.kernel32.GetCurrentProcess()
        if not windll.psapi.GetProcessMemoryInfo(process, ctypes.byref(counters), counters.cb):
            return 0
        return int(counters.PeakWorkingSetSize)
    except (OSError, AttributeError):
        return 0


LOW_SPACE = 1 << 20
"""Free bytes under which a failed compile is blamed on a full disk."""


def write_trouble(directory: str) -> tuple[str, str] | None:
    """(what, hint) when ``directory`` cannot take more bytes: a staged file stopped at the
    process's file-size limit (``ulimit -f``), or the filesystem is (nearly) full."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        limit = -1
    try:
        names = os.listdir(directory)
        if limit >= 0 and limit != getattr(resource, "RLIM_INFINITY", -1):
            for name in sorted(names):
                if os.path.getsize(os.path.join(directory, name)) >= limit:
                    return (
                        f"File too large: {name} reached the file-size limit of {limit} bytes",
                        "raise the limit (ulimit -f) for the build; context binaries are "
                        "about half the size of the model's weights",
                    )
        st = os.statvfs(directory)
    except (OSError, AttributeError):  # no statvfs on Windows
        return None
    free = st.f_bavail * st.f_frsize
    if free < LOW_SPACE:
        return (
            f"No space left on device: {free} bytes free for {directory}",
            "free disk space on the output directory's filesystem",
        )
    return None
