"""The job: one action's compile work, the one thing that crosses to a worker process.

The builder makes it once, complete; the local executor hands it to a worker subprocess as a
JSON line, the Dask executor adds its cancellation token (``dataclasses.replace``) and ships
it to a farm worker, and the worker reads it back with ``Job.from_json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import Any

from epbuild._dataclass import dataclass
from epbuild._names import CTX_SUFFIX, model_stem
from epbuild.manifest.model import SESSION_SETTINGS, CompileSettings, ContextSettings
from epbuild.providers.contract import ProviderConfig


@dataclass(frozen=True)
class Job:
    """What a worker needs to compile one action, and nothing it would have to recompute."""

    action_id: str
    provider: ProviderConfig
    models: tuple[str, ...]
    """Workspace-relative source models, in session order."""
    staging: str
    """Workspace-relative directory the worker writes its outputs and result file into."""
    context: ContextSettings
    """How the EPContext models are written (sharing, embedding, node-name prefix, how a
    model is handed to ONNX Runtime); its ``external_initializers`` is resolved per model
    in ``initializer_names``."""
    initializer_names: tuple[str, ...]
    """Per model, the external-initializer file name (empty: initializers stay inline)."""
    compile: CompileSettings = SESSION_SETTINGS
    """Compiler, graph optimisation level and session settings (``Action.compile``)."""
    inputs: Mapping[str, str] = field(default_factory=dict)
    """Input path → digest the action's key was computed from (for executors that ship them)."""
    predicted_peak: int = 0
    """Predicted peak memory in bytes (0: unknown)."""
    token: str = ""
    """An executor's handle on the running job (Dask: the task key, for cancelling)."""
    names: tuple[str, ...] = ()
    """Per model, its output stem (empty: each model's file stem)."""
    free_dimensions: tuple[Mapping[str, int], ...] = ()
    """Per model, symbolic input dimension → value for the session (empty: none)."""
    boot: tuple[str, ...] = ()
    """The command that starts its worker, for a provider with a toolchain (empty: this
    interpreter); the executor's business, so ``to_json`` leaves it out."""

    @property
    def ctx_names(self) -> tuple[str, ...]:
        """Per model, the file name of the ctx model it writes."""
        names = self.names or tuple(model_stem(m) for m in self.models)
        return tuple(n + CTX_SUFFIX for n in names)

    def repeat_prefix(self, index: int) -> str:
        """``./`` once per earlier occurrence of model ``index``'s source in the job (``""``
        for the first): put in front of the path (or, loading bytes, the external-data
        folder) ORT gets. The QNN EP names its graphs by a hash of that string, and one
        shared context cannot hold two graphs of one name ("Failed to compose Qnn graph"),
        so prefill and decode of one source need different strings. Relative, so outputs
        still do not depend on where the workspace is."""
        return "./" * self.models[:index].count(self.models[index])

    def free_dimensions_of(self, index: int) -> Mapping[str, int]:
        """The overrides of model ``index``."""
        return self.free_dimensions[index] if self.free_dimensions else {}

    def to_json(self) -> dict[str, Any]:
        """The JSON form a worker reads from its job line."""
        return {
            "action_id": self.action_id,
            "provider": self.provider.to_json(),
            "models": list(self.models),
            "staging": self.staging,
            "context": self.context.to_json(),
            "initializer_names": list(self.initializer_names),
            "compile": self.compile.to_json(),
            "inputs": dict(self.inputs),
            "predicted_peak": self.predicted_peak,
            "token": self.token,
            "names": list(self.names),
            "free_dimensions": [dict(d) for d in self.free_dimensions],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Job:
        """Rebuild a job written by ``to_json``."""
        return cls(
            action_id=str(data["action_id"]),
            provider=ProviderConfig.from_json(data["provider"]),
            models=tuple(data["models"]),
            staging=str(data["staging"]),
            context=ContextSettings.from_json(data["context"]),
            initializer_names=tuple(data.get("initializer_names", ())),
            compile=CompileSettings.from_json(data.get("compile", SESSION_SETTINGS.to_json())),
            inputs=dict(data.get("inputs", {})),
            predicted_peak=int(data.get("predicted_peak", 0)),
            token=str(data.get("token", "")),
            names=tuple(data.get("names", ())),
            free_dimensions=tuple(
                {str(k): int(v) for k, v in d.items()} for d in data.get("free_dimensions", ())
            ),
        )


@dataclass(frozen=True)
class KindJob:
    """The job of an action of another kind than compile (``epbuild.kinds``): the worker
    imports ``runner`` (``module:function``) and calls it with the job and the workspace
    root (its working directory); the function stages the outputs into ``staging`` and
    returns the result document's ``seconds``, ``detail`` and ``versions`` (the worker adds
    ``ok``, ``peak_rss`` and ``epbuild``). An ``inline`` job (a few small files) runs in the
    building process instead (``worker.run_inline``)."""

    action_id: str
    kind: str
    runner: str
    staging: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    """The kind's settings for this action (JSON values)."""
    inputs: Mapping[str, str] = field(default_factory=dict)
    """Input path → digest the action's key was computed from (for executors that ship them)."""
    predicted_peak: int = 0
    token: str = ""
    boot: tuple[str, ...] = ()
    inline: bool = False
    """Run in the building process, not in a worker."""

    def to_json(self) -> dict[str, Any]:
        """The JSON form a worker reads from its job line (``kind`` tells it from a
        compile's): every field but the executor's (``boot``) and ``inline``."""
        return {n: dict(v) if isinstance(v := getattr(self, n), Mapping) else v for n in _WIRE}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KindJob:
        """Rebuild a job written by ``to_json``."""
        return cls(**{n: data[n] for n in _WIRE if n in data})


_WIRE = ("action_id", "kind", "runner", "staging", "payload", "inputs", "predicted_peak", "token")
"""The fields of a ``KindJob`` that cross to a worker."""


AnyJob = Job | KindJob
"""What crosses to a worker: a compile's job, or another kind's."""


def job_from_json(data: Mapping[str, Any]) -> AnyJob:
    """A job line read back: a compile's (no ``kind``) or another kind's."""
    return KindJob.from_json(data) if "kind" in data else Job.from_json(data)
