"""The loaded manifest as plain, frozen data: what ``load_manifest`` returns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from epbuild._dataclass import dataclass, field, fields, replace
from epbuild.errors import ManifestError
from epbuild.providers.contract import ProviderConfig


@dataclass(frozen=True)
class WorkspaceSettings:
    """The ``[workspace]`` table, with defaults applied."""

    out_dir: str
    state_dir: str
    jobs: int
    memory_budget: int | None
    cache: str | None
    executor: str
    scheduler: str | None


COMPILERS = ("compile_api", "session")
"""How a worker compiles: ``onnxruntime.ModelCompiler`` or an ``InferenceSession`` per model."""
OPTIMIZATION_LEVELS = ("disabled", "basic", "extended", "all")
"""``graph_optimization_level`` values, in ORT's order (``GraphOptimizationLevel``)."""
DEFAULT_OPTIMIZATION_LEVEL = "all"
"""What sessions always did, so the default gives the graphs builds gave before."""


@dataclass(frozen=True)
class CompileSettings:
    """How one action compiles: the ``compiler``, ``graph_optimization_level`` and session
    settings of a provider or group table (None: unset). ``over`` lets a group's settings
    win over its provider's; ``Group.compile`` holds the result, defaults filled in."""

    compiler: str | None = None
    """``compile_api`` or ``session``; resolved from the installed ONNX Runtime when unset."""
    graph_optimization_level: str | None = None
    """One of ``OPTIMIZATION_LEVELS``."""
    disable_cpu_ep_fallback: bool | None = None
    """``session.disable_cpu_ep_fallback=1``: a node the EP cannot take fails the compile."""
    intra_op_num_threads: int | None = None
    """``SessionOptions.intra_op_num_threads`` of the compile (None: ORT's default)."""
    external_data_folder: str | None = None
    """Workspace-relative folder of the external data of models loaded as bytes (None: the
    model's own folder)."""

    def over(self, base: CompileSettings) -> CompileSettings:
        """These settings, each unset one taken from ``base``."""
        return replace(
            base, **{f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}
        )

    def to_json(self) -> dict[str, Any]:
        """The key component and the job's form (every field, unset ones as null)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CompileSettings:
        """Rebuild settings written by ``to_json``."""
        return cls(**{f.name: data.get(f.name) for f in fields(cls)})


SESSION_SETTINGS = CompileSettings("session", DEFAULT_OPTIMIZATION_LEVEL, False)
"""What every compile was before the settings existed: a session, all optimisations."""


@dataclass(frozen=True)
class NumericsSettings:
    """The ``numerics`` table of a group or model entry: how ``verify --numerics`` compares a
    ctx model with its source (unset tolerances: the EP's defaults)."""

    rtol: float | None = None
    """Allowed max |ctx - source| relative to the largest |source| value of the output."""
    atol: float | None = None
    """Allowed max |ctx - source| (an output passes when within atol or rtol)."""
    min_cosine: float | None = None
    """Smallest allowed cosine similarity of an output to the source's."""
    inputs: tuple[str, ...] = ()
    """Workspace-relative ``.npz`` files or globs, one sample feed each (inputs by name);
    none: one seeded random feed."""
    seed: int = 0
    float_range: tuple[float, float] | None = None
    """Random float inputs uniform in [low, high); None: standard normal."""
    int_range: tuple[int, int] = (0, 4)
    """Random integer inputs (token ids, indices) uniform in [low, high)."""

    def to_json(self) -> dict[str, Any]:
        """The form a check's key and its job hold."""
        return {
            "rtol": self.rtol,
            "atol": self.atol,
            "min_cosine": self.min_cosine,
            "inputs": list(self.inputs),
            "seed": self.seed,
            "float_range": list(self.float_range) if self.float_range else None,
            "int_range": list(self.int_range),
        }


@dataclass(frozen=True)
class ModelEntry:
    """One model of a group: its source file, the name its outputs take, and its own
    free-dimension overrides (``{ path = ..., name = ..., free_dimensions = {...} }``)."""

    path: str
    """Workspace-relative POSIX path of the source model."""
    name: str
    """The output stem (``<name>_ctx.onnx``); the file's stem unless the entry names it."""
    free_dimensions: Mapping[str, int] = field(default_factory=dict)
    """The entry's own overrides (the group's apply under them: ``Group.free_dimensions_of``)."""
    index: int | None = None
    """Position in the manifest's ``models`` array when written as a table; None for a
    plain string (or glob) entry."""
    numerics: NumericsSettings = field(default_factory=NumericsSettings)
    """The group's ``numerics`` with the entry's own on top."""

    @property
    def key(self) -> str:
        """Where the entry's own settings go, for messages: ``models[1]`` (a table) or
        ``models`` (a string)."""
        return "models" if self.index is None else f"models[{self.index}]"


@dataclass(frozen=True)
class ContextSettings:
    """How a group's EPContext models are written, one value from the manifest to the
    worker: the group's sessions share one context (``share_weights``), whether the context
    is embedded (``embed_mode``), the EPContext node-name prefix, the external-initializer
    file name, and whether the worker hands ONNX Runtime a path or bytes (``load``)."""

    share_weights: bool = False
    embed_mode: int = 0
    node_name_prefix: str | None = None
    external_initializers: str | None = None
    load: str = "path"

    def to_json(self) -> dict[str, Any]:
        """Its JSON form (every field): the ``group`` component of a compile key, and a
        job's."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ContextSettings:
        """Rebuild what ``to_json`` wrote."""
        return cls(
            share_weights=bool(data["share_weights"]),
            embed_mode=int(data["embed_mode"]),
            node_name_prefix=data.get("node_name_prefix"),
            external_initializers=data.get("external_initializers"),
            load=str(data["load"]),
        )


@dataclass(frozen=True)
class Group:
    """A model group: models compiled for each of its providers."""

    name: str
    entries: tuple[ModelEntry, ...]
    """The models in manifest order (globs expanded, sorted); a source file appears more
    than once only under different names."""
    providers: tuple[str, ...]
    context: ContextSettings
    patterns: tuple[str, ...]
    """The ``models`` entries that are globs, normalised, in manifest order: what a new
    matching file would change (the no-op fingerprint and ``watch`` follow them)."""
    free_dimensions: Mapping[str, int] = field(default_factory=dict)
    """Symbolic input dimensions fixed for every model of the group (``free_dimensions``)."""

    @property
    def models(self) -> tuple[str, ...]:
        """Workspace-relative POSIX paths of the entries, in order."""
        return tuple(e.path for e in self.entries)

    @property
    def share_weights(self) -> bool:
        """``context.share_weights``: whether the group is one weight-sharing session."""
        return self.context.share_weights

    def free_dimensions_of(self, entry: ModelEntry) -> dict[str, int]:
        """The overrides one model is compiled with: the group's, the entry's on top."""
        return {**self.free_dimensions, **entry.free_dimensions}

    def deps_for(self, entries: Sequence[ModelEntry]) -> tuple[str, ...]:
        """Ids of the actions whose outputs the compile of ``entries`` reads (none: they
        are source files)."""
        return ()

    def listed_path(self, entry: ModelEntry) -> str:
        """The path the manifest lists ``entry`` by (what a hint tells the user to write):
        its own."""
        return entry.path

    def with_entries(self, entries: tuple[ModelEntry, ...]) -> Group:
        """This group with other models."""
        return replace(self, entries=entries)

    compile: Mapping[str, CompileSettings] = field(default_factory=dict)
    """Provider name → its compile settings in this group (group over provider, compiler
    and optimisation level resolved)."""
    quantize: str | None = None
    """The ``[quantization.<name>]`` its models are quantized with before they compile
    (None: they compile as they are)."""


@dataclass(frozen=True)
class PackageSettings:
    """The ``[package]`` table: settings of ``epbuild package``."""

    out_dir: str | None = None
    """Workspace-relative package directory when ``package`` gets no ``-o``."""
    name: str | None = None
    version: str | None = None
    description: str | None = None
    devices: Mapping[str, str] = field(default_factory=dict)
    """Provider name → the device type its variants require (``any``: none)."""
    compatibility_strings: bool = True
    """Whether variants carry ``compatibility_string`` (the EP judges it when selecting)."""
    ep_names: Mapping[str, str] = field(default_factory=dict)
    """Provider name → the EP name its variants declare (the name the app registers the EP
    under), where it is not the EP's conventional name."""


@dataclass(frozen=True)
class Llm:
    """An ``[llms.<name>]`` table: an onnxruntime-genai model folder built into a static
    context + iterator pipeline for each provider."""

    name: str
    source: str
    """Workspace-relative POSIX path of the genai model folder."""
    providers: tuple[str, ...]
    context_length: int
    """The static KV-cache length: the longest sequence (prompt + generated tokens)."""
    window_size: int
    """The context graph's sequence length (the prompt is read in windows of it)."""
    share_weights: bool
    """One context binary for both graphs (N+1) rather than one each."""
    form: str
    """``decoder`` (one dynamic model, as genai's model builder writes it) or
    ``decoder-pipeline`` (static stages already): ``epbuild.llm.source``."""
    model_type: str
    """The source's ``model.type`` (``llama``, ``qwen2``, ...)."""
    files: tuple[str, ...] = ()
    """The source's ONNX files (the decoder, or the pipeline's stages), folder-relative."""
    head_size: int = 0
    """``model.decoder.head_size`` of a ``decoder`` source (0 for a pipeline)."""
    compile: Mapping[str, CompileSettings] = field(default_factory=dict)
    """Provider name → how its graphs compile (the provider's settings, defaults filled)."""
    prompt: str | None = None
    """What ``verify --generate`` generates from (None: its default)."""
    stages: tuple[tuple[str, str], ...] = ()
    """A ``decoder-pipeline`` source's stages: (name, ONNX file relative to the folder)."""
    parts: int = 1
    """How many parts a ``decoder`` source is split into at layer boundaries (1: one
    context + iterator pair; more: ``epbuild.llm.parts``)."""
    quantize: str | None = None
    """The ``[quantization.<name>]`` its static graphs are quantized with (None: float)."""


@dataclass(frozen=True)
class QuantCheck:
    """The ``check`` table of a quantization: the limits ``verify --numerics`` holds a
    quantized group's ctx models to, against the float source."""

    min_sqnr_db: float = 20.0
    """Smallest allowed SQNR (dB) of each output against the float source's."""
    top1: float | None = None
    """Smallest allowed top-1 agreement with the float source for outputs shaped
    ``[batch, classes]`` (None: not checked)."""
    min_token_agreement: float = 0.9
    """A quantized LLM: the smallest share of greedy tokens ``verify --generate`` must find
    equal to the float source's on the CPU, per prompt."""


@dataclass(frozen=True)
class Quantization:
    """A ``[quantization.<name>]`` table: how a group's float models become QDQ models."""

    name: str
    calibration: tuple[str, ...]
    """Workspace-relative samples, in order: ``.npz``/``.npy`` files or ONNX test-data
    folders (``test_data_set_N`` holding ``input_K.pb``)."""
    activations: str = "uint8"
    weights: str = "uint8"
    per_channel: bool = False
    method: str = "minmax"
    exclude: tuple[str, ...] = ()
    """Node names kept in float."""
    overrides: Mapping[str, str] = field(default_factory=dict)
    """Tensor name → its type (mixed precision)."""
    validation: tuple[str, ...] = ()
    """Samples ``verify --numerics`` feeds (empty: the calibration samples)."""
    check: QuantCheck = field(default_factory=QuantCheck)
    listed: tuple[str, ...] = ()
    """Workspace-relative folders whose listing decided the samples (glob bases and sample
    folders): a new file there changes them (the no-op fingerprint stamps them)."""
    text: bool = False
    """Its samples are text prompts (``.txt`` files): an ``[llms]`` entry's recipe."""

    @property
    def feeds(self) -> tuple[str, ...]:
        """The samples ``verify --numerics`` compares on."""
        return self.validation or self.calibration


DEFAULT_CONTEXT_LENGTH = 1024
"""``context_length`` when unset (or the model's own limit where lower)."""
DEFAULT_WINDOW_SIZE = 64
"""``window_size`` when unset (or ``context_length`` where lower)."""


@dataclass(frozen=True)
class Manifest:
    """A loaded manifest."""

    path: Path
    root: Path
    workspace: WorkspaceSettings
    providers: dict[str, ProviderConfig]
    groups: dict[str, Group]
    problems: dict[str, ManifestError] = field(default_factory=dict)
    """Models named in the manifest that are missing or not files: their actions fail
    (naming file, line and key) while the others still build with ``-k``."""
    package: PackageSettings = field(default_factory=PackageSettings)
    llms: dict[str, Llm] = field(default_factory=dict)
    """The ``[llms.*]`` tables, by name."""
    quantization: dict[str, Quantization] = field(default_factory=dict)
    """The ``[quantization.*]`` tables, by name."""
