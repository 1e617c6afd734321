"""The loaded manifest as plain, frozen data: what ``load_manifest`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from epbuild.errors import ManifestError
from epbuild.providers.base import ProviderConfig


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
    patterns: tuple[str, ...]
    """The ``models`` entries that are globs, normalised, in manifest order: what a new
    matching file would change (the no-op fingerprint and ``watch`` follow them)."""


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
