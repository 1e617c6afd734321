"""``epbuild verify``: check built outputs against the EPContext schema, the ONNX external-data
rules, the manifest and the state journal; optionally load and run them (``--load``).

The static checks are ``epbuild.onnx.context``'s rules (no onnx/onnxruntime import), then ONNX
Runtime's own verdict on each ctx model for the EP's devices here (``epbuild.inspection.ortcompat``,
where onnxruntime and the EP can give one). ``--load`` runs each ctx model in a fresh subprocess
(``epbuild.inspection.loading``).
"""

from __future__ import annotations

import contextvars
import os
from concurrent.futures import Executor, Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from epbuild.errors import ToolchainError, UserError
from epbuild.fs import digest_file
from epbuild.inspection.generation import (
    GenerationCheck,
    check_generation,
    require_genai,
)
from epbuild.inspection.llmnumerics import check_llm_numerics, quantized_llm
from epbuild.inspection.loading import LoadCheck, LoadOutcome, load_check
from epbuild.inspection.numerics import NumericsCheck, run_checks
from epbuild.inspection.ortcompat import OrtCompatibility, ort_compatibility
from epbuild.kinds.contract import GraphAction
from epbuild.llm.generate import DEFAULT_TIMEOUT, LONGEST_TIMEOUT
from epbuild.onnx.context import (
    COMPAT_PREFIX,
    LazySourceText,
    MachinePaths,
    Problem,
    Severity,
    context_problems,
    machine_paths,
    needle_problem,
    path_problems,
    scan_needles,
    sharing_problems,
    toolchain_dirs,
)
from epbuild.onnx.proto import ModelInfo, ProtoError, read_model
from epbuild.planning.actions import CompileAction
from epbuild.planning.damage import record_damage
from epbuild.planning.moves import moved_from
from epbuild.planning.workspace import Workspace, open_workspace
from epbuild.providers import get_provider
from epbuild.providers.distributions import scanning
from epbuild.results import CheckStatus
from epbuild.toolchains.env import Toolchain

__all__ = ["LoadCheck", "LoadOutcome", "VerifyResult", "verify_outputs"]


@dataclass
class VerifyResult:
    """What ``verify`` found."""

    checked: list[str] = field(default_factory=list)
    """Workspace-relative ctx models checked."""
    problems: list[Problem] = field(default_factory=list)
    loads: list[LoadCheck] = field(default_factory=list)
    ort: list[OrtCompatibility] = field(default_factory=list)
    """ONNX Runtime's verdict per checked ctx model (its problems are in ``problems``)."""
    numerics: list[NumericsCheck] = field(default_factory=list)
    """``--numerics``: each ctx model's figures against its source."""
    generations: list[GenerationCheck] | None = None
    """``--generate``: each LLM package's greedy tokens against its source's."""

    @property
    def ok(self) -> bool:
        """No error (warnings are fine), and no load or numerical check failed."""
        errors = [p for p in self.problems if p.severity is Severity.ERROR]
        failed = any(c.status is CheckStatus.FAILED for c in self.numerics) or any(
            g.status is CheckStatus.FAILED for g in self.generations or ()
        )
        return (
            not errors
            and not failed
            and all(c.outcome is not LoadOutcome.FAILED for c in self.loads)
        )

    def lines(self) -> list[str]:
        """Every problem and failed load, one line each."""
        out = [
            p.line() if p.severity is Severity.ERROR else f"warning: {p.line()}"
            for p in self.problems
        ]
        out += [
            f"{c.file}: load: {c.message}" for c in self.loads if c.outcome is LoadOutcome.FAILED
        ]
        out += [c.line() for c in self.numerics if c.status is CheckStatus.FAILED]
        out += [g.line() for g in self.generations or () if g.status is CheckStatus.FAILED]
        return out

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document."""
        return {
            "ok": self.ok,
            "checked": self.checked,
            "problems": [p.to_json() for p in self.problems],
            "loads": [c.to_json() for c in self.loads],
            "ort_compatibility": [self._ort_json(c) for c in self.ort],
            "numerics": [c.to_json() for c in self.numerics],
            **(
                {"generate": [g.to_json() for g in self.generations]}
                if self.generations is not None
                else {}
            ),
        }

    def _ort_json(self, check: OrtCompatibility) -> dict[str, Any]:
        """ORT's verdict beside epbuild's own check of ``ep_compatibility_info``."""
        own = [
            p.message
            for p in self.problems
            if p.file == check.file and (p.attribute or "").startswith(COMPAT_PREFIX)
        ]
        return {**check.to_json(), "target_check": own[0] if own else "ok"}


def verify_outputs(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
    *,
    load: bool = False,
    numerics: bool = False,
    jobs: int | None = None,
    generate: int | None = None,
    prompt: str | None = None,
    generate_timeout: float | None = DEFAULT_TIMEOUT,
) -> VerifyResult:
    """Check every selected action's built outputs; with ``load``, also run them, ``jobs``
    loader processes at once (default: the workspace's ``jobs``); with ``numerics``, compare
    each one's outputs with its source's (``epbuild.inspection.numerics``); with
    ``generate`` (tokens), generate from each LLM package and its source, each generation
    given ``generate_timeout`` seconds (None: no limit)."""
    from concurrent.futures import ThreadPoolExecutor

    if jobs is not None and jobs < 1:
        raise UserError("--jobs must be at least 1")
    if generate is not None:
        if generate < 1:
            raise UserError("--tokens must be at least 1")
        if generate_timeout is not None and not 0 < generate_timeout < float("inf"):
            raise UserError(
                f"--timeout {generate_timeout:g} is not a number of seconds",
                hint="give a positive number of seconds (None: no limit)",
            )
        if generate_timeout is not None and generate_timeout > LONGEST_TIMEOUT:
            generate_timeout = None  # longer than a child can be waited on: no limit
        require_genai()
    ws = open_workspace(directory, manifest, selectors)
    result = VerifyResult()
    workers = jobs or ws.manifest.workspace.jobs
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="epbuild-load") as pool:
        loads, intact = _check_actions(ws, result, pool if load else None)
        result.loads.extend(f.result() for f in loads)  # in action order
    if numerics:  # a quantized LLM's graphs: on its prompts' feeds, against the float graphs
        llms = [a for a in intact if quantized_llm(ws, a) is not None]
        result.numerics = run_checks(ws, [a for a in intact if a not in llms])
        result.numerics += check_llm_numerics(ws, llms, workers)
    if generate is not None:
        result.generations = check_generation(
            ws, tokens=generate, prompt=prompt, timeout=generate_timeout
        )
    return result


def _check_actions(
    ws: Workspace, result: VerifyResult, pool: Executor | None
) -> tuple[list[Future[LoadCheck]], list[CompileAction]]:
    """Check each action's outputs into ``result``; with a ``pool``, start the loads of its
    ctx models there. Also returns the compile actions whose outputs are as recorded (what
    ``--numerics`` checks)."""
    machine = machine_paths(ws.root)
    loads: list[Future[LoadCheck]] = []
    intact: list[CompileAction] = []
    for other in ws.graph:  # an LLM's preparation and package: their outputs' digests
        if not isinstance(other, CompileAction):
            _check_record(ws, other, result)
    for action in ws.actions:
        changed = _check_record(ws, action, result)
        if changed is None:
            continue
        toolchain = _toolchain(ws, action)
        # The adapter's view of the EP (its package, the metadata it writes) is the
        # toolchain's, for a provider that has one.
        own = toolchain if isinstance(toolchain, Toolchain) else None
        with scanning(own.sites) if own is not None else nullcontext():
            text = LazySourceText(ws.root, action.models)
            paths = machine.with_dirs(toolchain_dirs(own))
            infos = []
            for ctx in action.ctx_paths:
                result.checked.append(ctx)
                infos.append(_check_ctx(ws, action, ctx, (text, paths), result))
            if action.group.context.share_weights:
                _check_sharing(action, infos, result)
            if pool is not None:
                loads += _load_checks(ws, action, toolchain, pool)
            if not changed:
                intact.append(action)
    return loads, intact


def _check_record(
    ws: Workspace, action: GraphAction, result: VerifyResult
) -> dict[str, str] | None:
    """Check an action's recorded outputs against their digests into ``result``: the
    outputs found changed (recorded as damaged), or None when it has no complete record.
    Outputs a build replaced after the journal was read are checked against its new record
    (``record_damage`` reads the journal again under the lock commits hold)."""
    rec = ws.state.records.get(action.id)
    if rec is None or action.id in ws.state.interrupted:
        damage = ws.state.damaged.get(action.id)
        what = "was interrupted" if rec else "has not been built"
        what = f"is stale: {damage.reason()}" if damage else what
        result.problems.append(
            Problem(action.out_dir, f"action {action.id} {what}; run 'epbuild build'")
        )
        return None
    old = moved_from(action.out_dir, rec.outputs)
    if old is not None:
        what = f"has its outputs in {old}, not in {action.out_dir} where the manifest puts them"
        result.problems.append(
            Problem(action.out_dir, f"action {action.id} {what}; run 'epbuild build'")
        )
        return None
    seen = VerifyResult()
    changed = _check_outputs(ws, {p: (o.size, o.digest) for p, o in rec.outputs.items()}, seen)
    warning = record_damage(ws, action.id, changed, "verify")  # reloads the journal
    if changed and ws.state.records.get(action.id) != rec:
        return _check_record(ws, action, result)  # rebuilt meanwhile: check the new record
    result.problems += seen.problems
    if warning is not None:
        result.problems.append(Problem(action.out_dir, warning, severity=Severity.WARNING))
    return changed


def _toolchain(ws: Workspace, action: CompileAction) -> Toolchain | str | None:
    """The action's toolchain; a string saying why it is unusable; None: epbuild's own
    environment."""
    try:
        return ws.keys.toolchains.get(action.provider)
    except ToolchainError as exc:
        return exc.message


def _check_outputs(
    ws: Workspace, outputs: dict[str, tuple[int, str]], result: VerifyResult
) -> dict[str, str]:
    """Each recorded output exists with its recorded digest and holds no (long) workspace
    path: one streamed read per file (see `epbuild.onnx.context.LONG_PATH_MIN`). Returns
    the outputs whose bytes differ (path → recorded digest)."""
    changed: dict[str, str] = {}
    needles = scan_needles(ws.root)
    for rel, (size, digest) in sorted(outputs.items()):
        full = os.path.join(ws.root, rel)
        if not os.path.isfile(full):
            result.problems.append(Problem(rel, "recorded output is missing"))
            continue
        try:
            found = digest_file(full, needles)
        except OSError as exc:
            result.problems.append(Problem(rel, f"cannot be read ({exc.strerror})"))
            continue
        if found.size != size or found.sha256 != digest:
            changed[rel] = digest
            result.problems.append(
                Problem(rel, "content does not match the digest recorded by the build")
            )
        leak = needle_problem(rel, found.found)
        if leak is not None:
            result.problems.append(leak)
    return changed


def _check_ctx(
    ws: Workspace,
    action: CompileAction,
    ctx: str,
    text: tuple[LazySourceText, MachinePaths],
    result: VerifyResult,
) -> ModelInfo | None:
    """Every rule for one ctx model (``text``: its sources' text and the build machine's
    paths); returns it read (None: missing or unreadable)."""
    full = os.path.join(ws.root, ctx)
    if not os.path.isfile(full):
        result.problems.append(Problem(ctx, "ctx model is missing"))
        return None
    try:
        info = read_model(full, strings=True)
    except (ProtoError, OSError) as exc:
        result.problems.append(Problem(ctx, f"not a readable ONNX model ({exc})"))
        return None
    out_dir = ws.manifest.workspace.out_dir
    result.problems += context_problems(
        ws.root, ctx, info, action.provider, action.group.context.embed_mode, out_dir
    )
    result.problems += path_problems(ctx, info, *text)
    verdict = ort_compatibility(ctx, full, action.provider)
    result.ort.append(verdict)
    problem = verdict.problem()
    if problem is not None:
        result.problems.append(problem)
    return info


def _check_sharing(
    action: CompileAction, infos: list[ModelInfo | None], result: VerifyResult
) -> None:
    """A weight-sharing action's ctx models share one binary (once all could be read: a
    missing or unreadable one is reported already)."""
    read = [info for info in infos if info is not None]
    if len(read) == len(infos):
        adapter = get_provider(action.provider.ep)
        result.problems += sharing_problems(list(action.ctx_paths), read, adapter, action.provider)


def _load_checks(
    ws: Workspace, action: CompileAction, toolchain: Toolchain | str | None, pool: Executor
) -> list[Future[LoadCheck]]:
    """Start the load checks of the action's ctx models in ``pool``, each in a copy of this
    thread's context (the toolchain's ``scanning`` view of the EP goes along)."""
    return [
        pool.submit(contextvars.copy_context().run, load_check, ws, action, i, toolchain)
        for i in range(len(action.ctx_paths))
    ]
