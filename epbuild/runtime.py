"""The inference side: open built EPContext models as ONNX Runtime sessions.

``open_action`` opens one built action (or every action of one group and provider) in
manifest order; ``open_models`` does the same for ctx models named directly.

``open_action`` opens only what a build fully committed: an action never built, one whose
last commit was interrupted (a journal ``begin`` without its ``done``), or one whose
recorded outputs are missing or changed raises ``NotBuiltError`` ("run epbuild build").
The check (``planning.committed``) is cheap: sizes against the journal, and a file's digest
is trusted from the stat cache while its (inode, size, mtime) still match; only a file whose
stat changed is re-hashed (``check="hash"`` re-hashes every output). The outputs' stats are
taken again after the sessions exist: a build that replaced them meanwhile makes the open
fail instead of handing out sessions of a half-old, half-new group.

Sessions of a weight-sharing group get ``ep.share_ep_contexts=1``. At load time the EP's
share state is a process-wide table of graphs: a group's first session loads the shared
context binary and leaves the graphs of the other members there, and each later session
takes its own out by graph name. So one process-wide lock is held while a group's sessions
are being *created*, and released once they all exist: two sharing groups (a vision encoder
and a text decoder of one app) can then be open at once, but never created interleaved.
Opening a sharing group from inside another one's creation in the same thread (a session
factory that opens another group) raises ``UserError`` at once instead of deadlocking.
``close`` (or leaving the ``with`` block) destroys the sessions in the reverse order of
creation, whatever happened; if creating the k-th session fails, the first k-1 are destroyed
in reverse before the error propagates. Before any session is created each ctx model's
EPContext ``source`` and ``ep_compatibility_info`` are checked against the EP (and ONNX
Runtime's own verdict, where it gives one: ``EP_UNSUPPORTED`` refuses); a mismatch raises
``CompatibilityError`` (the seed's INVALID_GRAPH case) instead of a late native
failure.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal

from epbuild._names import ctx_stem
from epbuild.errors import CompatibilityError, LockTimeoutError, NotBuiltError, UserError
from epbuild.inspection.ortcompat import ort_compatibility
from epbuild.onnx.context import Severity, compatibility_problems, missing_context, source_problems
from epbuild.onnx.proto import ProtoError, parse_model, read_model
from epbuild.planning.committed import committed_outputs, stat_of
from epbuild.planning.workspace import open_workspace
from epbuild.providers import get_provider
from epbuild.toolchains.env import same_interpreter

if TYPE_CHECKING:
    from types import TracebackType

    from epbuild.planning.actions import CompileAction
    from epbuild.planning.workspace import Workspace
    from epbuild.providers.contract import ProviderConfig

ModelSource = str | os.PathLike[str] | tuple[str | os.PathLike[str], bytes]
"""A ctx model path, or ``(path, bytes)``: an in-memory model and the path it was built at
(its directory is where the EP looks for the context binary, via ``ep.context_file_path``)."""

SessionFactory = Callable[[Any, Any], Any]
"""``(path or bytes, SessionOptions) -> session``; default ``onnxruntime.InferenceSession``."""

_SHARED_WORKSPACE = threading.Lock()
"""Held while one sharing group's sessions are being created (the EP's table of shared
graphs is process-wide); released once they all exist."""

_creating = threading.local()
"""``what``: the sharing group this thread is creating sessions of, if any."""


@contextmanager
def shared_workspace(timeout: float | None = None, what: str = "a sharing group") -> Iterator[None]:
    """Hold the process-wide share state while one sharing group's sessions are created
    (waits while another thread creates one); refuses, without waiting, to nest inside this
    thread's own creation of another group, which would mix the two groups' graphs."""
    outer: str | None = getattr(_creating, "what", None)
    if outer is not None:
        raise UserError(
            f"cannot open sharing group {what} while the sessions of sharing group {outer} "
            "are being created in this thread (the EP's shared graphs are process-wide)",
            hint="open one group after the other; both can then stay open",
        )
    if not _SHARED_WORKSPACE.acquire(timeout=-1 if timeout is None else timeout):
        raise LockTimeoutError(
            f"timed out after {timeout:g}s waiting to open {what}: another weight-sharing "
            "group's sessions are being created in this process",
            hint="retry, or give lock_timeout more time (sessions of two sharing groups "
            "must not be created at the same time)",
        )
    _creating.what = what
    try:
        yield
    finally:
        _creating.what = None
        _SHARED_WORKSPACE.release()


class BuiltAction:
    """Open sessions of built ctx models, in creation order. Use as a context manager."""

    def __init__(self, names: list[str], share_weights: bool) -> None:
        self.names = names
        """Model names (ctx file stems without ``_ctx``), in creation order."""
        self.share_weights = share_weights
        self._sessions: list[tuple[str, Any]] = []
        self._closed = False

    def __enter__(self) -> BuiltAction:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran."""
        return self._closed

    def session(self, name: str) -> Any:
        """The ``InferenceSession`` of one model (borrowed: do not keep it past ``close``)."""
        if self._closed:
            raise UserError("the built action is closed")
        for n, sess in self._sessions:
            if n == name:
                return sess
        raise UserError(f"no model {name!r} here", hint="models: " + ", ".join(self.names))

    def run(
        self, name: str, feeds: Mapping[str, Any], outputs: Sequence[str] | None = None
    ) -> list[Any]:
        """Run one model; returns its outputs (numpy arrays)."""
        return list(self.session(name).run(list(outputs) if outputs else None, dict(feeds)))

    def close(self) -> None:
        """Destroy the sessions in the reverse order of creation; idempotent."""
        if self._closed:
            return
        self._closed = True
        while self._sessions:
            self._sessions.pop()  # the last reference: ORT releases the session here


def check_context(label: str, data: bytes | None, path: str, provider: ProviderConfig) -> None:
    """Raise ``CompatibilityError`` if a ctx model is not for this EP and its installed SDK."""
    adapter = get_provider(provider.ep)
    try:
        info = parse_model(data) if data is not None else read_model(path)
    except (ProtoError, OSError) as exc:
        raise UserError(f"{label}: cannot read the ctx model: {exc}") from exc
    missing = missing_context(label, info)
    if missing is not None:
        raise CompatibilityError(f"{label}: {missing.message}; it is not a built ctx model")
    wrong = source_problems(label, info, adapter, provider)
    if wrong:
        raise CompatibilityError(
            f"{label}: EPContext node {wrong[0].node}: source {wrong[0].message}",
            hint="open it with the provider it was built for",
        )
    refused = compatibility_problems(label, info, adapter, provider, installed=True)
    if refused:
        attr = refused[0].attribute or ""
        raise CompatibilityError(
            f"{label}: {attr} {refused[0].message}",
            hint="rebuild it with 'epbuild build'"
            if attr not in info.metadata
            else "rebuild it for this target and SDK ('epbuild build'), or install the EP "
            "version it was built with",
        )

    judged = ort_compatibility(label, path, provider, data).problem()
    if judged is not None and judged.severity is Severity.ERROR:
        raise CompatibilityError(
            judged.line(), hint="rebuild it with this device's target in the provider options"
        )


def open_models(
    models: Sequence[ModelSource],
    provider: ProviderConfig,
    *,
    share_weights: bool = False,
    lock_timeout: float | None = None,
    session_factory: SessionFactory | None = None,
) -> BuiltAction:
    """Create one session per ctx model, in order; see the module docstring."""
    return open_sources(models, provider, share_weights, lock_timeout, session_factory, None)


def open_sources(
    models: Sequence[ModelSource],
    provider: ProviderConfig,
    share_weights: bool,
    lock_timeout: float | None,
    session_factory: SessionFactory | None,
    what: str | None,
    ep_name: str | None = None,
) -> BuiltAction:
    """``open_models``; ``what`` names the group in lock messages (default: the models);
    ``ep_name`` registers a plugin EP under that name (a package's declared name)."""
    adapter = get_provider(provider.ep)
    items: list[tuple[str, bytes | None]] = []
    for m in models:
        if isinstance(m, tuple):
            items.append((os.fspath(m[0]), bytes(m[1])))
        else:
            items.append((os.fspath(m), None))
    if not items:
        raise UserError("no ctx model to open")
    if session_factory is None:
        problem = adapter.load_problem(provider, share_weights)
        if problem:
            raise CompatibilityError(problem)
    for path, data in items:
        check_context(path, data, path, provider)
    built = BuiltAction([ctx_stem(p) for p, _ in items], share_weights)
    hold = shared_workspace(lock_timeout, what or ", ".join(built.names))
    with hold if share_weights else nullcontext():
        try:
            _create(built, items, provider, adapter, share_weights, session_factory, ep_name)
        except BaseException:  # the sessions made so far go, in reverse, before the error
            built.close()
            raise
    return built


def _create(
    built: BuiltAction,
    items: list[tuple[str, bytes | None]],
    provider: ProviderConfig,
    adapter: Any,
    share_weights: bool,
    session_factory: SessionFactory | None,
    ep_name: str | None = None,
) -> None:
    import onnxruntime as ort

    factory: SessionFactory = session_factory or ort.InferenceSession
    for (path, data), name in zip(items, built.names, strict=True):
        so = ort.SessionOptions()
        if share_weights:
            so.add_session_config_entry("ep.share_ep_contexts", "1")
        if data is not None:
            # Tells the EP where the context binary (and external initializers) live.
            so.add_session_config_entry("ep.context_file_path", path)
            so.add_session_config_entry(
                "session.model_external_initializers_file_folder_path",
                os.path.dirname(path) or ".",
            )
        for k, v in provider.session_options.items():
            so.add_session_config_entry(k, v)
        if session_factory is None:
            adapter.attach(ort, so, provider, ep_name)
        # No local name for the session: a traceback keeps this frame's locals alive, which
        # would keep the last good session past close() when the next one fails.
        try:
            built._sessions.append((name, factory(data if data is not None else path, so)))
        except Exception as exc:
            text = str(exc).strip().splitlines()
            first = text[0] if text else type(exc).__name__
            known = adapter.explain_load_failure(provider, first)
            raise CompatibilityError(
                f"{path}: ONNX Runtime could not load it: {known or first}"
            ) from exc


def open_action(
    selector: str,
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    *,
    load: Literal["path", "bytes"] = "path",
    check: Literal["stat", "hash"] = "stat",
    lock_timeout: float | None = None,
    session_factory: SessionFactory | None = None,
) -> BuiltAction:
    """Open a built action (``group/provider`` or an action id) of a workspace; only what a
    build fully committed (``check``: see the module docstring)."""
    if load not in ("path", "bytes"):
        raise UserError(f"load must be 'path' or 'bytes', not {load!r}")
    if check not in ("stat", "hash"):
        raise UserError(f"check must be 'stat' or 'hash', not {check!r}")
    ws = open_workspace(directory, manifest, [selector])
    actions = ws.actions
    pairs = {(a.group.name, a.provider.name) for a in actions}
    if len(pairs) != 1:
        raise UserError(
            f"{selector!r} selects {len(pairs)} group/provider pairs",
            hint="name one: " + ", ".join(sorted(f"{g}/{p}" for g, p in pairs)),
        )
    before = committed_outputs(ws, actions, rehash=check == "hash")
    _check_environment(ws, actions[0])
    sources: list[ModelSource] = []
    for a in actions:
        for rel in a.ctx_paths:
            full = os.path.join(ws.root, rel)
            if load == "bytes":
                with open(full, "rb") as f:
                    sources.append((full, f.read()))
            else:
                sources.append(full)
    first = actions[0]
    what = f"{first.group.name}/{first.provider.name}"
    share = first.group.context.share_weights
    built = open_sources(sources, first.provider, share, lock_timeout, session_factory, what)
    changed = [rel for rel, st in before.items() if stat_of(ws.root, rel) != st]
    if changed:
        built.close()
        owner = next(a.id for a in actions if changed[0] in ws.state.records[a.id].outputs)
        raise NotBuiltError(
            f"{owner}: output {changed[0]} was replaced while its sessions were being "
            "created (a build is committing it)",
            hint="open it again once that build is done",
        )
    return built


def _check_environment(ws: Workspace, action: CompileAction) -> None:
    """An action compiled in a provider's toolchain opens only in that toolchain's Python:
    any other ONNX Runtime (this one, with other EPs) cannot load what it wrote."""
    toolchain = ws.keys.toolchains.get(action.provider)
    if toolchain is None or same_interpreter(toolchain):
        return
    raise UserError(
        f"{action.group.name}/{action.provider.name} was compiled in the toolchain of provider "
        f"{action.provider.name!r} ({toolchain.spec.label}); this Python ({sys.prefix}) runs "
        "another ONNX Runtime, which cannot load it",
        hint=f"open it from a program run by {toolchain.python} (with epbuild importable "
        "there), or check it with 'epbuild verify --load', which loads it in the toolchain",
    )
