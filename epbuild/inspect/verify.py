"""``epbuild verify``: check built outputs against the EPContext schema, the ONNX external-data
rules, the manifest and the state journal; optionally load and run them (``--load``).

The static checks read models with ``onnxproto`` (no onnx/onnxruntime import). ``--load`` runs
each ctx model in a fresh subprocess (``python -m epbuild.inspect.loadcheck``): some built contexts
crash the process that loads them on a host without the target hardware.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import posixpath
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from epbuild.fs import is_safe_reference
from epbuild.onnx.proto import ContextNode, ModelInfo, ProtoError, read_model
from epbuild.planning.actions import Action
from epbuild.providers import get_provider
from epbuild.state.statcache import hash_file
from epbuild.state.workspace import Workspace, open_workspace

# EPContext attribute types from the EPContext design: int64 or string.
_INT_ATTRS = frozenset({"main_context", "embed_mode", "max_size", "is_multi_soc_ep_context"})
_STR_ATTRS = frozenset(
    {
        "ep_cache_context",
        "ep_sdk_version",
        "onnx_model_filename",
        "hardware_architecture",
        "partition_name",
        "source",
        "notes",
    }
)
_MAX_PATH = 4096
LOAD_TIMEOUT = 300.0


class LoadOutcome(enum.Enum):
    """How a ``--load`` check of one ctx model ended."""

    PASSED = "passed"
    FAILED = "failed"
    NOT_LOADABLE = "not_loadable_here"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a built output."""

    file: str
    """Workspace-relative path of the file the problem is in."""
    message: str
    node: str | None = None
    attribute: str | None = None

    def line(self) -> str:
        """The one-line form: ``file: node N: attribute A: message``."""
        where = self.file
        if self.node is not None:
            where += f": node {self.node}"
        if self.attribute is not None:
            where += f": {self.attribute}"
        return f"{where}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` form."""
        return {
            "file": self.file,
            "node": self.node,
            "attribute": self.attribute,
            "message": self.message,
        }


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
        return {
            "file": self.file,
            "outcome": self.outcome.value,
            "message": self.message,
            "max_error": self.max_error,
        }


@dataclass
class VerifyResult:
    """What ``verify`` found."""

    checked: list[str] = field(default_factory=list)
    """Workspace-relative ctx models checked."""
    problems: list[Problem] = field(default_factory=list)
    loads: list[LoadCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No problem, and no load check failed."""
        return not self.problems and all(c.outcome is not LoadOutcome.FAILED for c in self.loads)

    def lines(self) -> list[str]:
        """Every problem and failed load, one line each."""
        out = [p.line() for p in self.problems]
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
        }


def verify_outputs(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
    *,
    load: bool = False,
) -> VerifyResult:
    """Check every selected action's built outputs; with ``load``, also run them."""
    ws = open_workspace(directory, manifest, selectors)
    result = VerifyResult()
    for action in ws.actions:
        rec = ws.state.records.get(action.id)
        if rec is None or action.id in ws.state.interrupted:
            what = "was interrupted" if rec else "has not been built"
            result.problems.append(
                Problem(action.out_dir, f"action {action.id} {what}; run 'epbuild build'")
            )
            continue
        _check_digests(ws, {p: (o.size, o.digest) for p, o in rec.outputs.items()}, result)
        for ctx in action.ctx_paths:
            result.checked.append(ctx)
            _check_ctx(ws, action, ctx, result)
        _check_leaks(ws, list(rec.outputs), result)
        if load:
            result.loads.extend(_load_checks(ws, action))
    return result


def _check_digests(
    ws: Workspace, outputs: dict[str, tuple[int, str]], result: VerifyResult
) -> None:
    for rel, (size, digest) in sorted(outputs.items()):
        full = os.path.join(ws.root, rel)
        if not os.path.isfile(full):
            result.problems.append(Problem(rel, "recorded output is missing"))
        elif os.path.getsize(full) != size or hash_file(full) != digest:
            result.problems.append(
                Problem(rel, "content does not match the digest recorded by the build")
            )


def _check_leaks(ws: Workspace, outputs: list[str], result: VerifyResult) -> None:
    needles = {os.path.realpath(ws.root).encode(), os.path.abspath(ws.root).encode()}
    for rel in outputs:
        full = os.path.join(ws.root, rel)
        try:
            with open(full, "rb") as f:
                data = f.read()
        except OSError:
            continue  # reported as missing
        for needle in needles:
            if needle in data:
                result.problems.append(
                    Problem(rel, f"contains the absolute path {needle.decode()!r} of this machine")
                )
                break


def _check_ctx(ws: Workspace, action: Action, ctx: str, result: VerifyResult) -> None:
    full = os.path.join(ws.root, ctx)
    if not os.path.isfile(full):
        result.problems.append(Problem(ctx, "ctx model is missing"))
        return
    try:
        info = read_model(full)
    except (ProtoError, OSError) as exc:
        result.problems.append(Problem(ctx, f"not a readable ONNX model ({exc})"))
        return
    problems = result.problems
    nodes = info.context_nodes
    if not nodes:
        problems.append(Problem(ctx, "has no EPContext node"))
    adapter = get_provider(action.provider.ep)
    source = adapter.context_source(action.provider)
    mains = [n for n in nodes if n.attributes.get("main_context", 1) == 1]
    for node in nodes:
        _check_node(ws, action, ctx, node, source, problems)
    if nodes and not mains:
        problems.append(
            Problem(
                ctx,
                "every EPContext node has main_context = 0; none holds the context",
                attribute="main_context",
            )
        )
    _check_external(ws, action, ctx, info, problems)
    key = adapter.compatibility_key(action.provider)
    if key is not None and nodes:
        attr = f"ep_compatibility_info.{key}"
        compat = info.metadata.get(attr)
        if compat is None:
            problems.append(Problem(ctx, "metadata is missing", attribute=attr))
        else:
            issue = adapter.check_compatibility(action.provider, compat)
            if issue:
                problems.append(Problem(ctx, issue, attribute=attr))


def _check_node(
    ws: Workspace, action: Action, ctx: str, node: ContextNode, source: str, problems: list[Problem]
) -> None:
    attrs = node.attributes

    def bad(attr: str | None, message: str) -> None:
        problems.append(Problem(ctx, message, node=node.name, attribute=attr))

    for name, value in attrs.items():
        if name in _INT_ATTRS and not isinstance(value, int):
            bad(name, f"must be an int64, not {type(value).__name__}")
        elif name in _STR_ATTRS and name != "ep_cache_context" and not isinstance(value, str):
            bad(name, f"must be a string, not {type(value).__name__}")
    main = attrs.get("main_context", 1)
    embed = attrs.get("embed_mode", 1)
    if main not in (0, 1):
        bad("main_context", f"must be 0 or 1, not {main!r}")
    if embed not in (0, 1):
        bad("embed_mode", f"must be 0 or 1, not {embed!r}")
        return
    if source and attrs.get("source", "") != source:
        bad(
            "source",
            f"is {attrs.get('source', '')!r}, the {action.provider.ep} provider writes {source!r}",
        )
    if main != 1:
        return
    if embed != action.group.embed_mode:
        bad("embed_mode", f"is {embed}, the manifest asks for {action.group.embed_mode}")
    cache = attrs.get("ep_cache_context")
    if cache is None:
        bad("ep_cache_context", "is missing on a main_context = 1 node")
        return
    if embed == 1:
        if not cache:
            bad("ep_cache_context", "is empty although embed_mode = 1 (no embedded context)")
        elif isinstance(cache, str) and len(cache) < _MAX_PATH and _is_existing_ref(ws, ctx, cache):
            bad("ep_cache_context", f"names a file ({cache!r}) although embed_mode = 1")
        return
    if not isinstance(cache, str) or len(cache) > _MAX_PATH or "\x00" in cache:
        bad("ep_cache_context", "holds binary data although embed_mode = 0 (expects a path)")
        return
    _check_ref(ws, action, ctx, cache, "ep_cache_context", node.name, problems)


def _is_existing_ref(ws: Workspace, ctx: str, ref: str) -> bool:
    if not is_safe_reference(ref):
        return False
    return os.path.isfile(os.path.join(ws.root, posixpath.dirname(ctx), ref))


def _check_ref(
    ws: Workspace,
    action: Action,
    ctx: str,
    ref: str,
    attr: str,
    node: str | None,
    problems: list[Problem],
) -> str | None:
    """Check a path stored in a model; returns its workspace-relative form when usable."""
    if not ref:
        problems.append(Problem(ctx, "is empty", node=node, attribute=attr))
        return None
    if ref.startswith("/") or "\\" in ref or (len(ref) > 1 and ref[1] == ":"):
        problems.append(
            Problem(
                ctx,
                f"{ref!r} is absolute (must be relative to the model)",
                node=node,
                attribute=attr,
            )
        )
        return None
    if ".." in ref.split("/"):
        problems.append(Problem(ctx, f"{ref!r} contains '..'", node=node, attribute=attr))
        return None
    rel = posixpath.normpath(posixpath.join(posixpath.dirname(ctx), ref))
    out = ws.manifest.workspace.out_dir
    if not rel.startswith(out + "/"):
        problems.append(
            Problem(ctx, f"{ref!r} leaves the output directory", node=node, attribute=attr)
        )
        return None
    if not os.path.isfile(os.path.join(ws.root, rel)):
        problems.append(Problem(ctx, f"{ref!r} does not exist", node=node, attribute=attr))
        return None
    return rel


def _check_external(
    ws: Workspace, action: Action, ctx: str, info: ModelInfo, problems: list[Problem]
) -> None:
    bad_locations: set[str] = set()
    for ref in info.external_refs:
        where = f"tensor {ref.tensor}"
        if ref.location in bad_locations:
            continue
        rel = _check_ref(ws, action, ctx, ref.location, f"{where}: location", None, problems)
        if rel is None:
            bad_locations.add(ref.location)
            continue
        full = os.path.join(ws.root, rel)
        size = os.path.getsize(full)
        offset, length = ref.offset or 0, ref.length
        end = offset + (length if length is not None else 0)
        if offset < 0 or (length is not None and length < 0) or end > size or offset > size:
            problems.append(
                Problem(
                    ctx,
                    f"offset {offset} + length {length or 0} is past the end of "
                    f"{ref.location!r} ({size} bytes)",
                    attribute=f"{where}: offset/length",
                )
            )
            continue
        if ref.checksum:
            with open(full, "rb") as f:
                whole = f.read()
            part = whole[offset : end if length is not None else None]
            sums = {hashlib.sha1(whole).hexdigest(), hashlib.sha1(part).hexdigest()}
            if ref.checksum.lower() not in sums:
                problems.append(
                    Problem(
                        ctx,
                        f"SHA1 of {ref.location!r} does not match",
                        attribute=f"{where}: checksum",
                    )
                )


def _load_checks(ws: Workspace, action: Action) -> list[LoadCheck]:
    adapter = get_provider(action.provider.ep)
    load_problem = getattr(adapter, "load_problem", None)
    reason = load_problem(action.provider, action.group.share_weights) if load_problem else None
    if reason:
        return [LoadCheck(ctx, LoadOutcome.NOT_LOADABLE, reason) for ctx in action.ctx_paths]
    checks = []
    for model, ctx in zip(action.models, action.ctx_paths, strict=True):
        job = {"ctx": ctx, "source": model, "provider": action.provider.to_json()}
        check = _run_loader(ws.root, ctx, job)
        # Where the adapter says this host is not the target (QNN on x86_64 runs contexts in
        # an emulation), a native crash of the loader is the host's limit, not a bad build;
        # a corrupt context still fails with an error or wrong numbers.
        emulated = load_problem is not None and load_problem(action.provider, True) is not None
        if check.crashed and emulated:
            check = LoadCheck(
                ctx,
                LoadOutcome.NOT_LOADABLE,
                f"{check.message}; this host cannot load it, check it on the target",
            )
        checks.append(check)
    return checks


def _run_loader(root: str, ctx: str, job: dict[str, Any]) -> LoadCheck:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "epbuild.inspect.loadcheck"],
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
