"""The provider adapter contract: what an execution provider's adapter declares.

An adapter has two sides. The *coordinator* side (``validate_options``, ``versions``)
must not import onnxruntime or the EP package: it runs on the no-op path. The *worker*
side (``attach``) runs inside a fresh worker process that has imported onnxruntime.
Adapter authors import it, with the helpers an adapter calls, from ``providers.base``.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass, field
from epbuild.errors import ManifestError, ProviderUnavailableError
from epbuild.toolchains.spec import ToolchainSpec

if TYPE_CHECKING:
    from onnxruntime import SessionOptions


@dataclass(frozen=True)
class ProviderConfig:
    """A named provider configuration from the manifest, already validated."""

    name: str
    """Manifest name, e.g. ``htp-v73``."""
    ep: str
    """Adapter kind, e.g. ``qnn``."""
    options: Mapping[str, str]
    """Provider options passed to the EP (normalised to strings)."""
    session_options: Mapping[str, str] = field(default_factory=dict)
    """Extra ORT session config entries."""
    settings: Mapping[str, str] = field(default_factory=dict)
    """Adapter settings that are not EP options (e.g. plugin ``library``, ``ep_name``)."""
    base_dir: str = ""
    """Directory relative settings are resolved against (the manifest's); not in the key."""
    toolchain: ToolchainSpec | None = None
    """The environment its workers run in (None: epbuild's own); coordinator side only,
    so ``to_json`` leaves it out."""

    def resolve(self, path: str) -> str:
        """A setting's path, relative to the manifest's directory unless absolute."""
        return os.path.join(self.base_dir, path) if self.base_dir else path

    def to_json(self) -> dict[str, Any]:
        """The form that crosses process boundaries (jobs, load checks). Leaves ``base_dir``
        out: the receiving process runs in the manifest's directory (or its copy on a farm
        worker), where relative settings resolve as they are."""
        return {
            "name": self.name,
            "ep": self.ep,
            "options": dict(self.options),
            "session_options": dict(self.session_options),
            "settings": dict(self.settings),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProviderConfig:
        """Rebuild a config written by ``to_json``."""
        return cls(
            name=str(data["name"]),
            ep=str(data["ep"]),
            options=dict(data.get("options", {})),
            session_options=dict(data.get("session_options", {})),
            settings=dict(data.get("settings", {})),
        )


class BaseProvider(abc.ABC):
    """The adapter contract: every member an adapter may answer, each with its default, so
    that an adapter writes only what differs (``docs/providers.md``, "Writing an adapter").

    An adapter must set ``kind`` and define ``versions``, ``context_source`` and ``attach``.
    By default it takes no settings, passes its options through as strings (limited to
    ``known_options`` when set), writes no EP-specific context options, records no
    compatibility info, cannot vouch for its versions by stat (no no-op fingerprint), can
    load what it builds on this host, and changes nothing after a sharing group compiled.
    The coordinator side (``validate_options`` … ``package_target``) must not import
    onnxruntime; the worker side is ``attach`` and ``finish_sharing_group``.
    """

    kind: str
    """The manifest ``ep`` value that selects this adapter."""
    extra: str = ""
    """The pip extra that installs its EP package (``pip install "epbuild[<extra>]"``)."""
    shares_weights: bool = True
    """Whether the EP supports ``ep.share_ep_contexts`` weight-sharing groups."""
    fixed_ep_name: bool = False
    """The EP is built into onnxruntime under a fixed name: ``[package] ep_names`` cannot
    rename it."""
    compatibility_device_types: frozenset[str] | None = None
    """Device types the EP judges compiled models for (``inspect.ortcompat``); None: all."""
    ep_dists: tuple[str, ...] = ()
    """Distributions any one of which provides the EP: a toolchain with none of them cannot
    compile for it (empty: not checked, e.g. a plugin library given by path)."""
    compile_api: bool = True
    """Whether ``onnxruntime.ModelCompiler`` can compile for it (an adapter whose EP needs its
    own ``context_options`` to write a ctx model cannot; third-party adapters that do not
    say so get sessions)."""
    known_options: frozenset[str] | None = None
    """Option names the EP accepts; None passes any name through."""
    file_options: frozenset[str] = frozenset()
    """Options whose value names a file relative to the manifest: the manifest checks that
    it exists, and the action key holds its content's digest (``planning.keys``)."""
    quantization: str = "generic"
    """How a group compiled for it is quantized (``[quantization.*]``): ``qnn`` (ONNX
    Runtime's QNN configuration and preprocessing) or ``generic`` (its QDQ configuration)."""
    quant_activations: frozenset[str] = frozenset(("uint8", "uint16", "int8", "int16"))
    """Activation types its quantized models may use."""
    quant_weights: frozenset[str] = frozenset(("uint8", "int8", "uint16", "int16", "uint4", "int4"))
    """Weight types its quantized models may use."""

    def validate_options(
        self, options: Mapping[str, Any], settings: Mapping[str, Any], *, key: str
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Options first (``check_options``), then settings (``check_settings``)."""
        opts = self.check_options(options, key=f"{key}.options")
        return opts, self.check_settings(settings, key=key)

    def check_options(self, options: Mapping[str, Any], *, key: str) -> dict[str, str]:
        """The EP options as strings; ``key`` is the manifest's ``providers.<name>.options``."""
        return stringify_options(options, key=key, allowed=self.known_options)

    def check_settings(self, settings: Mapping[str, Any], *, key: str) -> dict[str, str]:
        """Adapter settings beside ``ep``; by default there are none."""
        if settings:
            name = next(iter(settings))
            raise ManifestError(
                f"{name!r} is not a setting of the {self.kind} provider", key=f"{key}.{name}"
            )
        return {}

    @abc.abstractmethod
    def versions(self, config: ProviderConfig) -> dict[str, str]:
        """Toolchain versions for the action key (``importlib.metadata``, no imports)."""

    def version_inputs(self, config: ProviderConfig) -> list[str] | None:
        """Files besides dist-info directories whose stat vouches for ``versions``; None
        when stat cannot vouch for them (the no-op fast path then stays off)."""
        return None

    def library_path(self, config: ProviderConfig) -> str | None:
        """The EP library file that compiles (found from package metadata, never by
        importing; within ``scanning``, a toolchain's); None where there is no file of its
        own or it is not installed. Its sha256 goes into the lock."""
        return None

    def sharing_rewrite(self, config: ProviderConfig) -> str | None:
        """What ``finish_sharing_group`` changes in a sharing group's outputs (a key
        component: groups built before the rewrite existed rebuild); None by default."""
        return None

    def load_problem(self, config: ProviderConfig, share_weights: bool) -> str | None:
        """Why a built context cannot be loaded on this host (``verify --load``, numerics,
        the runtime), or None (by default it can)."""
        return None

    def explain_load_failure(self, config: ProviderConfig, message: str) -> str | None:
        """A load failure that is the EP package's known limit rather than a bad build (the
        check is then "not loadable here"); None by default."""
        return None

    def standalone_loader(self, config: ProviderConfig) -> str | None:
        """The module (run like ``epbuild.inspection.loadcheck``) that runs a ctx model without
        the EP where ``explain_load_failure`` names a known limit of the EP's package, for
        ``verify --numerics``; None (by default) when there is none."""
        return None

    def check_installed(self, config: ProviderConfig, info: str) -> str | None:
        """Runtime side: why a context (its compatibility ``info``) does not fit the EP
        installed here (another SDK); None by default."""
        return None

    def needs_static_shapes(self, config: ProviderConfig) -> bool:
        """Whether symbolic input dimensions must be fixed before compiling; False by
        default (CPU and GPU EPs compile dynamic shapes)."""
        return False

    def refuse_quantization(
        self, activations: str, weights: str, per_channel: bool, overrides: Mapping[str, str]
    ) -> tuple[str, str, str] | None:
        """(manifest key, why, hint) when a quantization's types are ones the EP cannot
        run (``quant_activations``, ``quant_weights``); None when it can run them."""
        checks = [("activations", activations, self.quant_activations)]
        checks += [("weights", weights, self.quant_weights)]
        checks += [("overrides", t, self.quant_activations) for t in overrides.values()]
        for key, value, allowed in checks:
            if value not in allowed:
                return (
                    key,
                    f"{value} is not a type it can run",
                    f"use one of {', '.join(sorted(allowed))}",
                )
        return None

    def for_quantized(self, config: ProviderConfig) -> ProviderConfig:
        """The configuration a quantized group compiles with (``[quantization.*]``):
        ``config`` unless the EP wants other defaults for QDQ models."""
        return config

    def sharing_refusal(self, config: ProviderConfig) -> str | None:
        """Why the EP cannot compile a weight-sharing group for ``config`` (None: it can);
        by default, whether ``shares_weights`` says it can."""
        if self.shares_weights:
            return None
        return f"provider {config.name!r} ({config.ep}) does not support weight sharing"

    @abc.abstractmethod
    def context_source(self, config: ProviderConfig) -> str:
        """The ``source`` attribute its EPContext nodes carry (``""``: none)."""

    def accepts_source(self, config: ProviderConfig, source: str) -> bool:
        """Whether the EP loads EPContext nodes whose ``source`` is ``source``; by default
        only what it writes."""
        return source == self.context_source(config)

    def context_options(
        self, config: ProviderConfig, ctx_path: str, embed_mode: int
    ) -> dict[str, str]:
        """None by default: the EP reads the ``ep.context_*`` session options."""
        return {}

    def compatibility_key(self, config: ProviderConfig) -> str | None:
        """Name ``X`` of the ``ep_compatibility_info.X`` metadata it writes; None by default."""
        return None

    def compatibility_keys(self, config: ProviderConfig) -> tuple[str, ...]:
        """Every name its compatibility info may be stored under, the current one
        (``compatibility_key``) first, then older ones outputs built earlier carry."""
        key = self.compatibility_key(config)
        return () if key is None else (key,)

    def check_compatibility(self, config: ProviderConfig, info: str) -> str | None:
        """A message if ``info`` does not match the requested target; None by default."""
        return None

    def package_target(self, config: ProviderConfig) -> tuple[str, str | None]:
        """The EP name and device type (``cpu``/``gpu``/``npu``, None: any) an ONNX Runtime
        model package variant of its outputs declares (``epbuild.shipping``); by default the
        name its compatibility info and EPContext nodes carry, and no device constraint."""
        return (self.compatibility_key(config) or self.context_source(config) or self.kind, None)

    @abc.abstractmethod
    def attach(
        self, ort: Any, so: SessionOptions, config: ProviderConfig, ep_name: str | None = None
    ) -> None:
        """Worker side: register the EP if needed and add it to ``so``; raise
        ``ProviderUnavailableError`` naming the extra to install when the EP package or a
        device is missing. ``ep_name`` is the name an app registers the EP under (a
        package's ``[package] ep_names``), None for the adapter's own; an adapter whose EP
        cannot be renamed refuses another name with ``refuse_rename``."""

    def refuse_rename(self, config: ProviderConfig, ep_name: str | None) -> None:
        """Raise unless ``ep_name`` is None or the EP's fixed name (the one
        ``package_target`` declares)."""
        fixed = self.package_target(config)[0]
        if ep_name is not None and ep_name != fixed:
            raise ProviderUnavailableError(
                f"the {config.ep} execution provider is always named {fixed!r}, not {ep_name!r}",
                hint="package it without an ep_names entry for this provider",
            )

    def finish_sharing_group(self, config: ProviderConfig, ctx_paths: list[str]) -> None:
        """Worker side, after a weight-sharing group compiled (ctx models in session
        order): rewrite what ``sharing_rewrite`` says; nothing by default."""
        return


Provider = BaseProvider
"""The adapter contract's name in annotations."""


def refuse_options(
    options: Mapping[str, Any], refused: Mapping[str, tuple[str, str | None]], *, key: str
) -> None:
    """Refuse the first of ``options`` that ``refused`` names (option → message, hint)."""
    for name in options:
        if name in refused:
            message, hint = refused[name]
            raise ManifestError(message, key=f"{key}.{name}", hint=hint)


def stringify_options(
    options: Mapping[str, Any], *, key: str, allowed: frozenset[str] | None = None
) -> dict[str, str]:
    """Turn manifest option values into the strings ORT wants; refuse nested values.

    With ``allowed``, an unknown option key is an error naming it.
    """
    out: dict[str, str] = {}
    for name, value in options.items():
        if allowed is not None and name not in allowed:
            raise ManifestError(
                f"unknown provider option {name!r}",
                key=f"{key}.{name}",
                hint="known options: " + ", ".join(sorted(allowed)),
            )
        if isinstance(value, bool):
            out[name] = "1" if value else "0"
        elif isinstance(value, (int, float, str)):
            out[name] = str(value)
        else:
            raise ManifestError(
                f"option value must be a string, number or boolean, not {type(value).__name__}",
                key=f"{key}.{name}",
            )
    return out
