"""The compile kind: a sharing group × provider, or one model × provider, compiled through
ONNX Runtime and its EP into ctx models (and context binaries) in a worker process."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from epbuild.errors import ModelError
from epbuild.kinds.compilekey import compile_key
from epbuild.kinds.compilework import CompileWork
from epbuild.kinds.contract import BaseKind, Checked, GraphRequest, Reported, RunContext, Wording
from epbuild.manifest.model import CompileSettings
from epbuild.onnx.context import report_problems, toolchain_dirs, warning_lines
from epbuild.onnx.staged import check_staged
from epbuild.planning import staleness
from epbuild.planning.actions import CompileAction, make_actions
from epbuild.planning.keys import ActionKey, KeyComputer
from epbuild.providers import get_provider

if TYPE_CHECKING:
    from epbuild.executors.job import Job
    from epbuild.onnx.context import Problem
    from epbuild.providers.contract import ProviderConfig


class CompileKind(BaseKind):
    """``Kind`` of the compile actions (``planning.actions.CompileAction``)."""

    name = "compile"
    words = Wording("compiled")

    def key(self, action: CompileAction, keys: KeyComputer, *, fresh: bool) -> ActionKey:
        """``compile_key``; a ctx model that would embed a context past protobuf's 2 GB
        limit can never be built (``ModelError``)."""
        key = compile_key(action, keys, fresh=fresh)
        if action.group.context.embed_mode == 1:
            for entry, m in zip(action.entries, key.components["models"], strict=True):
                _refuse_embedding(action, entry.path, (entry.path, *m["external"]), keys)
        return key

    def job(
        self, action: CompileAction, key: ActionKey, staging: str, ctx: RunContext
    ) -> tuple[Job, list[str]]:
        """The complete job of one compile (inputs go along for executors that ship them),
        after the inputs' shapes were checked against the provider (``check_shapes``)."""
        from epbuild.kinds.shapes import check_shapes

        warnings = check_shapes(ctx.root, action).warnings
        work = CompileWork(
            action_id=action.id,
            provider=action.provider,
            models=action.models,
            staging=staging,
            context=action.group.context,
            initializer_names=action.initializer_names,
            compile=CompileSettings.from_json(key.components["compile"]),
            names=action.names,
            free_dimensions=action.free_dimensions if any(action.free_dimensions) else (),
        )
        return work.as_job(key.inputs, ctx.predicted_peak, _boot(action, ctx)), warnings

    def check(
        self, action: CompileAction, staging: str, ctx: RunContext, result: Reported
    ) -> Checked:
        """The staged ctx models (``onnx.staged.check_staged``), against the build
        machine's paths and the action's toolchain's, and what the worker reported of each
        model, against the rules (``report_problems``)."""
        # lookup, not get: restoring never makes a toolchain (one not made names no path)
        made = ctx.keys.toolchains.lookup(action.provider)
        machine = ctx.machine.with_dirs(toolchain_dirs(made))
        names, problems = check_staged(
            ctx.root, staging, action.ctx_names, action.models, _shared_by(action), machine
        )
        if result is not None:
            problems += _reported(action, result)
        return names, warning_lines(problems)


def _refuse_embedding(
    action: CompileAction, model: str, files: tuple[str, ...], keys: KeyComputer
) -> None:
    """Raise for a model whose ctx model would embed a context past protobuf's limit."""
    size = sum(keys.stats.digest(keys.root, rel).size for rel in files)
    if size >= staleness.EMBED_LIMIT:
        raise ModelError(
            f"{model}: {size / (1 << 30):.1f} GB with its external data; with "
            "embed_mode = 1 its ctx model would pass protobuf's 2 GB limit",
            hint=f"set embed_mode = 0 for group {action.group.name!r} (and "
            "external_initializers for weights that stay on the CPU EP)",
        )


def _reported(action: CompileAction, result: Mapping[str, Any]) -> list[Problem]:
    """The worker's report about each model, against the rules."""
    adapter = get_provider(action.provider.ep)
    prefix = action.group.context.node_name_prefix
    return [
        p
        for model, report in result.get("detail", {}).get("models", {}).items()
        for p in report_problems(model, report, adapter, action.provider, prefix)
    ]


def compile_actions(request: GraphRequest) -> list[CompileAction]:
    """The compile actions of a request's manifest and LLM groups (``make_actions``)."""
    return make_actions(request.manifest, request.llm_groups)


def _boot(action: CompileAction, ctx: RunContext) -> tuple[str, ...]:
    """How a worker for the action starts: in its provider's toolchain, if it has one."""
    toolchain = ctx.keys.toolchains.get(action.provider)
    if toolchain is None:
        return ()
    from epbuild.toolchains.boot import boot_command

    return tuple(boot_command(toolchain.python))


def _shared_by(action: CompileAction) -> ProviderConfig | None:
    """The provider whose ctx models must share one binary (a weight-sharing action's)."""
    return action.provider if action.group.context.share_weights else None


COMPILE = CompileKind()
