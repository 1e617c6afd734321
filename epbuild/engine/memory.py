"""The memory plan: how many compiles may run at once under a memory budget.

Each action's peak memory is predicted from the size of its inputs — QNN compiles peak at
about 3.5x the source model plus a fixed ~150 MB for the runtime itself (see ORT-QNN-FACTS) —
or from its last recorded run (``peak_rss`` in the state) when that was higher: a recorded
peak alone would under-predict once the inputs grew. The
scheduler admits ready actions while the sum of the predicted peaks of running actions stays
under the budget; an action bigger than the whole budget still runs, alone.

RAM is read from ``/proc/meminfo`` (or ``os.sysconf``): no psutil on the build path. Inside
a container the cgroup's memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, of
the process's own cgroup and every ancestor) caps it: ``MemAvailable`` there is the host's.
Warm spare workers (one per worker command) hold memory too and are taken off the budget.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epbuild.planning.staleness import ActionPlan
    from epbuild.state.journal import State
    from epbuild.state.statcache import StatCache

BASE_PEAK = 150 << 20
"""What a worker process holds before it compiles anything (ORT + EP libraries)."""
INPUT_FACTOR = 3.5
"""Peak memory per byte of source model (QNN HTP compiles: docs/research/qnn-plugin.md)."""
SAFE_SHARE = 0.75
"""Share of the available memory the default budget takes."""
SPARE_RSS = 64 << 20
"""What a warm spare worker holds while it waits (onnxruntime imported, no EP loaded yet;
measured: docs/research/qnn-plugin.md)."""
_NO_LIMIT = 1 << 60
"""cgroup v1 writes "no limit" as a number near 2**63."""


def _meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as {field: bytes} (read as UTF-8, which the interpreter decodes without
    loading a codec module: ASCII is its subset)."""
    values: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    scale = 1024 if parts[1:2] == ["kB"] else 1
                    values[name] = int(parts[0]) * scale
    except OSError:
        pass
    return values


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_dirs(proc_cgroup: str, sys_cgroup: str) -> list[tuple[str, str, str]]:
    """(directory, limit file, usage file) for the process's memory cgroup and each of its
    ancestors, innermost first."""
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found: list[tuple[str, str, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: "0::/path"
            base, files = sys_cgroup, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1: "N:memory:/path"
            base, files = (
                os.path.join(sys_cgroup, "memory"),
                (
                    "memory.limit_in_bytes",
                    "memory.usage_in_bytes",
                ),
            )
        else:
            continue
        names = [p for p in path.split("/") if p and p != ".."]
        for depth in range(len(names), -1, -1):
            directory = os.path.join(base, *names[:depth])
            if os.path.isfile(os.path.join(directory, files[0])):
                found.append((directory, *files))
    return found


def cgroup_available(
    proc_cgroup: str = "/proc/self/cgroup", sys_cgroup: str = "/sys/fs/cgroup"
) -> int | None:
    """Bytes the process's cgroups still allow (limit minus usage, the tightest of the
    cgroup and its ancestors); None without a memory limit."""
    best: int | None = None
    for directory, limit_file, usage_file in _cgroup_dirs(proc_cgroup, sys_cgroup):
        limit = _read_int(os.path.join(directory, limit_file))
        if limit is None or limit >= _NO_LIMIT:
            continue
        usage = _read_int(os.path.join(directory, usage_file)) or 0
        left = max(0, limit - usage)
        best = left if best is None else min(best, left)
    return best


def available_memory(
    meminfo: str = "/proc/meminfo",
    proc_cgroup: str = "/proc/self/cgroup",
    sys_cgroup: str = "/sys/fs/cgroup",
) -> int:
    """Bytes of memory available to new processes now (MemAvailable, else total RAM),
    capped by the cgroup's limit."""
    info = _meminfo(meminfo)
    if "MemAvailable" in info:
        host = info["MemAvailable"]
    elif "MemTotal" in info:
        host = info["MemTotal"]
    else:
        try:
            host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            host = 4 << 30  # unknown platform: assume a small machine
    limit = cgroup_available(proc_cgroup, sys_cgroup)
    return host if limit is None else min(host, limit)


def default_budget(meminfo: str = "/proc/meminfo", **cgroup: str) -> int:
    """A safe share of the memory available now."""
    return int(available_memory(meminfo, **cgroup) * SAFE_SHARE)


def spare_cost(boots: Iterable[object]) -> int:
    """What the warm spare workers of a build hold: one per distinct worker command."""
    return SPARE_RSS * len(set(boots))


def predict_from_inputs(input_bytes: int) -> int:
    """Predicted peak of a first-time compile of ``input_bytes`` of models and weights."""
    return BASE_PEAK + int(INPUT_FACTOR * input_bytes)


def predict_peak(plan: ActionPlan, state: State, stats: StatCache, root: str) -> int:
    """An action's predicted peak memory: the larger of its last measured peak and the
    prediction from its current input sizes (a recorded peak is stale once inputs grew)."""
    inputs: Iterable[str] = plan.key.inputs if plan.key is not None else ()
    total = 0
    for rel in inputs:
        entry = stats.entries.get(rel)
        if entry is not None:
            total += entry.size
            continue
        try:
            total += os.stat(os.path.join(root, rel)).st_size
        except OSError:
            pass  # a missing input fails the action anyway
    predicted = predict_from_inputs(total)
    rec = state.records.get(plan.action.id)
    if rec is not None and rec.peak_rss > 0:
        return max(rec.peak_rss, predicted)
    return predicted


class MemoryPlan:
    """Admission control: tracks the predicted peaks of running actions against a budget."""

    def __init__(self, budget: int | None, peaks: Mapping[str, int]) -> None:
        self.budget = budget
        """Bytes; None means unlimited (the executor places work itself)."""
        self.peaks = dict(peaks)
        """Action id → predicted peak bytes."""
        self.in_use = 0
        self._lock = threading.Lock()

    def take(self, pending: deque[ActionPlan], *, idle: bool) -> ActionPlan | None:
        """Remove and return the first pending action that fits (None if none does).

        ``idle`` says nothing is running: then the first action is admitted even when it is
        bigger than the whole budget, so it runs alone.
        """
        if not pending:
            return None
        with self._lock:
            if self.budget is None or (idle and self.in_use == 0):
                chosen = pending[0]
            else:
                for plan in pending:
                    if self.in_use + self.peaks.get(plan.action.id, 0) <= self.budget:
                        chosen = plan
                        break
                else:
                    return None
            pending.remove(chosen)
            self.in_use += self.peaks.get(chosen.action.id, 0)
            return chosen

    def release(self, plan: ActionPlan) -> None:
        """An admitted action finished."""
        with self._lock:
            self.in_use = max(0, self.in_use - self.peaks.get(plan.action.id, 0))
