"""Read ``epbuild.toml`` into typed, validated objects.

Parsing uses the stdlib ``tomllib`` (fast, no comment preservation); commands that edit the
manifest use tomlkit instead (see ``initcmd``). Every error names file, line and key.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epbuild._names import (
    CTX_SUFFIX,
    DEFAULT_OUT_DIR,
    DEFAULT_STATE_DIR,
    MANIFEST_NAME,
    model_stem,
    tomllib,
)
from epbuild.errors import ManifestError, UnsafePathError
from epbuild.fs import safe_relpath
from epbuild.manifest.schema import SchemaViolation, validate
from epbuild.providers.base import ProviderConfig

_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class Workspace:
    """The ``[workspace]`` table, with defaults applied."""

    out_dir: str
    state_dir: str
    jobs: int
    memory_budget: int | None
    cache: str | None
    executor: str
    scheduler: str | None


@dataclass(frozen=True)
class Group:
    """A model group: models compiled for each of its providers."""

    name: str
    models: tuple[str, ...]
    """Workspace-relative POSIX paths, in manifest order (globs expanded, sorted)."""
    providers: tuple[str, ...]
    share_weights: bool
    embed_mode: int
    node_name_prefix: str | None
    external_initializers: str | None
    load: str


@dataclass(frozen=True)
class Manifest:
    """A loaded manifest."""

    path: Path
    root: Path
    workspace: Workspace
    providers: dict[str, ProviderConfig]
    groups: dict[str, Group]
    problems: dict[str, ManifestError] = field(default_factory=dict)
    """Models named in the manifest that are missing or not files: their actions fail
    (naming file, line and key) while the others still build with ``-k``."""


def find_manifest(directory: str | os.PathLike[str] = ".", name: str | None = None) -> Path:
    """Locate the manifest: ``name`` relative to ``directory``, else epbuild.toml there."""
    path = Path(directory) / (name or MANIFEST_NAME)
    if not path.is_file():
        raise ManifestError(
            "no manifest found",
            file=str(path),
            hint="run 'epbuild init' to create one, or pass -f/-C",
        )
    return path


class _Locator:
    """Finds the line of a key path in the TOML text (tomllib reports no positions)."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()

    def line(self, path: tuple[str, ...]) -> int | None:
        keys = [p for p in path if not p.startswith("[")]
        for depth in range(len(keys), 0, -1):
            found = self._find(keys[:depth])
            if found is not None:
                return found
        return None

    def _find(self, keys: list[str]) -> int | None:
        header: list[str] = []
        best: int | None = None
        for number, raw in enumerate(self.lines, 1):
            line = raw.strip()
            if line.startswith("["):
                inner = line.strip("[]").split("#")[0].strip()
                header = [k.strip().strip("\"'") for k in inner.split(".")]
                if header == keys:
                    return number
                continue
            name = re.match(r"([A-Za-z0-9_.\"'-]+)\s*=", line)
            if not name:
                continue
            dotted = [k.strip().strip("\"'") for k in name.group(1).split(".")]
            full = header + dotted
            if full == keys:
                return number
            if full == keys[: len(full)] and len(keys) > len(full):
                # The rest of the path is inside an inline table or array on this line.
                rest = keys[len(full) :]
                if all(re.search(rf"\b{re.escape(k)}\b", line) for k in rest):
                    return number
                best = best or number
        return best


def _error(
    file: Path, locator: _Locator, path: tuple[str, ...], message: str, hint: str | None = None
) -> ManifestError:
    key = ".".join(p for p in path if not p.startswith("[")) + "".join(
        p for p in path if p.startswith("[")
    )
    return ManifestError(message, file=str(file), line=locator.line(path), key=key, hint=hint)


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


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read, validate and resolve a manifest file."""
    file = Path(path)
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise ManifestError(f"cannot read: {exc.strerror}", file=str(file)) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError("is not UTF-8 text", file=str(file)) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        line = re.search(r"line (\d+)", msg)
        raise ManifestError(
            "invalid TOML: " + re.sub(r" \(at line.*", "", msg),
            file=str(file),
            line=int(line.group(1)) if line else None,
        ) from exc
    locator = _Locator(text)
    try:
        validate(data)
    except SchemaViolation as exc:
        raise _error(file, locator, exc.path, exc.message, exc.hint) from exc
    return _resolve(file, locator, data)


def _resolve(file: Path, locator: _Locator, data: dict[str, Any]) -> Manifest:
    root = file.resolve().parent
    ws = data.get("workspace", {})

    def rel(value: str, path: tuple[str, ...], what: str) -> str:
        try:
            return safe_relpath(value, what=what)
        except UnsafePathError as exc:
            raise _error(file, locator, path, exc.message, exc.hint) from exc

    out_dir = rel(ws.get("out_dir", DEFAULT_OUT_DIR), ("workspace", "out_dir"), "out_dir")
    state_dir = rel(ws.get("state_dir", DEFAULT_STATE_DIR), ("workspace", "state_dir"), "state_dir")
    for name, value in (("out_dir", out_dir), ("state_dir", state_dir)):
        if value == ".":
            raise _error(
                file, locator, ("workspace", name), "must be a subdirectory, not the workspace"
            )
    if out_dir == state_dir or _nested(out_dir, state_dir):
        raise _error(
            file, locator, ("workspace", "state_dir"), "out_dir and state_dir must not overlap"
        )
    budget = ws.get("memory_budget")
    if budget is not None:
        try:
            budget = parse_memory(budget, key="workspace.memory_budget")
        except ManifestError as exc:
            raise _error(file, locator, ("workspace", "memory_budget"), _strip_where(exc),
                         exc.hint) from exc  # fmt: skip
    cache = ws.get("cache")
    if cache is not None and "://" not in cache:
        cache = rel(cache, ("workspace", "cache"), "cache")
    workspace = Workspace(
        out_dir=out_dir,
        state_dir=state_dir,
        jobs=ws.get("jobs") or os.cpu_count() or 1,
        memory_budget=budget,
        cache=cache,
        executor=ws.get("executor", "local"),
        scheduler=ws.get("scheduler"),
    )

    from epbuild.providers import get_provider

    providers: dict[str, ProviderConfig] = {}
    for name, table in data.get("providers", {}).items():
        key = f"providers.{name}"
        try:
            adapter = get_provider(table["ep"])
            settings = {
                k: v for k, v in table.items() if k not in ("ep", "options", "session_options")
            }
            options, adapter_settings = adapter.validate_options(
                table.get("options", {}), settings, key=key
            )
        except ManifestError as exc:
            sub = tuple((exc.key or key).split("."))
            raise _error(file, locator, sub, _strip_where(exc), exc.hint) from exc
        session_options = {
            k: ("1" if v is True else "0" if v is False else str(v))
            for k, v in table.get("session_options", {}).items()
        }
        for k in session_options:
            if k.startswith(("ep.context_", "ep.share_ep_contexts")) or k in (
                "ep.stop_share_ep_contexts",
                "session.model_external_initializers_file_folder_path",
            ):
                raise _error(
                    file, locator, (*key.split("."), "session_options", k),
                    "is set by epbuild from the group settings",
                    "use the group's embed_mode, share_weights, node_name_prefix or "
                    "external_initializers instead",
                )  # fmt: skip
        providers[name] = ProviderConfig(
            name=name,
            ep=table["ep"],
            options=options,
            session_options=session_options,
            settings=adapter_settings,
            base_dir=str(root),
        )

    groups: dict[str, Group] = {}
    problems: dict[str, ManifestError] = {}
    excluded = (out_dir, state_dir)
    for name, table in data.get("groups", {}).items():
        base = ("groups", name)
        for i, pname in enumerate(table["providers"]):
            if pname not in providers:
                defined = ", ".join(providers) or "none"
                raise _error(
                    file, locator, (*base, "providers"),
                    f"provider {pname!r} is not defined",
                    f"add a [providers.{pname}] table (defined: {defined})",
                )  # fmt: skip
            if pname in table["providers"][:i]:
                raise _error(file, locator, (*base, "providers"), f"{pname!r} is listed twice")
        models: list[str] = []
        for pattern in table["models"]:
            expanded = _expand(root, rel(pattern, (*base, "models"), "model"), excluded)
            if not expanded:
                raise _error(
                    file, locator, (*base, "models"), f"pattern {pattern!r} matches no files",
                    "add the models, or fix the pattern (relative to the manifest's directory)",
                )  # fmt: skip
            for model in expanded:
                if model in models:
                    raise _error(
                        file, locator, (*base, "models"), f"model {model!r} is listed twice"
                    )
                problem = _check_model(file, locator, root, model, base)
                if problem is not None:
                    problems[model] = problem
                models.append(model)
        stems: dict[str, str] = {}
        for model in models:
            stem = model_stem(model)
            if stem in stems:
                raise _error(
                    file, locator, (*base, "models"),
                    f"{stems[stem]!r} and {model!r} would both write {stem}{CTX_SUFFIX}",
                    "rename one of them, or put them in different groups",
                )  # fmt: skip
            stems[stem] = model
        share = table.get("share_weights", False)
        embed = table.get("embed_mode", 0)
        if share and embed == 1:
            raise _error(
                file, locator, (*base, "embed_mode"),
                "embed_mode = 1 cannot be combined with share_weights = true",
                "the EP would only log a conflict; use embed_mode = 0 for sharing groups",
            )  # fmt: skip
        if share:
            for pname in table["providers"]:
                cfg = providers[pname]
                adapter = get_provider(cfg.ep)
                if not adapter.shares_weights:
                    raise _error(
                        file, locator, (*base, "share_weights"),
                        f"provider {pname!r} ({cfg.ep}) does not support weight sharing",
                    )  # fmt: skip
                if "," in cfg.options.get("soc_model", "") + cfg.options.get("htp_arch", ""):
                    raise _error(
                        file, locator, (*base, "share_weights"),
                        f"provider {pname!r} targets several SoCs, which the EP cannot "
                        "combine with weight sharing",
                        "compile this group for single-SoC providers, or set "
                        "share_weights = false",
                    )  # fmt: skip
        ext = table.get("external_initializers")
        if ext is not None and (
            "/" in ext or "\\" in ext or ext in (".", "..") or ext.endswith(CTX_SUFFIX)
        ):
            raise _error(
                file, locator, (*base, "external_initializers"),
                "must be a plain file name", "write e.g. external_initializers = \"weights.bin\"",
            )  # fmt: skip
        groups[name] = Group(
            name=name,
            models=tuple(models),
            providers=tuple(table["providers"]),
            share_weights=share,
            embed_mode=embed,
            node_name_prefix=table.get("node_name_prefix"),
            external_initializers=ext,
            load=table.get("load", "path"),
        )
    return Manifest(file, root, workspace, providers, groups, problems)


def _strip_where(exc: ManifestError) -> str:
    # Adapter errors carry "epbuild.toml: key: msg"; keep only the message part.
    text = exc.message
    if exc.key and f": {exc.key}: " in text:
        return text.split(f": {exc.key}: ", 1)[1]
    return text


def _nested(a: str, b: str) -> bool:
    return a.startswith(b + "/") or b.startswith(a + "/")


def _expand(root: Path, pattern: str, excluded: tuple[str, ...]) -> list[str]:
    if not _GLOB_CHARS.search(pattern):
        return [pattern]
    import glob

    # root_dir: the workspace path itself may contain glob characters ("proj[1]").
    base = str(root)
    found = sorted(
        posixpath.normpath(p.replace(os.sep, "/"))
        for p in glob.glob(pattern, root_dir=base, recursive=True)
        if os.path.isfile(os.path.join(base, p))
    )
    return [p for p in found if not any(p == d or p.startswith(d + "/") for d in excluded)]


def _check_model(
    file: Path, locator: _Locator, root: Path, model: str, base: tuple[str, ...]
) -> ManifestError | None:
    import stat

    try:
        mode = os.stat(os.path.join(root, model)).st_mode
    except OSError:
        return _error(
            file, locator, (*base, "models"),
            f"model file {model!r} does not exist",
            "check the path (it is relative to the manifest's directory)",
        )  # fmt: skip
    if not stat.S_ISREG(mode):
        return _error(file, locator, (*base, "models"), f"{model!r} is not a file")
    return None
