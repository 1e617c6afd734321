"""Action keys: a digest of everything that can change an action's outputs.

Inputs are hashed through the stat cache; toolchain versions come from package metadata.
Nothing here imports onnx or onnxruntime: this is the no-op path.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import posixpath
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from epbuild._dataclass import dataclass
from epbuild._names import model_label, model_stem
from epbuild.errors import ModelError, ToolchainError, UserError
from epbuild.fs import is_safe_reference
from epbuild.manifest.model import SESSION_SETTINGS, CompileSettings, ModelEntry
from epbuild.planning.actions import CompileAction
from epbuild.providers import get_provider, library
from epbuild.providers.contract import Provider, ProviderConfig
from epbuild.providers.distributions import (
    dist_version,
    has_compile_api,
    onnxruntime_version,
    scanning,
)
from epbuild.state.statcache import StatCache
from epbuild.toolchains.resolve import Toolchains

ORT_KEY = "onnxruntime (toolchain)"
"""The version key naming a toolchain's ONNX Runtime, whichever package installs it."""
FORMAT_VERSION = "1"
"""epbuild's output-format version: bump it when the same inputs give different outputs."""


@dataclass(frozen=True)
class ActionKey:
    """An action's key and the components it was computed from."""

    key: str
    components: dict[str, Any]
    inputs: dict[str, str]
    """Workspace-relative input path → digest (models and external-data files)."""


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
        """Action id → the outputs its journal record lists (the workspace's state; a
        kind whose inputs are another action's outputs reads them by it)."""
        self._versions: dict[tuple[object, ...], dict[str, str]] = {}
        self._models: dict[tuple[str, str | None], tuple[str, dict[str, str]]] = {}
        self._compiles: dict[CompileSettings, dict[str, Any]] = {}
        self._layouts: dict[
            tuple[object, ...],
            tuple[tuple[object, ...], tuple[dict[str, Any], list[tuple[str, str | None]]]],
        ] = {}
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
                raise ModelError(
                    f"{model}: external data file {ref!r} is missing{where}",
                    hint="keep external-data files next to the model, as its 'location' says"
                    if folder is None
                    else "put the model's external-data files in external_data_folder",
                ) from exc
        self._models[memo] = (entry.digest, external)
        return self._models[memo]

    def _upstream_digest(self, rel: str) -> str | None:
        """The stand-in digest of an upstream action's output (``upstream``), else None."""
        for out_dir, key in self.upstream.items():
            if rel.startswith(out_dir + "/"):
                return f"{key}:{rel[len(out_dir) + 1 :]}"
        return None

    def _parse_refs(self, model: str, full: str, base: str, folder: bool) -> tuple[str, ...]:
        """The external-data files ``model`` references, found in ``base`` (its own folder,
        or its ``external_data_folder`` when ``folder``)."""
        from epbuild.onnx.proto import ProtoError, read_model

        try:
            info = read_model(full)
        except ProtoError as exc:
            raise ModelError(
                f"{model}: not a valid ONNX model ({exc})", hint="re-export or re-download it"
            ) from exc
        sizes: dict[str, int] = {}
        refs: list[str] = []
        for ref in info.external_refs:
            if not is_safe_reference(ref.location):
                raise ModelError(
                    f"{model}: tensor {ref.tensor!r} has unsafe external-data location "
                    f"{ref.location!r}",
                    hint="external data must be a relative path without '..' next to the model",
                )
            rel = posixpath.normpath(posixpath.join(base, ref.location))
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
                refs.append(rel)
            end = (ref.offset or 0) + (ref.length or 0)
            if end > sizes[rel]:
                raise ModelError(
                    f"{model}: tensor {ref.tensor!r} needs bytes up to {end} of {rel!r}, "
                    f"which has {sizes[rel]}",
                    hint="the external-data file is truncated; re-export the model",
                )
        return tuple(refs)

    def versions(self, action: CompileAction, *, fresh: bool = False) -> dict[str, str]:
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

    def settings(self, action: CompileAction) -> CompileSettings:
        """The action's compile settings; for a provider with a toolchain, the compiler
        its ONNX Runtime supports when the manifest leaves it to epbuild."""
        settings = action.compile
        if action.provider.toolchain is None:
            return settings
        ort = self.versions(action)[ORT_KEY]
        adapter = get_provider(action.provider.ep)
        if settings.compiler is None:
            api = adapter.compile_api and has_compile_api(ort)
            return replace(settings, compiler="compile_api" if api else "session")
        if settings.compiler == "compile_api" and not has_compile_api(ort):
            raise ToolchainError(
                f"provider {action.provider.name!r}: the onnxruntime {ort} of its toolchain "
                "has no compile API with the options epbuild needs (1.23 or newer)",
                hint='use compiler = "session", or a newer onnxruntime in the toolchain',
            )
        return settings

    def file_digest(self, rel: str) -> str:
        """The digest of an input file that is not a model (the stand-in of an upstream
        action's output, ``upstream``); raises ``OSError`` when it cannot be read."""
        stand_in = self._upstream_digest(rel)
        if stand_in is not None:
            return stand_in
        return self.stats.digest(self.root, rel).digest

    def option_files(self, action: CompileAction) -> dict[str, str]:
        """{path: digest} of the files the provider's options name (``file_options``)."""
        names = get_provider(action.provider.ep).file_options
        found: dict[str, str] = {}
        for name in sorted(names & action.provider.options.keys()):
            rel = action.provider.options[name]
            found[rel] = self.input_digest(
                rel,
                f"the file provider option {name!r} names",
                f"restore it, or remove {name} from [providers.{action.provider.name}]",
            )
        return found

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

    def compute(self, action: CompileAction, *, fresh: bool = False) -> ActionKey:
        """The action's key (raises ModelError for a broken input); ``fresh`` looks at the
        inputs again instead of taking this run's memoised digests (after a wait: another
        process or the user may have changed them meanwhile)."""
        models = []
        inputs: dict[str, str] = {}
        versions = self.versions(action)
        settings = self.settings(action)
        for entry, dims in zip(action.entries, action.free_dimensions, strict=True):
            digest, external = self.model_inputs(
                entry.path, settings.external_data_folder, fresh=fresh
            )
            models.append(
                {"path": entry.path, "digest": digest, "external": external, **_shape(entry, dims)}
            )
            inputs[entry.path] = digest
            inputs.update(external)
        g, provider = action.group, action.provider
        names = action.initializer_names
        files = self.option_files(action) if self._file_options(provider) else {}
        present = ("models", *(("initializer_names",) if names else ()),
                   *(("option_files",) if files else ()))  # fmt: skip
        template, layout = self._shared(provider, g, versions, settings, present)
        components = dict(template)
        components["models"] = models
        inputs.update(getattr(g, "source_inputs", {}))  # an LLM's source decoder
        if files:  # only then, so other keys stay as they were
            components["option_files"] = files
            inputs.update(files)
        if names:
            # The names depend on the group's size (one model keeps the configured name,
            # more get a stem prefix): a group that grows renames this action's outputs.
            # Only present when initializers go to a file, so other keys stay as they were.
            components["initializer_names"] = list(names)
        members = [
            text if name is None else text + _dumps(components[name]) for text, name in layout
        ]
        blob = ("{" + ",".join(members) + "}").encode()
        return ActionKey(hashlib.sha256(blob).hexdigest(), components, inputs)

    def _shared(
        self,
        provider: ProviderConfig,
        g: Any,
        versions: dict[str, str],
        settings: CompileSettings,
        present: tuple[str, ...],
    ) -> tuple[dict[str, Any], list[tuple[str, str | None]]]:
        """What every action of one provider and group shares: its components, in key
        order, with ``models`` to fill in (actions share these values: nothing changes a
        key's components once made), and how to write the key's canonical JSON (sorted,
        compact) with the per-action components ``present`` (of ``_PER_ACTION``): the
        members in key order, each either whole (text, None), for a shared component, or
        its start (``"name":``, name), written per action. A sorted object is its members'
        texts in key order, so the bytes are ``json.dumps(components, sort_keys=True,
        ...)``'s. Made once per set of ``sources`` (compared by identity, and kept so that
        their ids stay theirs) and ``present``."""
        sources = (provider, g, versions, settings)
        memo = (id(provider), id(g), id(versions), id(settings), present)
        hit = self._layouts.get(memo)
        if hit is not None and all(a is b for a, b in zip(hit[0], sources, strict=True)):
            return hit[1]
        components: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "ep": provider.ep,
            "provider_options": dict(provider.options),
            "session_options": dict(provider.session_options),
            "settings": dict(provider.settings),
            "versions": versions,
            "group": g.context.to_json(),
            "models": None,
            "compile": dict(self._compile_json(settings)),
        }
        if provider.toolchain is not None:  # only then, so other keys stay as they were
            components["toolchain"] = provider.toolchain.key()
        rewrite = get_provider(provider.ep).sharing_rewrite
        if g.context.share_weights and (done := rewrite(provider)):
            # Present only where a rewrite applies, so other keys stay as they were.
            components["group"]["rewrite"] = done
        layout: list[tuple[str, str | None]] = []
        for name in sorted({*components, *present}):
            start = f"{_dumps(name)}:"
            if name in _PER_ACTION:
                layout.append((start, name))
            else:
                layout.append((start + _dumps(components[name]), None))
        self._layouts[memo] = (sources, (components, layout))
        return components, layout

    def _file_options(self, provider: ProviderConfig) -> bool:
        """Whether the provider's options name files (``option_files`` has some to hash)."""
        names = get_provider(provider.ep).file_options
        return bool(names and not names.isdisjoint(provider.options))

    def _compile_json(self, settings: CompileSettings) -> dict[str, Any]:
        """``settings.to_json()``, made once per value (callers copy it)."""
        found = self._compiles.get(settings)
        if found is None:
            found = self._compiles[settings] = settings.to_json()
        return found


_PER_ACTION = ("models", "initializer_names", "option_files")
"""Key components that differ between actions of one provider and group."""


def _canonical_dumps() -> Callable[[Any], str]:
    """``json.dumps(value, sort_keys=True, separators=(",", ":"))``: the C encoder that
    ``JSONEncoder.encode`` makes on every call, made once (the key's per-action members
    are written 5,000 times for 5,000 actions); without the C encoder, the encoder's own
    ``encode``. Components are never circular, so no check for it."""
    encoder = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
    make = getattr(json.encoder, "c_make_encoder", None)  # (typeshed does not name it)
    if make is None:
        return encoder.encode
    write = make(None, encoder.default, json.encoder.encode_basestring_ascii, None,
                 ":", ",", True, False, True)  # fmt: skip
    return lambda value: "".join(write(value, 0))


_dumps = _canonical_dumps()


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


_stem = functools.lru_cache(maxsize=None)(model_stem)
"""``model_stem``, once per path (each model is keyed once per provider)."""


def _shape(entry: ModelEntry, dims: dict[str, int]) -> dict[str, Any]:
    """A model's output name and free dimensions, as key components: each only where the
    manifest sets it, so the keys of models that use neither stay as they were."""
    part: dict[str, Any] = {}
    if entry.name != _stem(entry.path):
        part["name"] = entry.name
    if dims:
        part["free_dimensions"] = dict(sorted(dims.items()))
    return part


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
