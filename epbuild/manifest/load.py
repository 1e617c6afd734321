"""Read ``epbuild.toml`` into typed, validated objects (``manifest.model``).

Parsing uses the stdlib ``tomllib`` (fast, no comment preservation); commands that edit the
manifest use tomlkit instead (see ``manifest.init``). Every error names file, line and key
(``manifest.locate``). Facts several commands need (expanded models, the glob patterns
behind them, the state directory) are computed here once and carried on the model.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from epbuild._dataclass import replace
from epbuild._names import (
    CTX_SUFFIX,
    DEFAULT_OUT_DIR,
    MANIFEST_NAME,
    model_stem,
    state_dir_setting,
    tomllib,
)
from epbuild.errors import ManifestError
from epbuild.manifest.defaults import compile_api_missing, default_compiler, default_jobs
from epbuild.manifest.expand import check_model, expand_entry, is_pattern
from epbuild.manifest.llms import load_llms, quantize_names
from epbuild.manifest.locate import Where
from epbuild.manifest.model import (
    DEFAULT_OPTIMIZATION_LEVEL,
    CompileSettings,
    ContextSettings,
    Group,
    Manifest,
    ModelEntry,
    NumericsSettings,
    PackageSettings,
    WorkspaceSettings,
)
from epbuild.manifest.quantization import check_quantized_groups, load_quantization
from epbuild.manifest.refs import check_provider_list
from epbuild.manifest.schema import EP_NAME_PATTERN, SchemaViolation, validate
from epbuild.providers import get_provider
from epbuild.providers.contract import ProviderConfig
from epbuild.toolchains.spec import ToolchainSpec, normalise

__all__ = [
    "Group",
    "Manifest",
    "ModelEntry",
    "WorkspaceSettings",
    "find_manifest",
    "load_manifest",
    "parse_memory",
    "read_document",
]

BOM = "\ufeff"
"""A UTF-8 byte-order mark, as the first character of decoded text."""
_DRIVE = re.compile(r"[A-Za-z]:[\\/]")
# Session options epbuild derives from the group settings; a manifest may not set them.
_RESERVED_SESSION_PREFIXES = ("ep.context_", "ep.share_ep_contexts")
_RESERVED_SESSION_KEYS = (
    "ep.stop_share_ep_contexts",
    "session.model_external_initializers_file_folder_path",
)
COMPILE_KEYS = (
    "compiler",
    "graph_optimization_level",
    "disable_cpu_ep_fallback",
    "intra_op_num_threads",
    "external_data_folder",
)
"""Keys of a provider or group table that make its ``CompileSettings``."""
FALLBACK_ENTRY = "session.disable_cpu_ep_fallback"


def find_manifest(directory: str | os.PathLike[str] = ".", name: str | None = None) -> Path:
    """Locate the manifest: ``name`` relative to ``directory``, else epbuild.toml there."""
    path = Path(directory) / (name or MANIFEST_NAME)
    if path.is_dir():
        raise ManifestError(
            "is a directory, not a manifest file", file=str(path), hint="pass -f FILE"
        )
    if not path.is_file():
        raise ManifestError(
            "no manifest found",
            file=str(path),
            hint="run 'epbuild init' to create one, or pass -f/-C",
        )
    return path


def parse_memory(value: int | str, *, key: str) -> int:
    """Parse ``8G``/``512M``/bytes into bytes."""
    if isinstance(value, int):
        if value <= 0:
            raise ManifestError("must be positive", key=key)
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", value, re.IGNORECASE)
    if not match:
        raise ManifestError(f"{value!r} is not a size", key=key, hint="write e.g. 8G or 512M")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    return int(float(match.group(1)) * scale[match.group(2).upper()])


def load_manifest(path: str | os.PathLike[str], *, text: str | None = None) -> Manifest:
    """Read, validate and resolve a manifest file.

    With ``text``, that text is checked as if it were the file's content (``manifest.edit``
    validates an edit this way before it replaces the file).
    """
    file = Path(path)
    if text is None:
        text = _read_text(file)
    data = read_document(file, text)
    where = Where(file, text)
    root = file.resolve().parent
    workspace = _workspace(where, data)
    providers = {
        name: _provider(where, root, name, table)
        for name, table in data.get("providers", {}).items()
    }
    compile_settings = {
        name: _compile_settings(where, ("providers", name), table)
        for name, table in data.get("providers", {}).items()
    }
    groups: dict[str, Group] = {}
    problems: dict[str, ManifestError] = {}
    for name, table in data.get("groups", {}).items():
        group = _group(where, root, name, table, providers, workspace, problems)
        settings = _compile_settings(where, ("groups", name), table)
        resolved = {
            p: _resolve_compile(where, group, settings, providers[p], compile_settings[p])
            for p in group.providers
        }
        groups[name] = replace(group, compile=resolved)
    excluded = (workspace.out_dir, workspace.state_dir)
    prompts = quantize_names(where, data.get("llms", {}), data.get("quantization", {}))
    quantization = load_quantization(where, root, data.get("quantization", {}), excluded, prompts)
    check_quantized_groups(where, groups, quantization, providers)
    package = _package(where, data, providers)
    budget = workspace.memory_budget
    llms = load_llms(
        where, root, data.get("llms", {}), providers, set(groups), budget, quantization
    )
    for name, llm in llms.items():
        shape = Group(name, (), llm.providers, ContextSettings(llm.share_weights), ())
        resolved = {
            p: _resolve_compile(where, shape, CompileSettings(), providers[p], compile_settings[p])
            for p in llm.providers
        }
        llms[name] = replace(llm, compile=resolved)
    return Manifest(
        file,
        root,
        workspace,
        providers,
        groups,
        problems,
        package=package,
        llms=llms,
        quantization=quantization,
    )


def read_document(file: Path, text: str) -> dict[str, Any]:
    """The manifest text parsed and checked against the schema (its structure and types),
    before anything is resolved: what ``epbuild add`` checks before it edits a file."""
    data = _parse(file, text)
    try:
        validate(data)
    except SchemaViolation as exc:
        raise Where(file, text).error(exc.path, exc.message, exc.hint) from exc
    return data


def _read_text(file: Path) -> str:
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise ManifestError(f"cannot read: {exc.strerror}", file=str(file)) from exc
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError("is not UTF-8 text", file=str(file)) from exc


def _parse(file: Path, text: str) -> dict[str, Any]:
    if text.startswith(BOM):
        raise ManifestError(
            "starts with a UTF-8 byte-order mark (BOM), which TOML does not allow",
            file=str(file),
            line=1,
            hint="save the file as UTF-8 without a BOM (an editor's 'UTF-8', not 'UTF-8 with BOM')",
        )
    try:
        return tomllib.loads(text)
    except RecursionError as exc:
        raise ManifestError(
            "invalid TOML: arrays or tables nested too deeply", file=str(file)
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        line = re.search(r"line (\d+)", msg)
        raise ManifestError(
            "invalid TOML: " + re.sub(r" \(at line.*", "", msg),
            file=str(file),
            line=int(line.group(1)) if line else None,
        ) from exc


def _rel(where: Where, value: str, path: tuple[str, ...], what: str) -> str:
    """``safe_relpath``, its refusal reported at ``path``."""
    return where.relpath(path, value, what)


def _workspace(where: Where, data: dict[str, Any]) -> WorkspaceSettings:
    """The ``[workspace]`` table: directories inside the workspace and apart, sizes parsed."""
    ws = data.get("workspace", {})
    out_dir = _rel(where, ws.get("out_dir", DEFAULT_OUT_DIR), ("workspace", "out_dir"), "out_dir")
    state_dir = _rel(where, state_dir_setting(data), ("workspace", "state_dir"), "state_dir")
    for name, value in (("out_dir", out_dir), ("state_dir", state_dir)):
        if value == ".":
            raise where.error(("workspace", name), "must be a subdirectory, not the workspace")
    if out_dir == state_dir or _nested(out_dir, state_dir):
        raise where.error(("workspace", "state_dir"), "out_dir and state_dir must not overlap")
    budget = ws.get("memory_budget")
    if budget is not None:
        try:
            budget = parse_memory(budget, key="workspace.memory_budget")
        except ManifestError as exc:
            path = ("workspace", "memory_budget")
            raise where.error(path, _strip_where(exc), exc.hint) from exc
    if ws.get("scheduler") is not None:
        from epbuild.addresses import parse_address
        from epbuild.errors import UserError

        try:
            parse_address(ws["scheduler"], what="scheduler")
        except UserError as exc:
            raise where.error(("workspace", "scheduler"), exc.message, exc.hint) from exc
    cache = ws.get("cache")
    if cache is not None and "://" not in cache:
        cache = _rel(where, cache, ("workspace", "cache"), "cache")
    return WorkspaceSettings(
        out_dir=out_dir,
        state_dir=state_dir,
        jobs=ws.get("jobs") or default_jobs(),
        memory_budget=budget,
        cache=cache,
        executor=ws.get("executor", "local"),
        scheduler=ws.get("scheduler"),
    )


def _package(
    where: Where, data: dict[str, Any], providers: dict[str, ProviderConfig]
) -> PackageSettings:
    """The ``[package]`` table: its directory inside the workspace, known providers."""
    table = data.get("package", {})
    out_dir = table.get("out_dir")
    if out_dir is not None:
        out_dir = _rel(where, out_dir, ("package", "out_dir"), "package out_dir")
        if out_dir == ".":
            raise where.error(("package", "out_dir"), "must be a subdirectory, not the workspace")
    for setting in ("devices", "ep_names"):
        for name in table.get(setting, {}):
            if name not in providers:
                raise where.error(
                    ("package", setting, name),
                    f"no provider named {name!r}",
                    hint="known providers: " + (", ".join(providers) or "none"),
                )
    for name, ep_name in table.get("ep_names", {}).items():
        adapter = get_provider(providers[name].ep)
        if adapter.fixed_ep_name:
            fixed = adapter.package_target(providers[name])[0]
            raise where.error(
                ("package", "ep_names", name),
                f"the {providers[name].ep} EP is built into ONNX Runtime and is always named "
                f"{fixed!r}: an app cannot register it as {ep_name!r}",
                hint=f"remove ep_names.{name}",
            )
        if not re.fullmatch(EP_NAME_PATTERN.strip("^$"), ep_name):
            raise where.error(
                ("package", "ep_names", name),
                f"{ep_name!r} is not an execution provider name",
                hint="letters, digits, '_', '.' and '-', starting with a letter, e.g. "
                '"QNNExecutionProvider"',
            )
    return PackageSettings(
        out_dir=out_dir,
        name=table.get("name"),
        version=table.get("version"),
        description=table.get("description"),
        devices=dict(table.get("devices", {})),
        compatibility_strings=table.get("compatibility_strings", True),
        ep_names=dict(table.get("ep_names", {})),
    )


def _provider(where: Where, root: Path, name: str, table: dict[str, Any]) -> ProviderConfig:
    """One ``[providers.<name>]`` table, its options checked by the adapter."""
    key = f"providers.{name}"
    try:
        adapter = get_provider(table["ep"])
        own = ("ep", "options", "session_options", "toolchain", *COMPILE_KEYS)
        settings = {k: v for k, v in table.items() if k not in own}
        options, adapter_settings = adapter.validate_options(
            table.get("options", {}), settings, key=key
        )
    except ManifestError as exc:
        sub = tuple((exc.key or key).split("."))
        raise where.error(sub, _strip_where(exc), exc.hint) from exc
    for option in sorted(adapter.file_options & options.keys()):
        if not (root / options[option]).is_file():
            raise where.error(
                (*key.split("."), "options", option),
                f"{options[option]}: no such file",
                "the path is relative to the manifest's directory",
            )
    session_options = {
        k: ("1" if v is True else "0" if v is False else str(v))
        for k, v in table.get("session_options", {}).items()
    }
    for k in session_options:
        if k.startswith(_RESERVED_SESSION_PREFIXES) or k in _RESERVED_SESSION_KEYS:
            raise where.error(
                (*key.split("."), "session_options", k),
                "is set by epbuild from the group settings",
                "use the group's embed_mode, share_weights, node_name_prefix or "
                "external_initializers instead",
            )
    return ProviderConfig(
        name=name,
        ep=table["ep"],
        options=options,
        session_options=session_options,
        settings=adapter_settings,
        base_dir=str(root),
        toolchain=_toolchain(where, key, table.get("toolchain")),
    )


def _toolchain(where: Where, key: str, table: dict[str, Any] | None) -> ToolchainSpec | None:
    """A provider's ``toolchain`` table: exactly one of ``requirements`` and ``python``."""
    if table is None:
        return None
    path = (*key.split("."), "toolchain")
    if ("requirements" in table) == ("python" in table):
        raise where.error(
            path,
            "needs exactly one of requirements and python",
            'e.g. toolchain = { requirements = ["onnxruntime-openvino==1.24.1"] }, or '
            'toolchain = { python = "envs/openvino/bin/python" }',
        )
    if "python" in table:
        return ToolchainSpec(python=table["python"])
    requirements = tuple(normalise(r) for r in table["requirements"])
    for i, req in enumerate(requirements):
        if req.startswith("-"):
            raise where.error(
                (*path, "requirements", f"[{i}]"),
                f"{req!r} is not a requirement (pip options are not accepted here)",
                "give package specifiers such as onnxruntime-openvino==1.24.1; index "
                "settings come from pip's own configuration",
            )
        if req.startswith((".", "/", "~", "\\")) or "file:" in req or _DRIVE.match(req):
            raise where.error(
                (*path, "requirements", f"[{i}]"),
                f"{req!r} is a local file: a toolchain is shared by every workspace on the "
                "machine and named by its requirements' text, which a path does not pin",
                "pin the package by name and version, and let pip find the wheel: "
                "PIP_FIND_LINKS=<folder of wheels> (or find-links in pip.conf)",
            )
    return ToolchainSpec(requirements=requirements)


def _group(
    where: Where,
    root: Path,
    name: str,
    table: dict[str, Any],
    providers: dict[str, ProviderConfig],
    workspace: WorkspaceSettings,
    problems: dict[str, ManifestError],
) -> Group:
    """One ``[groups.<name>]`` table; missing models go to ``problems``, not errors."""
    base = ("groups", name)
    check_provider_list(where, base, table["providers"], providers)
    # A cache directory inside the workspace is never a model folder either.
    local_cache = (workspace.cache,) if workspace.cache and "://" not in workspace.cache else ()
    excluded = (workspace.out_dir, workspace.state_dir, *local_cache)
    numerics = table.get("numerics", {})
    _numerics(where, (*base, "numerics"), numerics)  # reported at the group's table
    entries, patterns = _group_models(
        where, root, base, table["models"], excluded, problems, numerics
    )
    share = table.get("share_weights", False)
    embed = table.get("embed_mode", 0)
    if share and embed == 1:
        raise where.error(
            (*base, "embed_mode"),
            "embed_mode = 1 cannot be combined with share_weights = true",
            "the EP would only log a conflict; use embed_mode = 0 for sharing groups",
        )
    if share:
        _check_sharing(where, base, [providers[p] for p in table["providers"]])
    ext = table.get("external_initializers")
    if ext is not None and (
        "/" in ext or "\\" in ext or ext in (".", "..") or ext.endswith(CTX_SUFFIX)
    ):
        raise where.error(
            (*base, "external_initializers"),
            "must be a plain file name",
            'write e.g. external_initializers = "weights.bin"',
        )
    return Group(
        name=name,
        entries=entries,
        providers=tuple(table["providers"]),
        context=ContextSettings(
            share_weights=share,
            embed_mode=embed,
            node_name_prefix=table.get("node_name_prefix"),
            external_initializers=ext,
            load=table.get("load", "path"),
        ),
        patterns=patterns,
        free_dimensions=dict(table.get("free_dimensions", {})),
        quantize=table.get("quantize"),
    )


def _compile_settings(
    where: Where, base: tuple[str, ...], table: dict[str, Any]
) -> CompileSettings:
    """The compile settings a provider or group table sets (the schema checked the types)."""
    folder = table.get("external_data_folder")
    if folder is not None:
        path = (*base, "external_data_folder")
        folder = _rel(where, folder, path, "external_data_folder")
    return CompileSettings(
        compiler=table.get("compiler"),
        graph_optimization_level=table.get("graph_optimization_level"),
        disable_cpu_ep_fallback=table.get("disable_cpu_ep_fallback"),
        intra_op_num_threads=table.get("intra_op_num_threads"),
        external_data_folder=folder,
    )


def _resolve_compile(
    where: Where,
    group: Group,
    own: CompileSettings,
    provider: ProviderConfig,
    provider_own: CompileSettings,
) -> CompileSettings:
    """A group's settings over its provider's, the compiler and level defaults filled in.

    The default compiler is the compile API where the installed ONNX Runtime has it (read
    from its dist-info, never imported) and the adapter can use it, else sessions; for a
    provider with a toolchain, its ONNX Runtime decides once the toolchain is found.
    """

    def at(name: str) -> tuple[str, ...]:
        """Where ``name`` is set: the group when it sets it, else the provider."""
        if getattr(own, name) is not None:
            return ("groups", group.name, name)
        return ("providers", provider.name, name)

    merged = own.over(provider_own)
    api_ok = get_provider(provider.ep).compile_api
    _check_compile(where, at, group, merged, provider, api_ok)
    compiler: str | None = merged.compiler or default_compiler(api_ok)
    if provider.toolchain is not None:  # unset: its ONNX Runtime decides (planning.keys)
        compiler = merged.compiler
    return replace(
        merged,
        compiler=compiler,
        graph_optimization_level=merged.graph_optimization_level or DEFAULT_OPTIMIZATION_LEVEL,
        disable_cpu_ep_fallback=bool(merged.disable_cpu_ep_fallback),
    )


def _check_compile(
    where: Where,
    at: Callable[[str], tuple[str, ...]],
    group: Group,
    merged: CompileSettings,
    provider: ProviderConfig,
    api_ok: bool,
) -> None:
    """Refuse merged compile settings that cannot work together (``at`` says where each
    setting was set)."""
    if merged.compiler == "compile_api":
        if not api_ok:
            raise where.error(
                at("compiler"),
                f"the {provider.ep} adapter cannot compile through the compile API",
                'use compiler = "session"',
            )
        missing = compile_api_missing() if provider.toolchain is None else None
        if missing is not None:
            raise where.error(
                at("compiler"), missing, 'upgrade onnxruntime, or use compiler = "session"'
            )
    if merged.external_data_folder is not None and group.context.load != "bytes":
        raise where.error(
            at("external_data_folder"),
            "applies only to models handed over as bytes",
            f'set load = "bytes" in [groups.{group.name}], or remove external_data_folder '
            "(a model loaded by path finds its external data next to itself)",
        )
    if merged.disable_cpu_ep_fallback is not None and FALLBACK_ENTRY in provider.session_options:
        raise where.error(
            at("disable_cpu_ep_fallback"),
            f"is also set as session_options {FALLBACK_ENTRY!r} of provider {provider.name!r}",
            "keep one of the two (disable_cpu_ep_fallback is checked and keyed)",
        )


def _group_models(
    where: Where,
    root: Path,
    base: tuple[str, ...],
    entries: list[str | dict[str, Any]],
    excluded: tuple[str, ...],
    problems: dict[str, ManifestError],
    numerics: dict[str, Any],
) -> tuple[tuple[ModelEntry, ...], tuple[str, ...]]:
    """A group's models (globs expanded) and the normalised glob patterns among its entries.

    An entry is a path or glob, or a table ``{ path, name, free_dimensions }``: ``name``
    (one model only) is its output stem, so one source can be compiled twice in a group.
    """
    path = (*base, "models")
    models: list[ModelEntry] = []
    patterns: list[str] = []
    for index, entry in enumerate(entries):
        table = entry if isinstance(entry, dict) else None
        at = (*path, f"[{index}]") if table is not None else path
        raw = table["path"] if table is not None else entry
        assert isinstance(raw, str)  # the schema says so
        pattern = _rel(where, raw, at, "model")
        glob = is_pattern(pattern)
        if glob:
            patterns.append(pattern)
        name = table.get("name") if table is not None else None
        if name is not None and glob:
            raise where.error(
                (*at, "name"),
                f"a name is for one model, but {raw!r} is a pattern",
                "list the model by its path to name it, or leave the name out",
            )
        own = table.get("numerics", {}) if table is not None else {}
        settings = _numerics(
            where, (*at, "numerics") if own else (*base, "numerics"), {**numerics, **own}
        )
        expanded = expand_entry(where, root, at, raw, pattern, glob, excluded)
        for model in expanded:
            problem = check_model(where, root, model, at)
            if problem is not None:
                problems.setdefault(model, problem)
            models.append(
                ModelEntry(
                    path=model,
                    name=name or model_stem(model),
                    free_dimensions=dict(table.get("free_dimensions", {})) if table else {},
                    index=index if table is not None else None,
                    numerics=settings,
                )
            )
    _check_names(where, path, models)
    return tuple(models), tuple(patterns)


def _numerics(where: Where, path: tuple[str, ...], raw: dict[str, Any]) -> NumericsSettings:
    """A ``numerics`` table (the schema checked its types)."""
    ranges: dict[str, tuple[float, float]] = {}
    for name in ("float_range", "int_range"):
        value = raw.get(name)
        if value is None:
            continue
        integer = name == "int_range"
        if (
            len(value) != 2
            or value[0] >= value[1]
            or (integer and not all(isinstance(v, int) for v in value))
        ):
            kind = "integers" if integer else "numbers"
            raise where.error(
                (*path, name),
                f"must be [low, high] with low < high ({kind})",
                f"write e.g. {name} = {'[0, 32000]' if integer else '[-1.0, 1.0]'}",
            )
        ranges[name] = (value[0], value[1])
    inputs = raw.get("inputs", [])
    inputs = [inputs] if isinstance(inputs, str) else inputs
    return NumericsSettings(
        rtol=raw.get("rtol"),
        atol=raw.get("atol"),
        min_cosine=raw.get("min_cosine"),
        inputs=tuple(_rel(where, i, (*path, "inputs"), "numerics input") for i in inputs),
        seed=raw.get("seed", 0),
        float_range=ranges.get("float_range"),
        int_range=tuple(ranges.get("int_range", (0, 4))),  # type: ignore[arg-type]
    )


def _check_names(where: Where, path: tuple[str, ...], models: list[ModelEntry]) -> None:
    """No two models of a group would write the same ctx model."""
    names: dict[str, ModelEntry] = {}
    for entry in models:
        first = names.setdefault(entry.name, entry)
        if first is entry:
            continue
        at = path if entry.index is None else (*path, f"[{entry.index}]")
        if first.path == entry.path:
            raise where.error(
                at,
                f"model {entry.path!r} is listed twice"
                + (f" under the name {entry.name!r}" if entry.index is not None else ""),
                "to compile it twice, give each entry its own name: "
                f'{{ path = "{entry.path}", name = "..." }}',
            )
        raise where.error(
            at,
            f"{first.path!r} and {entry.path!r} would both write {entry.name}{CTX_SUFFIX}",
            "rename one of them, name one entry ({ path = ..., name = ... }), or put them "
            "in different groups",
        )


def _check_sharing(where: Where, base: tuple[str, ...], configs: list[ProviderConfig]) -> None:
    """Every provider of a weight-sharing group can share weights, for a single SoC."""
    path = (*base, "share_weights")
    for cfg in configs:
        adapter = get_provider(cfg.ep)
        why = adapter.sharing_refusal(cfg)
        if why is not None:
            raise where.error(
                path,
                why,
                "compile this group for providers that share, or set share_weights = false "
                "(each model then gets its own context)",
            )
        if "," in cfg.options.get("soc_model", "") + cfg.options.get("htp_arch", ""):
            raise where.error(
                path,
                f"provider {cfg.name!r} targets several SoCs, which the EP cannot "
                "combine with weight sharing",
                "compile this group for single-SoC providers, or set share_weights = false",
            )


def _strip_where(exc: ManifestError) -> str:
    # Adapter errors carry "epbuild.toml: key: msg"; keep only the message part.
    text = exc.message
    if exc.key and f": {exc.key}: " in text:
        return text.split(f": {exc.key}: ", 1)[1]
    return text


def _nested(a: str, b: str) -> bool:
    return a.startswith(b + "/") or b.startswith(a + "/")
