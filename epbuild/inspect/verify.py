"""``epbuild verify``: check built outputs against the EPContext schema, the ONNX external-data
rules, the manifest and the state journal; optionally load and run them (``--load``).

The static checks are ``epbuild.onnx.context``'s rules (no onnx/onnxruntime import), then ONNX
Runtime's own verdict on each ctx model for the EP's devices here (``epbuild.inspect.ortcompat``,
where onnxruntime and the EP can give one). ``--load`` runs each ctx model in a fresh subprocess
(``python -m epbuild.inspect.loadcheck``) with ``session.disable_model_compile=1``: some built
contexts crash the process that loads them on a host without the target hardware, and a model
the EP would compile at load is not a working ctx model.
"""

from __future__ import annotations

import enum
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Executor, Future
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

from epbuild.errors import ToolchainError, UserError
from epbuild.fs import digest_file
from epbuild.inspect.ortcompat import OrtCompatibility, ort_compatibility
from epbuild.onnx.context import (
    COMPAT_PREFIX,
    Problem,
    Severity,
    SourceText,
    context_problems,
    path_problems,
    scan_needles,
    source_text,
)
from epbuild.onnx.proto import ModelInfo, ProtoError, read_model
from epbuild.planning.actions import Action
from epbuild.planning.workspace import Workspace, open_workspace
from epbuild.providers import get_provider
from epbuild.providers.base import scanning
from epbuild.toolchains.boot import boot_command
from epbuild.toolchains.env import Toolchain

LOAD_TIMEOUT = 300.0


class LoadOutcome(enum.Enum):
    """How a ``--load`` check of one ctx model ended."""

    PASSED = "passed"
    FAILED = "failed"
    NOT_LOADABLE = "not_loadable_here"


@dataclass
class LoadCheck:
    """The ``--load`` result of one ctx model."""

    file: str
    outcome: LoadOutcome
    message: str = ""
    max_error: float | None = None
    crashed: bool = False
    """The loader process died from a signal (a native crash)."""

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` form."""
        doc = {k: v for k, v in asdict(self).items() if k != "crashed"}
        return {**doc, "outcome": self.outcome.value}


@dataclass
class VerifyResult:
    """What ``verify`` found."""

    checked: list[str] = field(default_factory=list)
    """Workspace-relative ctx models checked."""
    problems: list[Problem] = field(default_factory=list)
    loads: list[LoadCheck] = field(default_factory=list)
    ort: list[OrtCompatibility] = field(default_factory=list)
    """ONNX Runtime's verdict per checked ctx model (its problems are in ``problems``)."""

    @property
    def ok(self) -> bool:
        """No error (warnings are fine), and no load check failed."""
        errors = [p for p in self.problems if p.severity is Severity.ERROR]
        return not errors and all(c.outcome is not LoadOutcome.FAILED for c in self.loads)

    def lines(self) -> list[str]:
        """Every problem and failed load, one line each."""
        out = [
            p.line() if p.severity is Severity.ERROR else f"warning: {p.line()}"
            for p in self.problems
        ]
        out += [
            f"{c.file}: load: {c.message}" for c in self.loads if c.outcome is LoadOutcome.FAILED
        ]
        return out

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document."""
        return {
            "ok": self.ok,
            "checked": self.checked,
            "problems": [p.to_json() for p in self.problems],
            "loads": [c.to_json() for c in self.loads],
            "ort_compatibility": [self._ort_json(c) for c in self.ort],
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
    jobs: int | None = None,
) -> VerifyResult:
    """Check every selected action's built outputs; with ``load``, also run them, ``jobs``
    loader processes at once (default: the workspace's ``jobs``)."""
    from concurrent.futures import ThreadPoolExecutor

    ws = open_workspace(directory, manifest, selectors)
    result = VerifyResult()
    if jobs is not None and jobs < 1:
        raise UserError("--jobs must be at least 1")
    workers = jobs or ws.manifest.workspace.jobs
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="epbuild-load") as pool:
        finishing = _check_actions(ws, result, pool if load else None)
        for toolchain, finish in finishing:  # in action order, whichever loader ends first
            with scanning(toolchain.sites) if isinstance(toolchain, Toolchain) else nullcontext():
                result.loads.extend(finish())
    return result


_Finish = Callable[[], list["LoadCheck"]]


def _check_actions(
    ws: Workspace, result: VerifyResult, pool: Executor | None
) -> list[tuple[Toolchain | str | None, _Finish]]:
    """Check each action's outputs into ``result``; with a ``pool``, start their loads there
    and return, per action, what collects its load checks."""
    finishing: list[tuple[Toolchain | str | None, _Finish]] = []
    for action in ws.actions:
        rec = ws.state.records.get(action.id)
        if rec is None or action.id in ws.state.interrupted:
            what = "was interrupted" if rec else "has not been built"
            result.problems.append(
                Problem(action.out_dir, f"action {action.id} {what}; run 'epbuild build'")
            )
            continue
        _check_outputs(ws, {p: (o.size, o.digest) for p, o in rec.outputs.items()}, result)
        toolchain = _toolchain(ws, action)
        # The adapter's view of the EP (its package, the metadata it writes) is the
        # toolchain's, for a provider that has one.
        with scanning(toolchain.sites) if isinstance(toolchain, Toolchain) else nullcontext():
            text = source_text(ws.root, action.models)
            infos = []
            for ctx in action.ctx_paths:
                result.checked.append(ctx)
                infos.append(_check_ctx(ws, action, ctx, text, result))
            if action.group.share_weights:
                _check_sharing(action, infos, result)
            if pool is not None:
                finishing.append((toolchain, _load_checks(ws, action, toolchain, pool)))
    return finishing


def _toolchain(ws: Workspace, action: Action) -> Toolchain | str | None:
    """The action's toolchain; a string saying why it is unusable; None: epbuild's own
    environment."""
    try:
        return ws.keys.toolchains.get(action.provider)
    except ToolchainError as exc:
        return exc.message


def _check_outputs(
    ws: Workspace, outputs: dict[str, tuple[int, str]], result: VerifyResult
) -> None:
    """Each recorded output exists with its recorded digest and holds no (long) workspace
    path: one streamed read per file (see `epbuild.onnx.context.LONG_PATH_MIN`)."""
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
            result.problems.append(
                Problem(rel, "content does not match the digest recorded by the build")
            )
        if found.found is not None:
            leak = found.found.decode(errors="replace").rstrip("/" + os.sep)
            result.problems.append(
                Problem(rel, f"contains the absolute path {leak!r} of this machine")
            )


def _check_ctx(
    ws: Workspace, action: Action, ctx: str, text: SourceText, result: VerifyResult
) -> ModelInfo | None:
    """Every rule for one ctx model; returns it read (None: missing or unreadable)."""
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
        ws.root, ctx, info, action.provider, action.group.embed_mode, out_dir
    )
    result.problems += path_problems(ctx, info, text)
    verdict = ort_compatibility(ctx, full, action.provider)
    result.ort.append(verdict)
    problem = verdict.problem()
    if problem is not None:
        result.problems.append(problem)
    return info


def _check_sharing(action: Action, infos: list[ModelInfo | None], result: VerifyResult) -> None:
    """A weight-sharing action's ctx models share one binary (once all could be read: a
    missing or unreadable one is reported already)."""
    from epbuild.onnx.context import sharing_problems

    read = [info for info in infos if info is not None]
    if len(read) == len(infos):
        adapter = get_provider(action.provider.ep)
        result.problems += sharing_problems(list(action.ctx_paths), read, adapter, action.provider)


def _load_checks(
    ws: Workspace, action: Action, toolchain: Toolchain | str | None, pool: Executor
) -> _Finish:
    """Start the loader of each of the action's ctx models in ``pool``; the returned function
    waits for them and judges each outcome (in the toolchain's ``scanning`` context)."""
    adapter = get_provider(action.provider.ep)
    load_problem = getattr(adapter, "load_problem", None)
    reason = load_problem(action.provider, action.group.share_weights) if load_problem else None
    if isinstance(toolchain, str):
        reason = f"its toolchain is not usable here: {toolchain}"
    if reason:
        skipped = [LoadCheck(ctx, LoadOutcome.NOT_LOADABLE, reason) for ctx in action.ctx_paths]
        return lambda: skipped
    running: list[tuple[str, Future[LoadCheck]]] = []
    for model, ctx, dims in zip(
        action.models, action.ctx_paths, action.free_dimensions, strict=True
    ):
        job = {"ctx": ctx, "source": model, "provider": action.provider.to_json()}
        if dims:  # the source runs at the shapes the ctx model was compiled for
            job["free_dimensions"] = dims
        running.append((ctx, pool.submit(_run_loader, ws.root, ctx, job, toolchain)))
    return lambda: [_judge(fut.result(), adapter, action, load_problem) for _, fut in running]


def _judge(check: LoadCheck, adapter: Any, action: Action, load_problem: Any) -> LoadCheck:
    """A loader's outcome, with the EP's known limits on this host said as such."""
    explain = getattr(adapter, "explain_load_failure", None)
    failed = check.outcome is LoadOutcome.FAILED
    why = explain(action.provider, check.message) if explain and failed else None
    if why:  # a known limit of the EP's package, not a bad build
        return LoadCheck(check.file, LoadOutcome.NOT_LOADABLE, why)
    # Where the adapter says this host is not the target (QNN on x86_64 runs contexts in an
    # emulation), a native crash of the loader is the host's limit, not a bad build; a
    # corrupt context still fails with an error or wrong numbers.
    emulated = load_problem is not None and load_problem(action.provider, True) is not None
    if check.crashed and emulated:
        return LoadCheck(
            check.file,
            LoadOutcome.NOT_LOADABLE,
            f"{check.message}; this host cannot load it, check it on the target",
        )
    return check


def _run_loader(
    root: str, ctx: str, job: dict[str, Any], toolchain: Toolchain | str | None
) -> LoadCheck:
    command = [sys.executable, "-m", "epbuild.inspect.loadcheck"]
    if isinstance(toolchain, Toolchain):
        command = boot_command(toolchain.python, "epbuild.inspect.loadcheck")
    try:
        proc = subprocess.run(
            command,
            input=json.dumps(job),
            cwd=root,
            capture_output=True,
            text=True,
            timeout=LOAD_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return LoadCheck(ctx, LoadOutcome.FAILED, f"loading took over {LOAD_TIMEOUT:g}s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode < 0 or not lines:
        why = f"the loader process died ({_describe(proc.returncode)})"
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip() and not _NOISE.search(ln)]
        if tail and proc.returncode >= 0:
            why += f": {tail[-1].strip()}"
        return LoadCheck(ctx, LoadOutcome.FAILED, why, crashed=proc.returncode < 0)
    data = json.loads(lines[-1])
    outcome = LoadOutcome(data["outcome"])
    return LoadCheck(ctx, outcome, data.get("message", ""), data.get("max_error"))


_NOISE = re.compile(r"\[W:onnxruntime|LIBNATIVE|\x1b\[")


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
