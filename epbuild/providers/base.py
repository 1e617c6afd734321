"""The provider adapter interface: how an execution provider plugs into epbuild.

An adapter has two sides. The *coordinator* side (``validate_options``, ``versions``)
must not import onnxruntime or the EP package: it runs on the no-op path. The *worker*
side (``attach``) runs inside a fresh worker process that has imported onnxruntime.
"""

from __future__ import annotations

import abc
import contextvars
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from epbuild.errors import ManifestError, ProviderUnavailableError
from epbuild.toolchains.spec import ToolchainSpec

if TYPE_CHECKING:
    import onnxruntime


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
    onnxruntime; the worker side is ``attach``, ``attach_as``, ``finish_sharing_group``.
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
        """The module (run like ``epbuild.inspect.loadcheck``) that runs a ctx model without
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

    def attach_as(
        self,
        ort: onnxruntime,
        so: onnxruntime.SessionOptions,
        config: ProviderConfig,
        ep_name: str,
    ) -> None:
        """``attach``, with a plugin EP registered as ``ep_name`` (the name an app registers
        it under: a package's ``[package] ep_names``). By default the EP's name is fixed:
        ``ep_name`` must be the one ``package_target`` declares."""
        fixed = self.package_target(config)[0]
        if ep_name != fixed:
            raise ProviderUnavailableError(
                f"the {config.ep} execution provider is always named {fixed!r}, not {ep_name!r}",
                hint="package it without an ep_names entry for this provider",
            )
        self.attach(ort, so, config)

    @abc.abstractmethod
    def attach(
        self, ort: onnxruntime, so: onnxruntime.SessionOptions, config: ProviderConfig
    ) -> None:
        """Worker side: register the EP if needed and add it to ``so``; raise
        ``ProviderUnavailableError`` naming the extra to install when the EP package or a
        device is missing."""

    def finish_sharing_group(self, config: ProviderConfig, ctx_paths: list[str]) -> None:
        """Worker side, after a weight-sharing group compiled (ctx models in session
        order): rewrite what ``sharing_rewrite`` says; nothing by default."""
        return


Provider = BaseProvider
"""The adapter contract's name in annotations."""


_DIST_INFO: dict[tuple[str, ...] | None, dict[str, tuple[str, str]]] = {}
_SITES: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "epbuild_sites", default=None
)


def _normalise(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


@contextmanager
def scanning(sites: tuple[str, ...]) -> Iterator[None]:
    """Within the block (this thread only), ``dist_version`` and ``dist_location`` look at
    another environment's site directories (a toolchain's) instead of ``sys.path``; a
    distribution not found there is ``"absent"``: this environment's is never used."""
    token = _SITES.set(tuple(sites))
    try:
        yield
    finally:
        _SITES.reset(token)


def forget_dist_info() -> None:
    """Drop the memoised scans (installs may have changed them)."""
    _DIST_INFO.clear()


def _scan_dist_info() -> dict[str, tuple[str, str]]:
    """Normalised distribution name → (version, site directory), from ``*.dist-info`` names.

    One ``listdir`` per ``sys.path`` entry (or per site directory of the environment
    ``scanning`` names): far cheaper than importing importlib.metadata, and this runs on
    every no-op build. The first directory wins, as for imports.
    """
    sites = _SITES.get()
    found = _DIST_INFO.get(sites)
    if found is None:
        found = {}
        for directory in sys.path if sites is None else sites:
            try:
                names = os.listdir(directory or ".")
            except OSError:
                continue
            for entry in names:
                if entry.endswith(".dist-info") and "-" in entry:
                    name, _, version = entry[: -len(".dist-info")].partition("-")
                    found.setdefault(_normalise(name), (version, directory))
        _DIST_INFO[sites] = found
    return found


def canonical_name(name: str) -> str:
    """A distribution's name as the lock writes it (PEP 503: ``onnxruntime-qnn``)."""
    return name.lower().replace("_", "-").replace(".", "-")


def installed_distributions() -> dict[str, tuple[str, str]]:
    """Every distribution the fast scan finds (this environment's, or within ``scanning``
    another's): canonical name → (version, site directory)."""
    return {canonical_name(n): hit for n, hit in sorted(_scan_dist_info().items())}


def shared_library(site: str, package: str, stem: str) -> str:
    """The path of a package's shared library ``stem`` as this platform names it."""
    if sys.platform == "win32":
        name = f"{stem}.dll"
    elif sys.platform == "darwin":
        name = f"lib{stem}.dylib"
    else:
        name = f"lib{stem}.so"
    return os.path.join(site, package, name)


def dist_location(dist: str) -> str | None:
    """The site directory a distribution is installed in, if found by the fast scan."""
    hit = _scan_dist_info().get(_normalise(dist))
    return hit[1] if hit else None


def dist_version(dist: str) -> str:
    """Installed version of a distribution, or ``"absent"``; never imports it."""
    hit = _scan_dist_info().get(_normalise(dist))
    if hit is not None:
        return hit[0]
    if _SITES.get() is not None:
        return "absent"  # another environment: this one's metadata says nothing about it
    import importlib.metadata  # slow path: egg-info and other layouts

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


ORT_DISTS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino", "onnxruntime-directml")
"""Distributions that install ONNX Runtime itself (plugin EP packages do not)."""
COMPILE_API_SINCE = (1, 23)
"""``onnxruntime.ModelCompiler`` came in 1.22; its ``flags`` (``ERROR_IF_NO_NODES_COMPILED``)
and ``graph_optimization_level``, which epbuild passes, in 1.23 (microsoft/onnxruntime#24695
and #25474)."""


def onnxruntime_version() -> str:
    """Version of the installed ONNX Runtime (any of ``ORT_DISTS``), or ``"absent"``."""
    for dist in ORT_DISTS:
        hit = _scan_dist_info().get(_normalise(dist))
        if hit is not None:
            return hit[0]
    return dist_version(ORT_DISTS[0])  # slow path: egg-info and other layouts


def has_compile_api(version: str | None = None) -> bool:
    """Whether ONNX Runtime ``version`` (default: the installed one) has the compile API
    epbuild uses; decided from the version alone, without importing onnxruntime."""
    import re

    match = re.match(r"(\d+)\.(\d+)", version or onnxruntime_version())
    return match is not None and (int(match[1]), int(match[2])) >= COMPILE_API_SINCE


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


def attach_named(
    adapter: BaseProvider,
    ort: onnxruntime,
    so: onnxruntime.SessionOptions,
    config: ProviderConfig,
    ep_name: str | None,
) -> None:
    """``adapter.attach``, or with ``ep_name`` its ``attach_as`` (the EP registered under the
    name a package declares; by default only the name it declares itself)."""
    if ep_name is None:
        adapter.attach(ort, so, config)
    else:
        adapter.attach_as(ort, so, config, ep_name)


_registered: set[str] = set()


def register_plugin(ort: onnxruntime, name: str, library: str, *, hint: str | None = None) -> None:
    """Register a plugin EP library once per process."""
    if name in _registered:
        return
    try:
        ort.register_execution_provider_library(name, library)
    except Exception as exc:  # ORT raises its own pybind classes
        if "already registered" not in str(exc):
            raise ProviderUnavailableError(
                f"could not register execution provider library {library}: {exc}", hint=hint
            ) from exc
    _registered.add(name)


def require_devices(
    ort: onnxruntime, ep_name: str, *, extra: str, device_type: str | None = None
) -> list[Any]:
    """EP devices named ``ep_name`` (optionally of one hardware type), or a clear error."""
    devices = [d for d in ort.get_ep_devices() if d.ep_name == ep_name]
    if device_type is not None:
        wanted = device_type.upper()
        devices = [d for d in devices if d.device.type.name == wanted]
    if not devices:
        raise ProviderUnavailableError(
            f"execution provider {ep_name!r} found no device on this machine"
            + (f" of type {device_type}" if device_type else ""),
            hint=install_hint(extra) + " and check the hardware",
        )
    return devices


def install_hint(extra: str) -> str:
    """How to install an adapter's EP package; ``extra=""`` for EPs epbuild has no extra for."""
    if extra:
        return f'install it with pip install "epbuild[{extra}]"'
    return "install the EP's own package and check the library path"
