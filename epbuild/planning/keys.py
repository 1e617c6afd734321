"""Action keys: a digest of everything that can change an action's outputs, and the
service every kind computes its key with (``KeyComputer``: input digests and toolchain
versions, each found once per run; the compile kind's key: ``kinds.compilekey``).

Inputs are hashed through the stat cache; toolchain versions come from package metadata.
Nothing here imports onnx or onnxruntime: this is the no-op path.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from epbuild._dataclass import dataclass
from epbuild._names import model_label, model_stem
from epbuild.errors import ModelError, ToolchainError, UserError
from epbuild.fs import is_safe_reference
from epbuild.manifest.model import SESSION_SETTINGS
from epbuild.manifest.quantization import special_kind
from epbuild.providers import get_provider, library
from epbuild.providers.contract import Provider, ProviderConfig
from epbuild.providers.distributions import (
    dist_version,
    onnxruntime_version,
    scanning,
)
from epbuild.state.statcache import StatCache
from epbuild.toolchains.resolve import Toolchains

ORT_KEY = "onnxruntime (toolchain)"
"""The version key naming a toolchain's ONNX Runtime, whichever package installs it."""
FORMAT_VERSION = "1"
"""epbuild's output-format version of a compile (its key's ``format``): bump it when the same
inputs give different outputs."""
T = TypeVar("T")


def _refuse_special(model: str, rel: str, full: str, tensor: str | None = None) -> None:
    """A ``ModelError`` where the external-data file ``rel`` of ``model`` is a folder, a
    FIFO or a device (its size would pass for a truncated file; a FIFO's read never ends)."""
    kind = special_kind(full)
    if kind is not None:
        of = f" (tensor {tensor!r})" if tensor is not None else ""
        raise ModelError(
            f"{model}: external data file {rel!r}{of} is {kind}, not a regular file",
            hint="put the model's external-data file there, as its 'location' says",
        )


@dataclass(frozen=True)
class ActionKey:
    """An action's key and the components it was computed from."""

    key: str
    components: dict[str, Any]
    inputs: dict[str, str]
    """Workspace-relative input path → digest (models and external-data files)."""


@dataclass(frozen=True)
class Expected:
    """What a file will be once the build has restored the action that writes it."""

    digest: str
    copy: str | None
    """A local file with those bytes (the cache's object) to read a model's references
    from; None: none at hand."""


class ForProvider(Protocol):
    """An action that builds for a provider (a compile, a numerical check's compile)."""

    @property
    def provider(self) -> ProviderConfig: ...


class KeyComputer:
    """Computes action keys, hashing each input file at most once per run."""

    def __init__(
        self,
        root: str,
        stats: StatCache,
        problems: Mapping[str, UserError] | None = None,
        toolchains: Toolchains | None = None,
    ) -> None:
        self.root = root
        self.stats = stats
        self.problems: dict[str, UserError] = dict(problems or {})
        self.toolchains = toolchains or Toolchains(create=False)
        """Finds (a build: makes) the providers' toolchains."""
        self.upstream: dict[str, str] = {}
        """Output directory of an upstream action → its key: an input in that directory
        is identified by that key and its name instead of its bytes (``cache key`` before
        anything is built; see ``cache.operations``)."""
        self.outputs_of: Callable[[str], list[str]] = lambda action_id: []
        self.expected: dict[str, Expected] = {}
        """Workspace-relative path → what a stale action the build restores from the cache
        will put there: ``status`` keys the actions that read it by that (as the build
        will, once it has restored it; ``planning.cache_explain``), not by the file now."""
        """Action id → the outputs its journal record lists (the workspace's state; a
        kind whose inputs are another action's outputs reads them by it)."""
        self._versions: dict[tuple[object, ...], dict[str, str]] = {}
        self._models: dict[tuple[str, str | None], tuple[str, dict[str, str]]] = {}
        self._memos: dict[Callable[[], Any], Any] = {}
        self._by_provider: dict[int, tuple[ProviderConfig, tuple[object, ...], dict[str, str]]] = {}

    def model_inputs(
        self, model: str, folder: str | None = None, *, fresh: bool = False
    ) -> tuple[str, dict[str, str]]:
        """(digest, {external-data path: digest}) of a source model; its external data is
        looked up in ``folder`` when given (``external_data_folder``), else beside it.
        Memoised for the run unless ``fresh``: then the files are stat'ed again (and
        re-hashed where the stat cache no longer vouches for them)."""
        stand_in = self._upstream_digest(model)
        if stand_in is not None:
            return stand_in, {}
        if model in self.expected:
            return self._expected_inputs(model, folder)
        memo = (model, folder)
        if memo in self._models and not fresh:
            return self._models[memo]
        if model in self.problems:
            problem = self.problems[model]
            raise ModelError(problem.message, hint=problem.hint)
        full = os.path.join(self.root, model)
        try:
            entry = self.stats.digest(self.root, model)
        except FileNotFoundError as exc:
            raise ModelError(f"{model}: model file does not exist") from exc
        except OSError as exc:
            raise ModelError(f"{model}: cannot read: {exc.strerror}") from exc
        if entry.size == 0:
            raise ModelError(f"{model}: file is empty", hint="re-export the model")
        base = posixpath.dirname(model) if folder is None else folder
        refs = entry.refs if folder is None else None  # the stat cache holds refs beside it
        if refs is None:
            refs = self._parse_refs(model, full, base, folder is not None)
            if folder is None:
                entry = self.stats.with_refs(model, entry, refs)
        where = "" if folder is None else f" (external_data_folder {folder!r})"
        external: dict[str, str] = {}
        for ref in refs:
            try:
                external[ref] = self.stats.digest(self.root, ref).digest
            except OSError as exc:
                _refuse_special(model, ref, os.path.join(self.root, ref))
                raise ModelError(
                    f"{model}: external data file {ref!r} is missing{where}",
                    hint="keep external-data files next to the model, as its 'location' says"
                    if folder is None
                    else "put the model's external-data files in external_data_folder",
                ) from exc
        self._models[memo] = (entry.digest, external)
        return self._models[memo]

    def _expected_inputs(self, model: str, folder: str | None) -> tuple[str, dict[str, str]]:
        """``model_inputs`` of a model the build will restore (``expected``): its digest,
        and its external-data files as its cached copy references them."""
        from epbuild.onnx.proto import ProtoError, read_model

        expected = self.expected[model]
        if expected.copy is None:
            raise ModelError(f"{model}: the cache's copy is not at hand to read")
        try:
            info = read_model(expected.copy)
        except (ProtoError, OSError) as exc:
            raise ModelError(f"{model}: the cache's copy is unreadable ({exc})") from exc
        base = posixpath.dirname(model) if folder is None else folder
        external: dict[str, str] = {}
        for ref in info.external_refs:
            if not is_safe_reference(ref.location):
                raise ModelError(f"{model}: unsafe external-data location {ref.location!r}")
            rel = posixpath.normpath(posixpath.join(base, ref.location))
            external[rel] = self.input_digest(rel, f"external data of {model}", "")
        return expected.digest, external

    def _upstream_digest(self, rel: str) -> str | None:
        """The stand-in digest of an upstream action's output (``upstream``), else None."""
        for out_dir, key in self.upstream.items():
            if rel.startswith(out_dir + "/"):
                return f"{key}:{rel[len(out_dir) + 1 :]}"
        return None

    def _parse_refs(self, model: str, full: str, base: str, folder: bool) -> tuple[str, ...]:
        """The external-data files ``model`` references, found in ``base`` (its own folder,
        or its ``external_data_folder`` when ``folder``)."""
        from epbuild.onnx.proto import ProtoError, read_external_refs

        try:
            found = read_external_refs(full)
        except ProtoError as exc:
            raise ModelError(
                f"{model}: not a valid ONNX model ({exc})", hint="re-export or re-download it"
            ) from exc
        sizes: dict[str, int] = {}
        refs: list[str] = []
        for ref in found:
            if not is_safe_reference(ref.location):
                raise ModelError(
                    f"{model}: tensor {ref.tensor!r} has unsafe external-data location "
                    f"{ref.location!r}",
                    hint="external data must be a relative path without '..' next to the model",
                )
            rel = posixpath.normpath(posixpath.join(base, ref.location))
            if rel == model:  # ONNX Runtime would read the protobuf's own bytes as weights
                raise ModelError(
                    f"{model}: tensor {ref.tensor!r} has its external data 'location' in the "
                    "model file itself",
                    hint="save the model again with its weights in a file of their own "
                    "(onnx.save(model, path, save_as_external_data=True, location='NAME.data'))",
                )
            if rel not in sizes:
                try:
                    sizes[rel] = os.stat(os.path.join(self.root, rel)).st_size
                except OSError as exc:
                    raise ModelError(
                        f"{model}: external data file {rel!r} (tensor {ref.tensor!r}) is missing",
                        hint=f"external_data_folder is {base!r}: put the file there"
                        if folder
                        else None,
                    ) from exc
                _refuse_special(model, rel, os.path.join(self.root, rel), ref.tensor)
                refs.append(rel)
            end = (ref.offset or 0) + (ref.length or 0)
            if end > sizes[rel]:
                raise ModelError(
                    f"{model}: tensor {ref.tensor!r} needs bytes up to {end} of {rel!r}, "
                    f"which has {sizes[rel]}",
                    hint="the external-data file is truncated; re-export the model",
                )
        return tuple(refs)

    def memo(self, make: Callable[[], T]) -> T:
        """A kind's own memo for this run (what its keys share): ``make()``, made the first
        time it is asked for."""
        found: T | None = self._memos.get(make)
        if found is None:
            found = self._memos[make] = make()
        return found

    def versions(self, action: ForProvider, *, fresh: bool = False) -> dict[str, str]:
        """Toolchain versions for the action's provider (memoised unless ``fresh``): from
        epbuild's own environment, or from the provider's toolchain, whose Python version
        joins them (``ToolchainError`` when the toolchain is unusable, ``ToolchainPending``
        when it is not made yet)."""
        cfg = action.provider
        if not fresh:  # the same provider as last time (thousands of actions share one)
            hit = self._by_provider.get(id(cfg))
            if hit is not None and hit[0] is cfg and self._versions.get(hit[1]) is hit[2]:
                return hit[2]
        memo = (cfg.ep, tuple(sorted(cfg.settings.items())), cfg.toolchain, cfg.base_dir)
        if fresh or memo not in self._versions:
            self._versions[memo] = self._read_versions(cfg)
        found = self._versions[memo]
        self._by_provider[id(cfg)] = (cfg, memo, found)
        return found

    def _read_versions(self, cfg: ProviderConfig) -> dict[str, str]:
        return read_versions(cfg, self.toolchains)

    def file_digest(self, rel: str) -> str:
        """The digest of an input file that is not a model (the stand-in of an upstream
        action's output, ``upstream``); raises ``OSError`` when it cannot be read."""
        stand_in = self._upstream_digest(rel)
        if stand_in is not None:
            return stand_in
        if rel in self.expected:
            return self.expected[rel].digest
        return self.stats.digest(self.root, rel).digest

    def model_digests(self, model: str, *, fresh: bool = False) -> dict[str, str]:
        """{path: digest} of a source model and its external-data files (``model_inputs``):
        the inputs a kind that reads one model declares."""
        digest, external = self.model_inputs(model, fresh=fresh)
        return {model: digest, **external}

    def input_digest(self, rel: str, what: str, hint: str) -> str:
        """``file_digest``, or a ``ModelError`` saying that ``rel`` (``what``) cannot be
        read, with ``hint``."""
        try:
            return self.file_digest(rel)
        except OSError as exc:
            raise ModelError(f"{rel}: {what} cannot be read ({exc.strerror})", hint=hint) from exc


def read_versions(cfg: ProviderConfig, toolchains: Toolchains) -> dict[str, str]:
    """The versions of a provider's action keys: from epbuild's own environment, or from
    its toolchain (whose Python version joins them), or, for a toolchain not made yet,
    from ``epbuild.lock`` (``Toolchains.locked_versions``)."""
    locked = toolchains.locked_versions(cfg)
    if locked is not None:
        return locked  # the toolchain is made from the lock, exactly, when it compiles
    adapter = get_provider(cfg.ep)
    toolchain = toolchains.get(cfg)
    if toolchain is None:
        return with_library(adapter, cfg, dict(adapter.versions(cfg)))
    with scanning(toolchain.sites):
        found = with_library(adapter, cfg, dict(adapter.versions(cfg)))
        ep_dists = adapter.ep_dists
        has_ep = not ep_dists or any(dist_version(d) != "absent" for d in ep_dists)
        found[ORT_KEY] = onnxruntime_version()
    if not has_ep:
        raise ToolchainError(
            f"provider {cfg.name!r}: its toolchain ({toolchain.spec.label}) has no "
            f"{' or '.join(ep_dists)} installed, so it cannot compile for {cfg.ep}",
            hint=f"add {ep_dists[0]} to providers.{cfg.name}.toolchain",
        )
    found["python"] = toolchain.version
    return found


def with_library(adapter: Provider, cfg: ProviderConfig, found: dict[str, str]) -> dict[str, str]:
    """``found`` and the sha256 of the EP library that compiles (``library.KEY``), where
    the adapter names one: a rebuilt EP under the same version number is another EP."""
    path = adapter.library_path(cfg)
    if path is not None:
        found[library.KEY] = library.library_sha256(path)
    return found


def explain_difference(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human reasons why two key component sets differ."""
    try:
        return _explain(old, new)
    except (TypeError, KeyError, AttributeError, ValueError):
        return ["key changed (the recorded key components are unreadable)"]


def _explain(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    reasons: list[str] = []
    if old.get("format") != new.get("format"):
        reasons.append(f"epbuild output format {old.get('format')} → {new.get('format')}")
    for name in sorted(set(old.get("versions", {})) | set(new.get("versions", {}))):
        a, b = old.get("versions", {}).get(name), new.get("versions", {}).get(name)
        if a != b and name == library.KEY:  # a sha256: its head tells them apart
            reasons.append(f"EP library sha256 {(a or 'none')[:12]} → {(b or 'none')[:12]}")
        elif a != b:
            reasons.append(f"{name} {a} → {b}")
    for section, label in (
        ("provider_options", "provider option"),
        ("session_options", "session option"),
        ("settings", "provider setting"),
        ("group", "group setting"),
        ("toolchain", "toolchain"),
    ):
        a_map, b_map = old.get(section, {}), new.get(section, {})
        for name in sorted(set(a_map) | set(b_map)):
            a, b = a_map.get(name), b_map.get(name)
            if a != b:
                reasons.append(f"{label} {name}: {_show(a)} → {_show(b)}")
    a_files, b_files = old.get("option_files", {}), new.get("option_files", {})
    for rel in sorted(set(a_files) | set(b_files)):
        if rel in a_files and rel in b_files and a_files[rel] != b_files[rel]:
            reasons.append(f"option file {rel} changed")
    reasons += _compile_reasons(old, new)
    same_setting = old.get("group", {}).get("external_initializers") == new.get("group", {}).get(
        "external_initializers"
    )  # a changed setting is reported above already
    if same_setting and old.get("initializer_names") != new.get("initializer_names"):
        reasons.append(_initializer_reason(old.get("initializer_names"), new["initializer_names"]))
    if old.get("ep") != new.get("ep"):
        reasons.append(f"provider adapter {old.get('ep')} → {new.get('ep')}")
    reasons += _model_reasons(old.get("models", []), new.get("models", []), bool(reasons))
    return reasons or ["key changed"]


def _model_reasons(
    old_list: list[dict[str, Any]], new_list: list[dict[str, Any]], earlier: bool
) -> list[str]:
    """Why the models of two key component sets differ (``earlier``: other reasons were
    found, so a mere reordering goes unsaid)."""
    reasons: list[str] = []
    old_models = {_model_label(m): m for m in old_list}
    new_models = {_model_label(m): m for m in new_list}
    for label, m in new_models.items():
        before = old_models.get(label)
        if before is None:
            reasons.append(f"model {label} added")
            continue
        if before["digest"] != m["digest"]:
            reasons.append(f"model {label} changed")
        for ext in sorted(set(before["external"]) | set(m["external"])):
            a, b = before["external"].get(ext), m["external"].get(ext)
            if a != b:
                what = "added" if a is None else "removed" if b is None else "changed"
                reasons.append(f"external data {ext} of {label} {what}")
        a_dims, b_dims = before.get("free_dimensions", {}), m.get("free_dimensions", {})
        for dim in sorted(set(a_dims) | set(b_dims)):
            if a_dims.get(dim) != b_dims.get(dim):
                reasons.append(
                    f"free dimension {dim} of {label}: {_show(a_dims.get(dim))} → "
                    f"{_show(b_dims.get(dim))}"
                )
    for label in old_models:
        if label not in new_models:
            reasons.append(f"model {label} removed")
    if not earlier and not reasons and list(old_models) != list(new_models):
        reasons.append("model order changed")
    return reasons


def _model_label(component: dict[str, Any]) -> str:
    """A model in reasons: ``model_label`` (the name is a component only where it is not
    the file's stem)."""
    path: str = component["path"]
    return model_label(path, component.get("name") or model_stem(path))


def _compile_reasons(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Changed compile settings; a key recorded before they were keyed compiled with what
    ``SESSION_SETTINGS`` says."""
    if "compile" not in new:
        return []
    before = old.get("compile", SESSION_SETTINGS.to_json())
    after = new["compile"]
    reasons = [
        f"compile setting {name}: {_show(before.get(name))} → {_show(after.get(name))}"
        for name in sorted(set(before) | set(after))
        if before.get(name) != after.get(name)
    ]
    if not reasons and "compile" not in old:
        reasons.append("the compile settings were not in the recorded key")
    return reasons


def _initializer_reason(old: list[str] | None, new: list[str]) -> str:
    if old is None:  # recorded before the names were part of the key
        return f"external-initializer file names {_names(new)} were not in the recorded key"
    return (
        f"external-initializer file names {_names(old)} → {_names(new)} "
        "(they depend on how many models the group has)"
    )


def _names(names: list[str] | None) -> str:
    return ", ".join(names or [])


def _show(value: object) -> str:
    return "unset" if value is None else json.dumps(value)
