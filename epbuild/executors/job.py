"""The job: one action's work, the one thing that crosses to a worker process.

A kind makes it once, complete (``Kind.job``): the function that does the work (``runner``,
``module:function``) and what that function needs of the action (``payload``, JSON values).
The local executor hands it to a worker subprocess as a JSON line, the Dask executor adds
its cancellation token (``dataclasses.replace``) and ships it to a farm worker, and the
worker reads it back with ``Job.from_json`` and calls the runner
(``executors.worker.result_of``). An inline kind's job runs in the building process the
same way (``executors.local.run_inline``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epbuild._dataclass import dataclass, field


@dataclass(frozen=True)
class Job:
    """What a worker needs to run one action, and nothing it would have to recompute: it
    imports ``runner`` and calls it with the job and the workspace root (its working
    directory); the function stages the outputs into ``staging`` and returns the result
    document's ``seconds``, ``detail`` and ``versions`` (the worker adds ``ok``,
    ``peak_rss`` and ``epbuild``)."""

    action_id: str
    runner: str
    """``module:function`` that does the work."""
    staging: str
    """Workspace-relative directory the worker writes its outputs and result file into."""
    payload: Mapping[str, Any] = field(default_factory=dict)
    """What the runner needs of the action (JSON values; the kind's settings for it)."""
    inputs: Mapping[str, str] = field(default_factory=dict)
    """Input path → digest the action's key was computed from (for executors that ship them)."""
    predicted_peak: int = 0
    """Predicted peak memory in bytes (0: unknown)."""
    token: str = ""
    """An executor's handle on the running job (Dask: the task key, for cancelling)."""
    boot: tuple[str, ...] = ()
    """The command that starts its worker, for an action with a toolchain (empty: this
    interpreter); the executor's business, so ``to_json`` leaves it out."""

    def to_json(self) -> dict[str, Any]:
        """The JSON form a worker reads from its job line: every field but ``boot``."""
        return {n: dict(v) if isinstance(v := getattr(self, n), Mapping) else v for n in _WIRE}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Job:
        """Rebuild a job written by ``to_json``."""
        return cls(**{n: data[n] for n in _WIRE if n in data})


_WIRE = ("action_id", "runner", "staging", "payload", "inputs", "predicted_peak", "token")
"""The fields of a ``Job`` that cross to a worker."""
