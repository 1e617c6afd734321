"""The compile kind's key: a digest of everything that can change a compile's outputs.

The source models' and their external data's digests (a quantized group's QDQ models named
by their place below ``out_dir``, not the workspace's), the provider's options, session
options and settings, the toolchain versions, the group's context settings, the compile
settings, and (only where present, so that other keys stay as they were) the files the
provider's options name and the external-initializer file names. Compile keys are exactly
what they were before the build graph (no ``kind`` component; ``tests/test_recorded_keys.py``
holds them). Inputs are hashed through ``KeyComputer``, once per run; nothing here imports
onnx or onnxruntime: this is the no-op path.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from epbuild._dataclass import replace
from epbuild._names import model_stem
from epbuild.errors import ToolchainError
from epbuild.fs import sha256_hex
from epbuild.manifest.model import CompileSettings, Group, ModelEntry
from epbuild.planning.actions import CompileAction
from epbuild.planning.keys import FORMAT_VERSION, ORT_KEY, ActionKey, KeyComputer
from epbuild.providers import get_provider
from epbuild.providers.contract import ProviderConfig
from epbuild.providers.distributions import has_compile_api
from epbuild.toolchains.lockfile import LOCK_NAME

_Layout = list[tuple[str, str | None]]
"""A key's canonical JSON as members in key order: each either whole (text, None), for a
shared component, or its start (``"name":``, name), written per action."""


class _Memo:
    """What the compile keys of one run share (``KeyComputer.memo``)."""

    def __init__(self) -> None:
        self.compiles: dict[CompileSettings, dict[str, Any]] = {}
        """``CompileSettings.to_json()``, made once per value (callers copy it)."""
        self.layouts: dict[
            tuple[object, ...], tuple[tuple[object, ...], tuple[dict[str, Any], _Layout]]
        ] = {}
        """What ``_shared`` made, by the identities of what it was made from."""


def compile_key(action: CompileAction, keys: KeyComputer, *, fresh: bool = False) -> ActionKey:
    """The action's key (raises ModelError for a broken input); ``fresh`` looks at the
    inputs again instead of taking this run's memoised digests (after a wait: another
    process or the user may have changed them meanwhile)."""
    models = []
    inputs: dict[str, str] = {}
    versions = keys.versions(action)
    settings = compile_settings(action, keys)
    # A quantized group's QDQ models: named by their place below out_dir (``key_path``).
    named: Callable[[str], str] | None = getattr(action.group, "key_path", None)
    for entry, dims in zip(action.entries, action.free_dimensions, strict=True):
        digest, external = keys.model_inputs(entry.path, settings.external_data_folder, fresh=fresh)
        path = entry.path if named is None else named(entry.path)
        models.append({"path": path, "digest": digest, "external": external, **_shape(entry, dims)})
        inputs[entry.path] = digest
        inputs.update(external)
    g, provider = action.group, action.provider
    names = action.initializer_names
    files = _option_files(action, keys) if _file_options(provider) else {}
    present: tuple[str, ...] = ("models",)
    present += ("initializer_names",) if names else ()
    present += ("option_files",) if files else ()
    template, layout = _shared(keys.memo(_Memo), provider, g, versions, settings, present)
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
    members = [text if name is None else text + _dumps(components[name]) for text, name in layout]
    blob = ("{" + ",".join(members) + "}").encode()
    return ActionKey(sha256_hex(blob), components, inputs)


def compile_settings(action: CompileAction, keys: KeyComputer) -> CompileSettings:
    """The action's compile settings; for a provider with a toolchain, the compiler
    its ONNX Runtime supports when the manifest leaves it to epbuild."""
    settings = action.compile
    if action.provider.toolchain is None:
        return settings
    ort = keys.versions(action).get(ORT_KEY)
    if ort is None:  # only a lock pins a toolchain's versions without it (one made by hand)
        raise ToolchainError(
            f"provider {action.provider.name!r}: {LOCK_NAME} pins no onnxruntime version "
            f"({ORT_KEY!r}) for its toolchain, which its keys are made from",
            hint=f"run 'epbuild lock' again (or remove {LOCK_NAME}) so that it pins the "
            "toolchain's onnxruntime",
        )
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


def _option_files(action: CompileAction, keys: KeyComputer) -> dict[str, str]:
    """{path: digest} of the files the provider's options name (``file_options``)."""
    names = get_provider(action.provider.ep).file_options
    found: dict[str, str] = {}
    for name in sorted(names & action.provider.options.keys()):
        rel = action.provider.options[name]
        found[rel] = keys.input_digest(
            rel,
            f"the file provider option {name!r} names",
            f"restore it, or remove {name} from [providers.{action.provider.name}]",
        )
    return found


def _file_options(provider: ProviderConfig) -> bool:
    """Whether the provider's options name files (``_option_files`` has some to hash)."""
    names = get_provider(provider.ep).file_options
    return bool(names and not names.isdisjoint(provider.options))


def _shared(
    memo: _Memo,
    provider: ProviderConfig,
    g: Group,
    versions: dict[str, str],
    settings: CompileSettings,
    present: tuple[str, ...],
) -> tuple[dict[str, Any], _Layout]:
    """What every action of one provider and group shares: its components, in key
    order, with ``models`` to fill in (actions share these values: nothing changes a
    key's components once made), and how to write the key's canonical JSON (sorted,
    compact) with the per-action components ``present`` (of ``_PER_ACTION``): the
    members in key order (``_Layout``). A sorted object is its members' texts in key
    order, so the bytes are ``json.dumps(components, sort_keys=True, ...)``'s. Made once
    per set of ``sources`` (compared by identity, and kept so that their ids stay
    theirs) and ``present``."""
    sources = (provider, g, versions, settings)
    key = (id(provider), id(g), id(versions), id(settings), present)
    hit = memo.layouts.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], sources, strict=True)):
        return hit[1]
    compiled = memo.compiles.get(settings)
    if compiled is None:
        compiled = memo.compiles[settings] = settings.to_json()
    components: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "ep": provider.ep,
        "provider_options": dict(provider.options),
        "session_options": dict(provider.session_options),
        "settings": dict(provider.settings),
        "versions": versions,
        "group": g.context.to_json(),
        "models": None,
        "compile": dict(compiled),
    }
    if provider.toolchain is not None:  # only then, so other keys stay as they were
        components["toolchain"] = provider.toolchain.key()
    rewrite = get_provider(provider.ep).sharing_rewrite
    if g.context.share_weights and (done := rewrite(provider)):
        # Present only where a rewrite applies, so other keys stay as they were.
        components["group"]["rewrite"] = done
    layout: _Layout = []
    for name in sorted({*components, *present}):
        start = f"{_dumps(name)}:"
        if name in _PER_ACTION:
            layout.append((start, name))
        else:
            layout.append((start + _dumps(components[name]), None))
    memo.layouts[key] = (sources, (components, layout))
    return components, layout


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
    asc = json.encoder.encode_basestring_ascii
    write = make(None, encoder.default, asc, None, ":", ",", True, False, True)
    return lambda value: "".join(write(value, 0))


_dumps = _canonical_dumps()


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
