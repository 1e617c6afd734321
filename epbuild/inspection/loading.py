"""Running a built ctx model beside its source: the loader process ``verify --load`` and
``verify --numerics`` share (``epbuild.inspection.loadcheck`` runs in it).

Each ctx model runs in a fresh subprocess (in the action's toolchain where it has one) with
``session.disable_model_compile=1``: some built contexts crash the process that loads them on
a host without the target hardware, and a model the EP would compile at load is not a
working ctx model.
"""

from __future__ import annotations

import enum
import json
import re
import signal
import subprocess
from typing import Any

from epbuild._dataclass import asdict, dataclass, field
from epbuild.executors.local import own_command
from epbuild.planning.actions import CompileAction
from epbuild.planning.workspace import Workspace
from epbuild.providers import get_provider
from epbuild.providers.contract import ProviderConfig
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
    died: bool = False
    """The loader gave no result (it timed out, was killed or exited without one): nothing
    says the same inputs would fail again (a check records no figures of it)."""
    outputs: list[dict[str, Any]] | None = None
    """Per output of the model, its figures against the source (``loadcheck.figures_of``)."""
    more: dict[str, Any] = field(default_factory=dict)
    """What else the loader reported (a quantized model's ``qdq`` figures and ``layers``;
    ``bad_input``: the message and hint of a sample the user must fix)."""
    versions: dict[str, str] | None = None
    """The versions the loader process ran with (``worker.compiled_with``); None: no
    loader ran."""

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` form."""
        skip = ("crashed", "died", "outputs", "more", "versions")
        doc = {k: v for k, v in asdict(self).items() if k not in skip}
        return {**doc, "outcome": self.outcome.value}


def load_check(
    ws: Workspace,
    action: CompileAction,
    index: int,
    toolchain: Toolchain | str | None,
    extra: dict[str, Any] | None = None,
    *,
    standalone: bool = False,
) -> LoadCheck:
    """Run the ``index``-th ctx model of ``action`` and its source on the same feeds in a
    loader process (``extra``: more of the job, e.g. the numerics inputs). ``standalone``:
    where the EP's package cannot load the model here (a known limit), run it without the
    EP if the adapter has a way (``verify --numerics``; ``--load`` is about the EP)."""
    if isinstance(toolchain, str):
        reason = f"its toolchain is not usable here: {toolchain}"
        return LoadCheck(action.ctx_paths[index], LoadOutcome.NOT_LOADABLE, reason)
    python = toolchain.python if isinstance(toolchain, Toolchain) else None
    return run_load(ws.root, load_spec(action, index, extra), python, standalone=standalone)


def load_spec(
    action: CompileAction, index: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What a loader run of the ``index``-th ctx model of ``action`` needs (JSON values):
    the loader's job, and ``share_weights`` (whether the EP can load it here)."""
    job: dict[str, Any] = {
        "ctx": action.ctx_paths[index],
        "source": action.models[index],
        "provider": action.provider.to_json(),
    }
    dims = action.free_dimensions[index]
    if dims:  # the source runs at the shapes the ctx model was compiled for
        job["free_dimensions"] = dims
    job.update(extra or {})
    return {"job": job, "share_weights": action.group.context.share_weights}


LOADCHECK = "epbuild.inspection.loadcheck"
"""The loader a ctx model is run with (a quantized one: ``inspection.quantcheck``)."""


def run_load(
    root: str, spec: dict[str, Any], python: str | None, *, standalone: bool = False
) -> LoadCheck:
    """Run one ``load_spec`` in a loader process (``python``: the toolchain's interpreter;
    None: this one's), with the adapter's reading of what it could not load."""
    job = spec["job"]
    provider = ProviderConfig.from_json(job["provider"])
    adapter = get_provider(provider.ep)
    ctx = job["ctx"]
    reason = adapter.load_problem(provider, spec["share_weights"])
    if reason:
        return LoadCheck(ctx, LoadOutcome.NOT_LOADABLE, reason)
    check = _run_loader(root, ctx, job, python)
    failed = check.outcome is LoadOutcome.FAILED
    why = adapter.explain_load_failure(provider, check.message) if failed else None
    if why:  # a known limit of the EP's package, not a bad build
        check = LoadCheck(ctx, LoadOutcome.NOT_LOADABLE, why)
        module = adapter.standalone_loader(provider) if standalone else None
        if module is not None:  # without the EP; where that cannot run either, both reasons
            check = _run_loader(root, ctx, job, python, module)
            if check.outcome is LoadOutcome.NOT_LOADABLE:
                check = LoadCheck(ctx, LoadOutcome.NOT_LOADABLE, f"{why}; {check.message}")
    # Where the adapter says this host is not the target (QNN on x86_64 runs contexts in
    # an emulation), a native crash of the loader is the host's limit, not a bad build;
    # a corrupt context still fails with an error or wrong numbers.
    emulated = adapter.load_problem(provider, True) is not None
    if check.crashed and emulated:
        check = LoadCheck(
            ctx,
            LoadOutcome.NOT_LOADABLE,
            f"{check.message}; this host cannot load it, check it on the target",
        )
    return check


def _run_loader(
    root: str,
    ctx: str,
    job: dict[str, Any],
    python: Toolchain | str | None,
    module: str | None = None,
) -> LoadCheck:
    """One loader process in ``python`` (a toolchain, its interpreter, or None: ours);
    ``module``: the loader (None: ``loadcheck``, or for a quantized model ``quantcheck``,
    which compares it with its float source, with the QDQ model beside it; for a quantized
    LLM's graph ``llmnumerics``, on its prompts' feeds)."""
    if module is None:
        module = "epbuild.inspection.quantcheck" if job.get("quantized") else LOADCHECK
        module = "epbuild.inspection.llmnumerics" if job.get("llm") else module
    if isinstance(python, Toolchain):
        python = python.python
    command = own_command(module) if python is None else boot_command(python, module)
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
        why = f"loading took over {LOAD_TIMEOUT:g}s"
        return LoadCheck(ctx, LoadOutcome.FAILED, why, died=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode < 0 or not lines:
        why = f"the loader process died ({_describe(proc.returncode)})"
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip() and not _NOISE.search(ln)]
        if tail and proc.returncode >= 0:
            why += f": {tail[-1].strip()}"
        # SIGKILL is the kernel's (out of memory) or a user's, not a native crash of the model
        crashed = proc.returncode < 0 and proc.returncode != -signal.SIGKILL
        return LoadCheck(ctx, LoadOutcome.FAILED, why, crashed=crashed, died=True)
    data = json.loads(lines[-1])
    outcome = LoadOutcome(data["outcome"])
    outputs = data.get("outputs")
    more = {k: data[k] for k in ("qdq", "layers", "bad_input") if k in data}
    versions = data.get("versions") if isinstance(data.get("versions"), dict) else None
    return LoadCheck(
        ctx,
        outcome,
        data.get("message", ""),
        data.get("max_error"),
        outputs=outputs,
        more=more,
        versions=versions,
    )


_NOISE = re.compile(r"\[W:onnxruntime|LIBNATIVE|\x1b\[")


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
