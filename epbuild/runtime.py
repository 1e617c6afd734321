"""The inference side: open built EPContext models as ONNX Runtime sessions.

``open_action`` opens one built action (or every action of one group and provider) in
manifest order; ``open_models`` does the same for ctx models named directly. Sessions of a
weight-sharing group get ``ep.share_ep_contexts=1`` and hold the process-wide shared-workspace
lock for as long as they are open, so two sharing groups never use the EP's singleton at
once. ``close`` (or leaving the ``with`` block) destroys the sessions in the reverse order of
creation, whatever happened. Before any session is created each ctx model's EPContext
``source`` and ``ep_compatibility_info`` are checked against the EP (and ONNX Runtime's own
verdict, where it gives one: ``EP_UNSUPPORTED`` refuses); a mismatch raises
``CompatibilityError`` (the seed's INVALID_GRAPH case) instead of a late native failure.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from epbuild._names import ctx_stem
from epbuild.errors import CompatibilityError, LockTimeoutError, UserError

if TYPE_CHECKING:
    from types import TracebackType

    from epbuild.providers.base import ProviderConfig

ModelSource = str | os.PathLike[str] | tuple[str | os.PathLike[str], bytes]
"""A ctx model path, or ``(path, bytes)``: an in-memory model and the path it was built at
(its directory is where the EP looks for the context binary, via ``ep.context_file_path``)."""

SessionFactory = Callable[[Any, Any], Any]
"""``(path or bytes, SessionOptions) -> session``; default ``onnxruntime.InferenceSession``."""

_SHARED_WORKSPACE = threading.Lock()
"""The EP's shared workspace (behind ``ep.share_ep_contexts``) is process-wide."""


def _acquire_shared(timeout: float | None, what: str) -> None:
    if not _SHARED_WORKSPACE.acquire(timeout=-1 if timeout is None else timeout):
        raise LockTimeoutError(
            f"timed out after {timeout:g}s waiting to open {what}: another weight-sharing "
            "group is open in this process",
            hint="close the other group first (sessions of two sharing groups must not mix)",
        )


@contextmanager
def shared_workspace(timeout: float | None = None, what: str = "a sharing group") -> Iterator[None]:
    """Hold the process-wide shared-workspace lock (waits while another group holds it)."""
    _acquire_shared(timeout, what)
    try:
        yield
    finally:
        _SHARED_WORKSPACE.release()


class BuiltAction:
    """Open sessions of built ctx models, in creation order. Use as a context manager."""

    def __init__(self, names: list[str], share_weights: bool) -> None:
        self.names = names
        """Model names (ctx file stems without ``_ctx``), in creation order."""
        self.share_weights = share_weights
        self._sessions: list[tuple[str, Any]] = []
        self._release: Callable[[], None] | None = None
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
        try:
            while self._sessions:
                entry = self._sessions.pop()
                del entry  # the last reference: ORT releases the session here
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()


def check_context(label: str, data: bytes | None, path: str, provider: ProviderConfig) -> None:
    """Raise ``CompatibilityError`` if a ctx model is not for this EP and its installed SDK."""
    from epbuild.onnx.context import compatibility_problems, missing_context, source_problems
    from epbuild.onnx.proto import ProtoError, parse_model, read_model
    from epbuild.providers import get_provider

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
    from epbuild.inspect.ortcompat import ort_compatibility
    from epbuild.onnx.context import Severity

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
    from epbuild.providers import get_provider

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
        load_problem = getattr(adapter, "load_problem", None)
        problem = load_problem(provider, share_weights) if load_problem else None
        if problem:
            raise CompatibilityError(problem)
    for path, data in items:
        check_context(path, data, path, provider)
    built = BuiltAction([ctx_stem(p) for p, _ in items], share_weights)
    if share_weights:
        _acquire_shared(lock_timeout, ", ".join(built.names))
        built._release = _SHARED_WORKSPACE.release
    try:
        _create(built, items, provider, adapter, share_weights, session_factory)
    except BaseException:
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
            adapter.attach(ort, so, provider)
        try:
            session = factory(data if data is not None else path, so)
        except Exception as exc:
            text = str(exc).strip().splitlines()
            raise CompatibilityError(
                f"{path}: ONNX Runtime could not load it: {text[0] if text else type(exc).__name__}"
            ) from exc
        built._sessions.append((name, session))


def open_action(
    selector: str,
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    *,
    load: Literal["path", "bytes"] = "path",
    lock_timeout: float | None = None,
    session_factory: SessionFactory | None = None,
) -> BuiltAction:
    """Open a built action (``group/provider`` or an action id) of a workspace."""
    from epbuild.planning.workspace import open_workspace

    ws = open_workspace(directory, manifest, [selector])
    actions = ws.actions
    pairs = {(a.group.name, a.provider.name) for a in actions}
    if len(pairs) != 1:
        raise UserError(
            f"{selector!r} selects {len(pairs)} group/provider pairs",
            hint="name one: " + ", ".join(sorted(f"{g}/{p}" for g, p in pairs)),
        )
    missing = [a.id for a in actions if a.id not in ws.state.records]
    if missing:
        raise UserError(f"{missing[0]} has not been built", hint="run 'epbuild build' first")
    if load not in ("path", "bytes"):
        raise UserError(f"load must be 'path' or 'bytes', not {load!r}")
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
    return open_models(
        sources,
        first.provider,
        share_weights=first.group.share_weights,
        lock_timeout=lock_timeout,
        session_factory=session_factory,
    )
