"""The check kind: the numerical check of one compile action's ctx models against their
sources (``verify --numerics``, ``build --numerics``), as an action after that compile.

A check action joins the graph only when a command asks for it (``numerics=True`` to
``open_workspace``). Its job runs each ctx model and its source in a loader process of the
compile's toolchain (``inspection.loading``) on the same feeds and stages the loader's
figures as ``<ctx stem>.numerics.json`` into ``<state_dir>/checks/<group>/<provider>``. Its
key holds the compile's recorded outputs' digests (early cutoff: a compile that made the same
bytes checks nothing again), the source models', the sample files', the input settings, the
provider, the toolchain's versions and the host (a check that cannot run here, or that runs
in an emulation, may give other figures on another machine). Tolerances are not in the key:
``inspection.numerics`` judges the recorded figures, so changing one runs nothing. Like every
kind, checks are journaled, cached, restored and shown by ``status``.

It runs inline (in the building process, which only waits on the loader processes).
"""

from __future__ import annotations

import glob
import json
import os
import platform
import posixpath
import sys
import time
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass
from epbuild.errors import ModelError, UserError, VerificationError
from epbuild.executors.job import Job
from epbuild.kinds.contract import (
    ActionIdentity,
    BaseKind,
    Checked,
    GraphRequest,
    Reported,
    RunContext,
    Wording,
)
from epbuild.planning.actions import CompileAction
from epbuild.planning.keys import ActionKey, KeyComputer

if TYPE_CHECKING:
    from epbuild.toolchains.spec import ToolchainSpec

CHECK_FORMAT = 2
"""Bump when the same inputs give other figures (2: a float16 QDQ model's layers are
checked, where the check failed on ONNX Runtime's type error)."""
FIGURES_SUFFIX = ".numerics.json"
INPUT_SETTINGS = ("seed", "float_range", "int_range")
"""The numerics settings that change the feeds (the others are tolerances)."""


@dataclass(frozen=True)
class CheckAction(ActionIdentity):
    """The numerical check of one compile action's ctx models."""

    id: str
    compile: CompileAction
    out_dir: str
    """``<state_dir>/checks/<group>/<provider>``."""

    KIND = "check"

    @property
    def kind(self) -> str:
        return self.KIND

    @property
    def deps(self) -> tuple[str, ...]:
        return (self.compile.id,)

    @property
    def group_name(self) -> str:
        return self.compile.group_name

    @property
    def provider_name(self) -> str:
        return self.compile.provider_name

    @property
    def toolchain(self) -> ToolchainSpec | None:
        return self.compile.toolchain

    def figures_path(self, index: int) -> str:
        """Workspace-relative path of the figures of the ``index``-th ctx model."""
        name = posixpath.basename(self.compile.ctx_paths[index]).removesuffix(".onnx")
        return posixpath.join(self.out_dir, name + FIGURES_SUFFIX)


def check_id(compile_id: str) -> str:
    """The id of the check of a compile action."""
    return compile_id + "/check"


def check_action(compile: CompileAction, state_dir: str) -> CheckAction:
    """The check of ``compile``, its figures under ``state_dir`` (workspace-relative)."""
    out_dir = posixpath.join(state_dir, "checks", compile.group_name, compile.provider_name)
    return CheckAction(check_id(compile.id), compile, out_dir)


def check_actions(request: GraphRequest) -> list[CheckAction]:
    """The checks of the compiles (the check kind's actions)."""
    state_dir = request.manifest.workspace.state_dir
    return [check_action(a, state_dir) for a in request.made if isinstance(a, CompileAction)]


class CheckKind(BaseKind):
    """``Kind`` of the numerical checks (``CheckAction``); its job's user errors (a
    validation sample that cannot be read or is not finite) are bad input."""

    name = "check"
    runner = "epbuild.kinds.check:run"
    format = CHECK_FORMAT
    words = Wording("checked", "checking")
    follows = True
    inline = True
    checks_input = True

    def key(self, action: CheckAction, keys: KeyComputer, *, fresh: bool) -> ActionKey:
        compile = action.compile
        built = keys.outputs_of(compile.id)
        if not built:
            raise ModelError(f"{compile.id} has not been built", hint="run 'epbuild build'")
        inputs: dict[str, str] = {}
        what = f"input of the numerical check of {compile.id}"
        for rel in [*built, *check_inputs(keys.root, compile)]:
            inputs[rel] = keys.input_digest(rel, what, "run 'epbuild build', or restore it")
        settings = [
            {k: v for k, v in e.numerics.to_json().items() if k in INPUT_SETTINGS}
            for e in compile.entries
        ]
        return self.keyed(
            inputs,
            ctx=list(compile.ctx_paths),
            settings=settings,
            provider=compile.provider.to_json(),
            versions=keys.versions(compile, fresh=fresh),
            host=f"{sys.platform}-{platform.machine()}",
        )

    def payload(self, action: CheckAction, key: ActionKey, ctx: RunContext) -> dict[str, Any]:
        from epbuild.inspection.loading import load_spec

        compile = action.compile
        toolchain = ctx.keys.toolchains.get(compile.provider)
        runs = [
            {
                "spec": load_spec(compile, i, loader_extra(ctx.root, compile, i)),
                "figures": posixpath.basename(action.figures_path(i)),
            }
            for i in range(len(compile.ctx_paths))
        ]
        payload = {
            "runs": runs,
            "python": toolchain.python if toolchain is not None else None,
            "versions": key.components["versions"],
        }
        return payload

    def check(
        self, action: CheckAction, staging: str, ctx: RunContext, result: Reported
    ) -> Checked:
        """One readable figures document per ctx model, nothing else."""
        from epbuild.onnx.staged import staged_names

        names = staged_names(ctx.root, staging)
        wanted = sorted(
            posixpath.basename(action.figures_path(i)) for i in range(len(action.compile.ctx_paths))
        )
        if names != wanted:
            raise VerificationError(f"check {action.id}: staged {names}, expected {wanted}")
        for name in names:
            try:
                with open(os.path.join(ctx.root, staging, name), encoding="utf-8") as f:
                    doc = json.load(f)
            except (OSError, ValueError) as exc:
                raise VerificationError(f"{name}: unreadable figures ({exc})") from exc
            if not isinstance(doc, dict) or "outcome" not in doc:
                raise VerificationError(f"{name}: the figures document has no outcome")
        return names, []


def _sample_files(root: str, patterns: tuple[str, ...]) -> list[str]:
    """The ``.npz`` files of the settings' paths and globs, workspace-relative, sorted."""
    found: dict[str, None] = {}  # ordered, and linear where a list's ``in`` is quadratic
    for pattern in patterns:
        matches = sorted(
            os.path.relpath(p, root).replace(os.sep, "/")
            for p in glob.glob(os.path.join(root, pattern))
            if os.path.isfile(p)
        )
        if not matches:
            raise UserError(
                f"numerics inputs {pattern!r} match no file",
                hint="add the .npz samples, or fix the path (relative to the manifest)",
            )
        found.update(dict.fromkeys(matches))
    return list(found)


def check_inputs(root: str, action: CompileAction) -> list[str]:
    """The files a check of ``action`` reads besides its ctx models (workspace-relative):
    the source models, the samples, and for a quantized group the float sources and the
    models its calibrations wrote. A pattern that matches nothing is a ``ModelError``."""
    files: dict[str, None] = {}  # ordered, and linear in the number of samples
    for index in range(len(action.entries)):
        try:
            found, _ = _inputs(root, action, index)
        except UserError as exc:
            raise ModelError(exc.message, hint=exc.hint) from exc
        files.update(dict.fromkeys([action.models[index], *found]))
    return list(files)


def loader_extra(root: str, action: CompileAction, index: int) -> dict[str, Any]:
    """The loader job's part beyond the models, for the ``index``-th ctx model."""
    return _inputs(root, action, index)[1]


def _inputs(root: str, action: CompileAction, index: int) -> tuple[list[str], dict[str, Any]]:
    """What one check compares on: the files it reads beyond the models, and the loader
    job's part beyond the models. A quantized group's model is compared with its float
    source on the recipe's validation samples, the QDQ model beside it."""
    from epbuild.manifest.quantization import sample_files
    from epbuild.planning.quantize import QuantizedGroup

    group, entry = action.group, action.entries[index]
    if isinstance(group, QuantizedGroup) and group.recipe is not None:
        recipe = group.recipe
        source = group.sources[group.entries.index(entry)].path
        calibrated = group.calibrated[entry.name]
        files = [f for s in recipe.feeds for f in sample_files(root, s)]
        quantized = {"qdq": action.models[index], "float": calibrated,
                     "samples": list(recipe.feeds)}  # fmt: skip
        return [*files, source, calibrated], {"source": source, "quantized": quantized}
    samples = _sample_files(root, entry.numerics.inputs)
    return samples, {**entry.numerics.to_json(), "inputs": samples}


def run(job: Job, root: str) -> dict[str, Any]:
    """Run each ctx model's loader and stage its figures (the loader's result document)."""
    from epbuild.errors import ActionFailedError
    from epbuild.fs import atomic_write_bytes
    from epbuild.inspection.loading import LoadOutcome, run_load

    t0 = time.perf_counter()
    python = job.payload.get("python")
    versions: dict[str, str] = {}
    for item in job.payload["runs"]:
        # the loader's temporary files in the staging directory, which goes whatever ends it
        spec = {**item["spec"], "job": {**item["spec"]["job"], "scratch": job.staging}}
        load = run_load(root, spec, python, standalone=True)
        if load.outcome is LoadOutcome.FAILED and load.died:  # not a verdict on the model
            raise ActionFailedError(
                f"{load.file}: {load.message}",
                hint="run it again; if it keeps failing, 'epbuild verify --load' shows the loader",
            )
        bad = load.more.pop("bad_input", None)
        if isinstance(bad, dict):  # a validation sample the user must fix: no figures
            raise ModelError(str(bad.get("message")), hint=bad.get("hint"))
        versions.update(load.versions or {})
        doc = {"outcome": load.outcome.value, "message": load.message,
               "outputs": load.outputs, **load.more}  # fmt: skip
        path = os.path.join(root, job.staging, item["figures"])
        atomic_write_bytes(path, json.dumps(doc, allow_nan=True, sort_keys=True).encode())
    # What the loaders ran with; where none ran (the adapter knew it could not load the
    # model here), no version made the figures: the key's stand.
    return {
        "seconds": time.perf_counter() - t0,
        "detail": {},
        "versions": versions or dict(job.payload["versions"]),
    }


CHECK = CheckKind()
