"""What a valid EPContext model is: the one owner of the EPContext and model-path rules.

Every rule is a function that returns ``Problem`` values and raises nothing, so each caller
turns them into its own outcome: the worker into ``CompileFailure``, staging into
``VerificationError``, ``epbuild verify`` into a report, the runtime into
``CompatibilityError``, the builder into an error or a warning. Models are read with
``epbuild.onnx.proto``; nothing here imports onnx or onnxruntime.

The rules come from the EPContext design: a ctx model holds EPContext nodes whose attributes
have their documented types; some node holds the main context; ``embed_mode`` is what the
manifest asks; ``ep_cache_context`` is a path for ``embed_mode = 0`` (the reference rule) and
the context itself for ``embed_mode = 1``; external data stays inside the output directory and
in bounds; ``source`` and ``ep_compatibility_info.<key>`` are what the provider writes and
accepts; and no free text of a ctx model names a directory of the build machine
(``path_problems``: names are identifiers, never paths; opaque bytes are scanned only for a
long workspace path, see ``LONG_PATH_MIN``).
"""

from __future__ import annotations

import enum
import os
import posixpath
import re
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import asdict, dataclass
from epbuild.errors import VerificationError
from epbuild.fs import CHUNK, reference_problem
from epbuild.onnx.proto import ProtoError, read_model
from epbuild.providers import get_provider
from epbuild.userdirs import default_cache_dir, toolchain_root

if TYPE_CHECKING:
    from epbuild.onnx.proto import ContextNode, ExternalRef, ModelInfo, StringField
    from epbuild.providers.contract import Provider, ProviderConfig
    from epbuild.toolchains.env import Toolchain

# EPContext attribute types from the EPContext design: int64 or string.
_INT_ATTRS = frozenset({"main_context", "embed_mode", "max_size", "is_multi_soc_ep_context"})
_STR_ATTRS = frozenset(
    {
        "ep_sdk_version",
        "onnx_model_filename",
        "hardware_architecture",
        "partition_name",
        "source",
        "notes",
    }
)  # ep_cache_context is either: a path (embed_mode 0) or the context's bytes (embed_mode 1)
_MAX_PATH = 4096
COMPAT_PREFIX = "ep_compatibility_info."
"""Model metadata key prefix; the provider adapter names the rest (``compatibility_key``)."""


class Severity(enum.Enum):
    """Whether a problem makes an output invalid or is only worth saying."""

    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a built output."""

    file: str
    """Path of the file the problem is in (workspace-relative where the caller has one)."""
    message: str
    node: str | None = None
    attribute: str | None = None
    severity: Severity = Severity.ERROR

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
        return {**asdict(self), "severity": self.severity.value}


def warning_lines(problems: Iterable[Problem]) -> list[str]:
    """The warnings among ``problems``, each as a line (a problem of a node or attribute
    says where; another, its message); the first error raises ``VerificationError``."""
    lines: list[str] = []
    for p in problems:
        if p.severity is Severity.ERROR:
            raise VerificationError(p.line())
        lines.append(p.line() if p.node or p.attribute else p.message)
    return lines


# ---------------------------------------------------------------------------------------
# The reference rule


class RefFault(enum.Enum):
    """Why a path stored in a model cannot be used."""

    UNSAFE = "unsafe"
    """Empty, absolute, a backslash or drive letter, or a ``..`` component."""
    OUTSIDE = "outside"
    """Resolves outside the directory the model's references must stay in."""
    MISSING = "missing"
    """No such file."""


@dataclass(frozen=True)
class RefCheck:
    """The reference rule's verdict on one path stored in a model."""

    path: str | None
    """The target, relative like the model's path, when the rule holds."""
    fault: RefFault | None = None
    message: str = ""
    """Why not (names the reference), empty when the rule holds."""


def check_reference(root: str, model: str, ref: str, directory: str) -> RefCheck:
    """The reference rule: ``ref`` (stored in ``model``) is relative, without a backslash,
    drive or ``..``, stays inside ``directory`` and names an existing file.

    ``model`` and ``directory`` are relative to ``root``.
    """
    unsafe = reference_problem(ref)
    if unsafe is not None:
        return RefCheck(None, RefFault.UNSAFE, unsafe)
    rel = posixpath.normpath(posixpath.join(posixpath.dirname(model), ref))
    if not rel.startswith(directory.rstrip("/") + "/"):
        return RefCheck(None, RefFault.OUTSIDE, f"{ref!r} leaves the output directory")
    if not os.path.isfile(os.path.join(root, rel)):
        return RefCheck(None, RefFault.MISSING, f"{ref!r} does not exist")
    return RefCheck(rel)


def stored_references(info: ModelInfo) -> list[str]:
    """Every path a model stores: ``ep_cache_context`` of embed_mode 0 nodes, data locations."""
    cache = [
        str(n.attributes["ep_cache_context"])
        for n in info.context_nodes
        if n.attributes.get("embed_mode", 1) == 0 and "ep_cache_context" in n.attributes
    ]
    return cache + [r.location for r in info.external_refs]


# ---------------------------------------------------------------------------------------
# EPContext nodes


def missing_context(file: str, info: ModelInfo) -> Problem | None:
    """A ctx model must hold at least one EPContext node."""
    return None if info.context_nodes else Problem(file, "has no EPContext node")


def node_problems(file: str, info: ModelInfo) -> list[Problem]:
    """Attribute types, ``main_context``/``embed_mode`` values, and some node is the main one."""
    problems: list[Problem] = []
    for node in info.context_nodes:
        problems += _attribute_types(file, node)
        for attr in ("main_context", "embed_mode"):
            value = node.attributes.get(attr, 1)
            if value not in (0, 1):
                problems.append(_at(file, node, attr, f"must be 0 or 1, not {value!r}"))
    if info.context_nodes and not any(_is_main(n) for n in info.context_nodes):
        problems.append(
            Problem(
                file,
                "every EPContext node has main_context = 0; none holds the context",
                attribute="main_context",
            )
        )
    return problems


def _attribute_types(file: str, node: ContextNode) -> list[Problem]:
    problems = []
    for name, value in node.attributes.items():
        if name in _INT_ATTRS and not isinstance(value, int):
            problems.append(_at(file, node, name, f"must be an int64, not {type(value).__name__}"))
        elif name in _STR_ATTRS and not isinstance(value, str):
            problems.append(_at(file, node, name, f"must be a string, not {type(value).__name__}"))
    return problems


def _at(file: str, node: ContextNode, attribute: str, message: str) -> Problem:
    return Problem(file, message, node=node.name, attribute=attribute)


def _is_main(node: ContextNode) -> bool:
    return node.attributes.get("main_context", 1) == 1


def accepts_source(adapter: Provider, config: ProviderConfig, source: str) -> bool:
    """Whether the adapter's EP loads EPContext nodes whose ``source`` is ``source``: what it
    writes, or an alias it names (``accepts_source``, optional on third-party adapters)."""
    return adapter.accepts_source(config, source)


def source_problems(
    file: str, info: ModelInfo, adapter: Provider, config: ProviderConfig
) -> list[Problem]:
    """Every EPContext node's ``source`` is one the provider's EP accepts: what it writes
    ("" when it writes none) or an alias it loads too (the QNN EP: ``QnnExecutionProvider``)."""
    expected = adapter.context_source(config)
    return [
        _at(file, n, "source", f"{got!r} is not for the {config.ep} EP (expects {expected!r})")
        for n in info.context_nodes
        if not accepts_source(adapter, config, got := str(n.attributes.get("source", "")))
    ]


def embed_problems(
    root: str, file: str, info: ModelInfo, embed_mode: int, directory: str
) -> list[Problem]:
    """Main nodes: ``embed_mode`` is the manifest's; ``ep_cache_context`` fits the mode.

    ``file`` and ``directory`` are relative to ``root``; an embed_mode 0 ``ep_cache_context``
    obeys the reference rule inside ``directory``.
    """
    problems: list[Problem] = []
    for node in info.context_nodes:
        embed = node.attributes.get("embed_mode", 1)
        if not _is_main(node) or embed not in (0, 1):
            continue  # a bad value is node_problems' to report
        if embed != embed_mode:
            problems.append(
                _at(file, node, "embed_mode", f"is {embed}, the manifest asks for {embed_mode}")
            )
        message = _cache_context(root, file, node, int(embed), directory)
        if message:
            problems.append(_at(file, node, "ep_cache_context", message))
    return problems


def _cache_context(
    root: str, file: str, node: ContextNode, embed: int, directory: str
) -> str | None:
    cache = node.attributes.get("ep_cache_context")
    if cache is None:
        return "is missing on a main_context = 1 node"
    if embed == 1:
        if not cache:
            return "is empty although embed_mode = 1 (no embedded context)"
        named = isinstance(cache, str) and len(cache) < _MAX_PATH
        if named and check_reference(root, file, str(cache), directory).path is not None:
            return f"names a file ({cache!r}) although embed_mode = 1"
        return None
    if not isinstance(cache, str) or len(cache) > _MAX_PATH or "\x00" in cache:
        return "holds binary data although embed_mode = 0 (expects a path)"
    return check_reference(root, file, cache, directory).message or None


# ---------------------------------------------------------------------------------------
# External data


def external_data_problems(root: str, file: str, info: ModelInfo, directory: str) -> list[Problem]:
    """Each external-data location obeys the reference rule; offset/length/checksum fit."""
    problems: list[Problem] = []
    bad: set[str] = set()
    for ref in info.external_refs:
        if ref.location in bad:
            continue
        where = f"tensor {ref.tensor}"
        check = check_reference(root, file, ref.location, directory)
        if check.path is None:
            bad.add(ref.location)
            problems.append(Problem(file, check.message, attribute=f"{where}: location"))
            continue
        problem = _extent_problem(os.path.join(root, check.path), ref)
        if problem is not None:
            attribute, message = problem
            problems.append(Problem(file, message, attribute=f"{where}: {attribute}"))
    return problems


def _extent_problem(full: str, ref: ExternalRef) -> tuple[str, str] | None:
    size = os.path.getsize(full)
    offset, length = ref.offset or 0, ref.length
    end = offset + (length if length is not None else 0)
    if offset < 0 or (length is not None and length < 0) or end > size or offset > size:
        return (
            "offset/length",
            f"offset {offset} + length {length or 0} is past the end of "
            f"{ref.location!r} ({size} bytes)",
        )
    if ref.checksum:
        sums = _sha1_sums(full, offset, end if length is not None else size)
        if ref.checksum.lower() not in sums:
            return "checksum", f"SHA1 of {ref.location!r} does not match"
    return None


def _sha1_sums(full: str, start: int, end: int) -> set[str]:
    """SHA1 of the whole file and of ``[start, end)``, read in pieces (writers differ on
    which one the ``checksum`` entry holds). Rare: OpenSSL's hashes are loaded for it."""
    import hashlib

    whole, part = hashlib.sha1(), hashlib.sha1()
    at = 0
    with open(full, "rb") as f:
        while chunk := f.read(CHUNK):
            whole.update(chunk)
            part.update(chunk[max(start - at, 0) : max(end - at, 0)])
            at += len(chunk)
    return {whole.hexdigest(), part.hexdigest()}


# ---------------------------------------------------------------------------------------
# Compatibility with the provider


def compatibility_issue(
    adapter: Provider, config: ProviderConfig, value: str, *, installed: bool = False
) -> str | None:
    """Why the adapter refuses an ``ep_compatibility_info`` value (with ``installed``: also
    for the EP installed here, where the adapter can tell)."""
    issue = adapter.check_compatibility(config, value)
    if issue is None and installed:
        issue = adapter.check_installed(config, value)
    return issue or None


def compatibility_entry(
    metadata: Mapping[str, str], adapter: Provider, config: ProviderConfig
) -> tuple[str, str | None]:
    """The compatibility info in a model's ``metadata`` and the key it is under: the first of
    the adapter's names (``compatibility_keys``: older outputs carry older names) present,
    else the current name and None."""
    names = adapter.compatibility_keys(config)
    current = adapter.compatibility_key(config)
    for name in (*names, *([current] if current else [])):
        if COMPAT_PREFIX + name in metadata:
            return COMPAT_PREFIX + name, metadata[COMPAT_PREFIX + name]
    return COMPAT_PREFIX + (current or ""), None


def compatibility_problems(
    file: str,
    info: ModelInfo,
    adapter: Provider,
    config: ProviderConfig,
    *,
    installed: bool = False,
) -> list[Problem]:
    """``ep_compatibility_info.<key>`` is present (where the adapter names a key) and accepted."""
    key = adapter.compatibility_key(config)
    if key is None or not info.context_nodes:
        return []
    attr, value = compatibility_entry(info.metadata, adapter, config)
    if value is None:
        return [Problem(file, "metadata is missing", attribute=attr)]
    issue = compatibility_issue(adapter, config, value, installed=installed)
    return [Problem(file, f"{value!r}: {issue}", attribute=attr)] if issue else []


def report_problems(
    model: str,
    report: dict[str, Any],
    adapter: Provider,
    config: ProviderConfig,
    prefix: str | None,
) -> list[Problem]:
    """What a worker reported about one model (``check_outputs``' detail), against the rules:
    compatibility info the adapter refuses is an error; an EP that ignored the asked
    ``node_name_prefix`` is a warning."""
    problems: list[Problem] = []
    compat = report.get("compatibility")
    issue = compatibility_issue(adapter, config, compat) if compat else None
    if issue:
        problems.append(Problem(model, issue))
    names = report.get("node_names", [])
    if prefix and not all(n.startswith(prefix) for n in names):
        versions = ", ".join(f"{k} {v}" for k, v in adapter.versions(config).items())
        note = (
            f"the {config.ep} EP ({versions}) ignores node_name_prefix; "
            "EPContext node names were not prefixed"
        )
        problems.append(Problem(model, note, severity=Severity.WARNING))
    split = split_warning(report)
    if split:
        problems.append(Problem(model, f"{model}: {split}", severity=Severity.WARNING))
    return problems


def split_warning(report: dict[str, Any]) -> str | None:
    """A warning when the EP split a model's graph: more than one EPContext node, with the
    nodes ONNX Runtime left on the CPU EP (between or around them) named by op type, and
    what to try (another level, unless they are contrib ops the source model holds)."""
    contexts = report.get("context_nodes", 0)
    if not isinstance(contexts, int) or contexts < 2:
        return None
    ops = report.get("cpu_op_types") or {}
    cpu = ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())) or "none"
    level = report.get("optimization_level")
    own = report.get("cpu_ops_in_source") or []
    if ops and set(ops) <= set(own):  # an optimizer's contrib ops: no level undoes them
        domains = ", ".join(sorted({op.split("::")[0] for op in own}))
        advice = (
            f"those {domains} ops are in the model itself (as ONNX Runtime's transformers "
            "optimizer writes them), and no graph_optimization_level undoes them: compile "
            "the model from before that optimizer, or rewrite those ops"
        )
    elif level is None:
        advice = 'try graph_optimization_level = "auto", or rewrite those ops'
    else:
        advice = f'"auto" kept level {level} (no level left fewer); rewrite those ops'
    return (
        f"the graph is split into {contexts} EPContext nodes; on the CPU EP: {cpu}. "
        f"Each split costs a round trip to the CPU: {advice}"
    )


# ---------------------------------------------------------------------------------------
# Everything at once


def context_problems(
    root: str, file: str, info: ModelInfo, config: ProviderConfig, embed_mode: int, directory: str
) -> list[Problem]:
    """Every rule for one built ctx model (``file`` and ``directory`` relative to ``root``)."""
    adapter = get_provider(config.ep)
    missing = missing_context(file, info)
    return [
        *([missing] if missing else []),
        *node_problems(file, info),
        *source_problems(file, info, adapter, config),
        *embed_problems(root, file, info, embed_mode, directory),
        *external_data_problems(root, file, info, directory),
        *compatibility_problems(file, info, adapter, config),
    ]


# ---------------------------------------------------------------------------------------
# Paths of the build machine: where one can be written, and what a byte scan may look for
#
# Three kinds of string in a ctx model, three rules:
# - references (embed_mode 0 ``ep_cache_context``, external-data ``location``,
#   ``onnx_model_filename``) name a file beside the model: the strict reference rule;
# - names (of nodes, graphs, tensors; ``partition_name``) are identifiers, never paths:
#   ORT derives names such as ``/MatMulAddFusion`` or ``/model/layers.0/MatMul_token_3``;
# - free text (doc strings, metadata values, other string attributes) may quote any path
#   (``/usr/lib/...`` in a stack trace is no one's secret); only the build machine's own
#   directories (`MachinePaths`) are a leak there.
# Opaque bytes (context binaries, initializers) are scanned only for a long workspace path.


LONG_PATH_MIN = 16
"""The shortest workspace path (with its trailing separator) that opaque bytes are scanned
for. Context binaries and initializers are hundreds of MB of arbitrary bytes: a short
string such as ``/w/`` occurs in them by chance (a 3-byte string about once per 16 MB of
random bytes), so a scan for it would fail a good build forever. A string of 16 bytes
occurs by chance about once per 2**128 bytes: never. Shorter workspace paths get no byte
scan; the text fields of the ctx models (`path_problems`) are checked whatever the length.
"""

_ABSOLUTE = re.compile(
    r"""(?<![^\s'"=(\[{,;<>])"""  # at the start, or after a space, quote or bracket
    r"""(?:/(?=[\w.~+@$-])|[A-Za-z]:[\\/]|\\\\(?=\w)|file://)"""  # /x  C:\  \\host  file://
    r"""[^\s'"<>|,;)\]}]*"""
)
_REFERENCE_ATTRS = frozenset({"attribute onnx_model_filename"})
"""String fields that name a file next to the model: the reference rule, not free text."""
_NAME_FIELDS = frozenset({"name", "attribute partition_name"})
"""String fields that are identifiers: never checked as paths."""
SHARED_ROOTS = frozenset(
    {
        "/",
        "/bin",
        "/etc",
        "/home",
        "/lib",
        "/lib64",
        "/mnt",
        "/opt",
        "/opt/homebrew",
        "/private",
        "/sbin",
        "/srv",
        "/Library",
        "/System",
        "/Users",
        "/usr",
        "/usr/bin",
        "/usr/lib",
        "/usr/lib64",
        "/usr/local",
        "/usr/local/lib",
        "/usr/share",
        "/var",
        "/Volumes",
    }
)
"""Directories every machine of a kind has (``sys.prefix`` is ``/usr`` for a system Python,
``/usr/local`` in many containers): a path under them says nothing about this machine, so
they are never a machine path themselves (a directory below them, such as a home or a
virtual environment, still is)."""


def _is_shared_root(path: str) -> bool:
    """``/``, a drive root (``C:\\``), or a directory every machine has (`SHARED_ROOTS`)."""
    bare = path.replace("\\", "/").rstrip("/")
    return not bare or (len(bare) == 2 and bare[1] == ":") or bare in SHARED_ROOTS


def _comparable(path: str) -> str:
    """A path in the form text is compared in: forward slashes, no trailing one; on Windows
    in one case."""
    path = path.replace("\\", "/").rstrip("/")
    return path.lower() if os.name == "nt" else path


@dataclass(frozen=True)
class MachinePaths:
    """The build machine's own directories: what no text of an output may name.

    Made once per command (`machine_paths`) and passed to `path_problems`; each path is
    absolute, in `_comparable` form, never a shared root such as ``/`` or ``/usr``.
    """

    paths: tuple[str, ...]

    def with_dirs(self, dirs: Iterable[str]) -> MachinePaths:
        """These paths and ``dirs`` (a toolchain's directories, say); these very paths
        when ``dirs`` is empty (no ``realpath`` calls again for each restored action)."""
        extra = tuple(dirs)
        return MachinePaths(_machine_set([*self.paths, *extra])) if extra else self

    def find(self, path: str) -> str | None:
        """The machine path that ``path`` (an absolute path taken from text) lies in,
        matched as a whole path prefix: ``/tmp`` matches ``/tmp`` and ``/tmp/x``, never
        ``/tmpx`` nor ``/x/tmp``."""
        if path.startswith("file://"):
            path = path[len("file://") :]
        text = _comparable(path).rstrip(".:")
        for own in self.paths:
            if text == own or text.startswith(own + "/"):
                return own
        return None


def _machine_set(paths: Iterable[str]) -> tuple[str, ...]:
    """Each path, made absolute, real and as given, without shared roots; longest first."""
    found: set[str] = set()
    for path in paths:
        if not path:
            continue
        for spelling in {os.path.abspath(path), os.path.realpath(path)}:
            if not _is_shared_root(spelling):
                found.add(_comparable(spelling))
    return tuple(sorted(found, key=lambda p: (-len(p), p)))


def temp_dir() -> str:
    """The directory ``tempfile.gettempdir()`` names, without importing ``tempfile`` (its
    import, and the file it writes to test the directory, cost every build's first check
    a few milliseconds): ``tempfile.tempdir`` where that module has set it, else the first of
    ``$TMPDIR``, ``$TEMP``, ``$TMP`` and the platform's usual places that is a directory,
    else the current directory."""
    known = getattr(sys.modules.get("tempfile"), "tempdir", None)
    if isinstance(known, str):
        return known
    candidates = [os.environ.get(name) for name in ("TMPDIR", "TEMP", "TMP")]
    if os.name == "nt":
        candidates += [
            os.path.expanduser(r"~\AppData\Local\Temp"),
            os.path.expandvars(r"%SYSTEMROOT%\Temp"),
            r"c:\temp",
            r"c:\tmp",
            r"\temp",
            r"\tmp",
        ]
    else:
        candidates += ["/tmp", "/var/tmp", "/usr/tmp"]
    for candidate in candidates:
        if candidate and os.path.isdir(candidate):
            return os.path.abspath(candidate)
    return os.getcwd()


def machine_paths(root: str, dirs: Iterable[str] = ()) -> MachinePaths:
    """The build machine's own directories: the workspace ``root``, the user's home, the
    temp directory, this Python's prefixes, epbuild's per-user cache and toolchains, and
    ``dirs`` (each toolchain's directories: `toolchain_dirs`). No imports of onnx or
    onnxruntime; ``lstat`` calls only (real paths)."""
    found = [
        root,
        os.path.expanduser("~"),
        temp_dir(),
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        default_cache_dir(),
        toolchain_root(),
        *dirs,
    ]
    return MachinePaths(_machine_set(found))


def toolchain_dirs(toolchain: Toolchain | None) -> tuple[str, ...]:
    """A toolchain's directories: its prefix, its interpreter's folder, its site dirs."""
    if toolchain is None:
        return ()
    return (toolchain.prefix, os.path.dirname(toolchain.python), *toolchain.sites)


def scan_needles(root: str) -> tuple[bytes, ...]:
    """What opaque output bytes are scanned for: the workspace path (real and as given)
    followed by a separator, each only when at least `LONG_PATH_MIN` bytes long."""
    paths = {os.path.realpath(root), os.path.abspath(root)}
    needles = {os.fsencode(p.rstrip(os.sep) + os.sep) for p in paths}  # its bytes on disk
    return tuple(sorted(n for n in needles if len(n) >= LONG_PATH_MIN))


def needle_problem(file: str, found: bytes | None) -> Problem | None:
    """The problem of an output whose bytes hold a `scan_needles` needle (None: none)."""
    if found is None:
        return None
    leak = found.decode(errors="replace").rstrip("/" + os.sep)
    return Problem(file, f"contains the absolute path {leak!r} of this machine's workspace")


def absolute_paths(text: str) -> list[str]:
    """The absolute paths written in ``text``: POSIX ``/a/b``, ``C:\\a``, ``\\\\host\\s``,
    ``file://``. A slash inside a word (``N/A``, ``1/2``) or a URL's ``//`` is not one."""
    return [m.group(0) for m in _ABSOLUTE.finditer(text)]


@dataclass(frozen=True)
class SourceText:
    """The text of a group's source models, to tell what a compile wrote from what it kept."""

    values: dict[str, str]
    """Every text field value → the (workspace-relative) source model it is in."""
    paths: dict[str, str]
    """Every absolute path written in those values → its source model."""

    def origin(self, value: str, path: str) -> str | None:
        """The source model ``value`` (holding ``path``) comes from: copied verbatim, or a
        text that holds a path some source text holds (a doc string ORT merged, say). A
        source that names only a shorter path (``/tmp``) does not excuse a longer one."""
        if value in self.values:
            return self.values[value]
        return self.paths.get(path)


class LazySourceText:
    """`source_text` read only when a question needs it: most ctx models name no machine
    path, so their sources are never parsed (a restore from the cache checks every
    restored model, and parsing its sources was 40% of a small restore)."""

    def __init__(self, root: str, models: tuple[str, ...]) -> None:
        self.root, self.models = root, models
        self._text: SourceText | None = None

    def origin(self, value: str, path: str) -> str | None:
        """`SourceText.origin`, the sources read on the first call."""
        if self._text is None:
            self._text = source_text(self.root, self.models)
        return self._text.origin(value, path)


def source_text(root: str, models: tuple[str, ...]) -> SourceText:
    """The text of the source models (workspace-relative); an unreadable model adds nothing
    (the compile reports it)."""
    values: dict[str, str] = {}
    paths: dict[str, str] = {}
    for model in models:
        try:
            info = read_model(os.path.join(root, model), strings=True)
        except (ProtoError, OSError):
            continue
        for field in info.strings:
            if field.value not in values:
                values[field.value] = model
                for path in absolute_paths(field.value):
                    paths.setdefault(path, model)
    return SourceText(values, paths)


def path_problems(
    file: str, info: ModelInfo, sources: SourceText | LazySourceText, machine: MachinePaths
) -> list[Problem]:
    """No free text of a ctx model (read with ``strings=True``) names a directory of the
    build ``machine``; file-naming fields obey the reference rule.

    Names are never checked (they are identifiers: ORT derives ``/MatMulAddFusion``). A
    machine path the compile wrote is an error naming the file and field. One it kept from
    a source model is not the build's doing: one warning per file (naming the first
    field). Paths of other machines (``/usr/lib/...``, ``/home/dev/...`` in an exporter's
    doc string) are fine. References (``ep_cache_context``, external-data ``location``)
    are `embed_problems`' and `external_data_problems`'.
    """
    problems: list[Problem] = []
    kept: list[tuple[StringField, str, str]] = []
    for field in info.strings:
        if field.field in _NAME_FIELDS:
            continue
        if field.field in _REFERENCE_ATTRS:
            message = reference_problem(field.value)
            if message:
                problems.append(Problem(file, message, field.node, field.field))
            continue
        for path in absolute_paths(field.value):
            own = machine.find(path)
            if own is None:
                continue
            origin = sources.origin(field.value, path)
            if origin is None:
                message = (
                    f"holds the path {path!r} of this machine (in {own!r}); "
                    "outputs must not carry the build machine's paths"
                )
                problems.append(Problem(file, message, field.node, field.field))
            else:
                kept.append((field, path, origin))
            break
    if kept:
        field, path, origin = kept[0]
        more = f" (and {len(kept) - 1} more such fields)" if len(kept) > 1 else ""
        message = f"holds the path {path!r} of this machine, kept from {origin}{more}"
        problems.append(Problem(file, message, field.node, field.field, Severity.WARNING))
    return problems


# ---------------------------------------------------------------------------------------
# Weight-sharing groups


def sharing_problems(
    files: list[str], infos: list[ModelInfo], adapter: Provider, config: ProviderConfig
) -> list[Problem]:
    """The ctx models of one weight-sharing group (``files``, in session order) share one
    context binary: each has a main embed_mode 0 EPContext node, and every such node's
    ``ep_cache_context`` names the same file (resolved against each model's directory).

    An EP that ignores ``ep.share_ep_contexts`` writes one binary per model: each model
    loads on its own, but the group does not share its weights.
    """
    problems: list[Problem] = []
    first: dict[str, tuple[str, str]] = {}
    """Model → (stored reference, resolved target) of its first referencing main node."""
    for file, info in zip(files, infos, strict=True):
        refs = _shared_references(file, info)
        if any(reference_problem(ref) for _, ref, _ in refs):
            continue  # an unusable path is the reference rule's to report
        if not refs:
            problems.append(
                Problem(
                    file,
                    "no main EPContext node references a context binary (embed_mode 0 "
                    "ep_cache_context); every ctx model of a weight-sharing group references "
                    "the group's one shared binary",
                    attribute="ep_cache_context",
                )
            )
            continue
        first[file] = refs[0][1:]
        problems += [
            _at(file, node, "ep_cache_context", f"names a second binary {ref!r} in one model")
            for node, ref, target in refs[1:]
            if target != refs[0][2]
        ]
    binaries = {target: ref for ref, target in first.values()}
    if len(binaries) < 2:
        return problems
    shared_ref, shared = next(iter(first.values()))
    versions = ", ".join(f"{k} {v}" for k, v in adapter.versions(config).items())
    names = ", ".join(repr(ref) for ref in binaries.values())
    problems += [
        Problem(
            file,
            f"references {ref!r}, not the group's shared binary {shared_ref!r}: its "
            f"{len(files)} ctx models reference {len(binaries)} context binaries ({names}) "
            f"instead of one. The {config.ep} EP ({versions}) apparently ignored "
            "ep.share_ep_contexts; this group would not share weights",
            attribute="ep_cache_context",
        )
        for file, (ref, target) in first.items()
        if target != shared
    ]
    return problems


def _shared_references(file: str, info: ModelInfo) -> list[tuple[ContextNode, str, str]]:
    """(node, stored path, resolved path) for each main embed_mode 0 node whose
    ``ep_cache_context`` is a path; resolved against ``file``'s directory."""
    refs = []
    for node in info.context_nodes:
        cache = node.attributes.get("ep_cache_context")
        if not _is_main(node) or node.attributes.get("embed_mode", 1) != 0:
            continue
        if isinstance(cache, str) and cache and len(cache) <= _MAX_PATH and "\x00" not in cache:
            target = posixpath.normpath(posixpath.join(posixpath.dirname(file), cache))
            refs.append((node, cache, target))
    return refs
