"""The compile kind's payload: what a worker needs to compile one action, typed.

The compile kind makes it (``kinds.compile``) and puts it in its job (``as_job``: the
payload is ``to_json``); the worker's compile runner reads it back from the job
(``from_job``). Kept apart from the kind so that a worker imports no planning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epbuild._dataclass import dataclass
from epbuild._names import CTX_SUFFIX, model_stem
from epbuild.executors.job import Job
from epbuild.manifest.model import SESSION_SETTINGS, CompileSettings, ContextSettings
from epbuild.providers.contract import ProviderConfig

RUNNER = "epbuild.executors.worker:run_compile"
"""The function a worker compiles a job with."""


@dataclass(frozen=True)
class CompileWork:
    """One action's compile as its worker sees it: the job's action id and staging
    directory, and the payload's fields."""

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
    """Compiler, graph optimisation level and session settings (``CompileAction.compile``)."""
    names: tuple[str, ...] = ()
    """Per model, its output stem (empty: each model's file stem)."""
    free_dimensions: tuple[Mapping[str, int], ...] = ()
    """Per model, symbolic input dimension → value for the session (empty: none)."""

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
        """The payload of its job (JSON values): every field but the job's own."""
        return {
            "provider": self.provider.to_json(),
            "models": list(self.models),
            "context": self.context.to_json(),
            "initializer_names": list(self.initializer_names),
            "compile": self.compile.to_json(),
            "names": list(self.names),
            "free_dimensions": [dict(d) for d in self.free_dimensions],
        }

    def as_job(
        self,
        inputs: Mapping[str, str] | None = None,
        predicted_peak: int = 0,
        boot: tuple[str, ...] = (),
    ) -> Job:
        """Its job: the compile runner with this payload."""
        payload = self.to_json()
        return Job(
            self.action_id,
            RUNNER,
            self.staging,
            payload,
            dict(inputs or {}),
            predicted_peak,
            boot=boot,
        )

    @classmethod
    def from_job(cls, job: Job) -> CompileWork:
        """Read back the compile of a job made by ``as_job``."""
        data = job.payload
        return cls(
            action_id=job.action_id,
            provider=ProviderConfig.from_json(data["provider"]),
            models=tuple(data["models"]),
            staging=job.staging,
            context=ContextSettings.from_json(data["context"]),
            initializer_names=tuple(data.get("initializer_names", ())),
            compile=CompileSettings.from_json(data.get("compile", SESSION_SETTINGS.to_json())),
            names=tuple(data.get("names", ())),
            free_dimensions=tuple(
                {str(k): int(v) for k, v in d.items()} for d in data.get("free_dimensions", ())
            ),
        )
