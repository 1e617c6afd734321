"""``epbuild package``: the selected actions' verified, up-to-date outputs as one ONNX Runtime
model package (``contents`` says what it holds, ``writer`` how it is written)."""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from epbuild.api import build
from epbuild.cache.location import resolve
from epbuild.errors import (
    ActionFailedError,
    OutOfDateError,
    UnsafePathError,
    UserError,
    VerificationError,
)
from epbuild.fs import digest_file, inside
from epbuild.inspection.numerics import last_checks
from epbuild.llm.genai_schema import GENAI_CONFIG
from epbuild.llm.package import package_files
from epbuild.planning.committed import committed_outputs, stat_of
from epbuild.planning.llms import LlmGroup
from epbuild.planning.staleness import make_plan
from epbuild.planning.workspace import open_workspace
from epbuild.results import BuildResult, Reporter
from epbuild.shipping.contents import DEPLOY_NAME, Contents, PackagedFile, package_contents
from epbuild.shipping.writer import WriteStats, write_package
from epbuild.userdirs import default_cache_dir

if TYPE_CHECKING:
    from epbuild.manifest.model import Llm
    from epbuild.planning.workspace import Workspace


@dataclass
class PackageResult:
    """What ``package`` wrote."""

    path: str
    """The package directory (as given, joined to the workspace directory if relative)."""
    deployment: dict[str, Any]
    """The deployment manifest written into the package (``epbuild-package.json``)."""
    stats: WriteStats
    built: BuildResult | None = None
    """The build ``build=True`` ran first."""
    components: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` form: the deployment manifest and what was written."""
        s = self.stats
        written = {"kept": len(s.kept), "linked": len(s.linked), "copied": len(s.copied)}
        written["unchanged"] = s.unchanged
        written["removed"] = len(s.removed)
        return {"package": self.path, "written": written, "deployment": self.deployment}


def package(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
    out: str | os.PathLike[str] | None = None,
    *,
    build: bool = False,
    check: Literal["stat", "hash"] = "stat",
    reporter: Reporter | None = None,
    lock_timeout: float | None = None,
    force: bool = False,
    build_options: Mapping[str, Any] | None = None,
) -> PackageResult:
    """Write the selected actions' outputs as an ONNX Runtime model package at ``out``
    (relative to ``directory``; default ``[package] out_dir``).

    Every selected action must be up to date with its outputs as its build committed them
    (``OutOfDateError`` names the others), unless ``build`` builds them first. ``check="hash"``
    re-hashes every output instead of trusting the stat cache. ``lock_timeout`` bounds the
    wait for another run writing the same package directory (``LockTimeoutError``);
    ``force`` replaces a package directory that holds files its deployment manifest does not
    list (they are deleted; without it, ``UnsafePathError`` names them). ``build_options``:
    further keyword arguments of ``build`` (``jobs``, ``keep_going``, ``cache``...).
    """
    ws = open_workspace(directory, manifest, selectors)
    cache = (build_options or {}).get("cache") if build else None
    dest = _destination(ws.root, ws.manifest, directory, out, cache)
    if not ws.actions:
        raise UserError("nothing to package: the manifest has no groups")
    built = None
    if build:
        options = {"lock_timeout": lock_timeout, **(build_options or {})}
        built = _build_first(directory, manifest, selectors, reporter, options)
        ws = open_workspace(directory, manifest, selectors)
    _refuse_stale(ws)
    snapshot = committed_outputs(ws, ws.actions, rehash=check == "hash")
    committed = [(a, ws.state.records[a.id]) for a in ws.actions]
    contents = package_contents(
        ws.manifest.workspace.out_dir, committed, ws.manifest.package, _figures(ws)
    )
    _add_llm_packages(ws, contents)
    generated = contents.generated()
    unreplaced = _unreplaced(ws.root, snapshot)
    stats = write_package(
        dest,
        ws.root,
        contents.files,
        generated,
        unreplaced,
        force=force,
        lock_timeout=lock_timeout,
        on_wait=reporter.message if reporter is not None else None,
    )
    shown = os.fspath(out) if out is not None else str(ws.manifest.package.out_dir)
    names = list(contents.ort_manifest["components"])
    return PackageResult(shown, json.loads(generated[DEPLOY_NAME]), stats, built, names)


def _refuse_stale(ws: Workspace) -> None:
    """``OutOfDateError`` naming every selected action that is not up to date."""
    plans = make_plan(ws.graph, ws.state, ws.keys, ws.stats, ws.root)  # packages' too
    stale = [p for p in plans if p.stale]
    if stale:
        listed = "; ".join(
            f"{p.action.id} ({p.reasons[0] if p.reasons else 'stale'})" for p in stale
        )
        raise OutOfDateError(
            f"{len(stale)} action(s) to package are not up to date: {listed}",
            hint="run 'epbuild build' first, or 'epbuild package --build'",
        )


def _package_files(ws: Workspace, llm: Llm, folder: str) -> dict[str, tuple[int, str]]:
    """The files of an LLM package: as its package action recorded them (size, digest),
    else (a selection without every graph of the LLM) as they are now."""
    ids = [a.id for a in ws.graph if a.kind == "package" and a.out_dir == folder]
    rec = ws.state.records.get(ids[0]) if ids else None
    if rec is not None:
        return {rel: (o.size, o.digest) for rel, o in sorted(rec.outputs.items())}
    found: dict[str, tuple[int, str]] = {}
    for rel in package_files(ws.root, llm, folder):
        try:
            digest = digest_file(os.path.join(ws.root, rel))
        except OSError as exc:
            raise OutOfDateError(
                f"{rel}: the LLM package file is missing ({exc.strerror})",
                hint="run 'epbuild build' first, or 'epbuild package --build'",
            ) from exc
        found[rel] = (digest.size, digest.sha256)
    return found


def _add_llm_packages(ws: Workspace, contents: Contents) -> None:
    """Each selected LLM × provider's genai files (config, tokenizer: written by the build,
    outputs of no action) join the package beside its ctx models, and the deployment
    manifest lists the genai folders under ``llms``."""
    out_dir = ws.manifest.workspace.out_dir
    seen: dict[str, dict[str, Any]] = {}
    for action in ws.actions:
        if not isinstance(action.group, LlmGroup) or action.out_dir in seen:
            continue
        llm = ws.manifest.llms[action.group.name]
        for rel, (size, sha256) in _package_files(ws, llm, action.out_dir).items():
            path = posixpath.relpath(rel, out_dir)
            contents.files.append(PackagedFile(path, rel, size, sha256))
        folder = posixpath.relpath(action.out_dir, out_dir)
        seen[action.out_dir] = {
            "name": llm.name,
            "provider": action.provider.name,
            "folder": folder,
            "genai_config": posixpath.join(folder, GENAI_CONFIG),
            "context_length": llm.context_length,
            "window_size": llm.window_size,
            "share_weights": llm.share_weights,
        }
    if not seen:
        return
    contents.files.sort(key=lambda f: f.path)
    contents.deployment["llms"] = list(seen.values())
    contents.deployment["files"] = {
        f.path: {"size": f.size, "sha256": f.sha256} for f in contents.files
    }


def _destination(
    root: str,
    manifest: Any,
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str] | None,
    cache: str | bool | None = None,
) -> str:
    """The package directory; refuses one inside the output or state directory, inside a
    cache (the one ``cache``, the environment or the manifest names, or the per-user one:
    their prune deletes files they do not know), or one holding the workspace."""
    if out is not None:
        dest = os.path.join(os.fspath(directory), os.fspath(out))
    elif manifest.package.out_dir is not None:
        dest = os.path.join(root, manifest.package.out_dir)
    else:
        raise UserError(
            "no package directory given",
            hint="give one with -o DIR, or set out_dir in the [package] table",
        )
    dest = os.path.abspath(dest)
    ws = manifest.workspace
    for what, d in (("output", ws.out_dir), ("state", ws.state_dir)):
        if inside(dest, os.path.join(root, d)):
            raise UnsafePathError(
                f"package directory {os.fspath(out or dest)} is inside the {what} directory {d}",
                hint="package into a directory of its own, e.g. -o dist",
            )
    base = os.path.abspath(directory)
    cfg = resolve(cache, base=base, manifest_value=ws.cache, manifest_root=root)
    for d in sorted({default_cache_dir(), *([cfg.local] if cfg is not None else [])}):
        if inside(dest, d) and not inside(root, d):  # (a workspace kept in a cache: its own)
            raise UnsafePathError(
                f"package directory {os.fspath(out or dest)} is inside the cache directory "
                f"{d} (pruning the cache deletes files it does not know)",
                hint="package into a directory of its own, e.g. -o dist",
            )
    if inside(root, dest):
        raise UnsafePathError(
            f"package directory {os.fspath(out or dest)} holds the workspace itself",
            hint="package into a directory of its own, e.g. -o dist",
        )
    return dest


def _build_first(
    directory: str | os.PathLike[str],
    manifest: str | os.PathLike[str] | None,
    selectors: list[str] | tuple[str, ...],
    reporter: Reporter | None,
    options: Mapping[str, Any],
) -> BuildResult:
    result = build(directory, manifest, selectors, reporter=reporter, **options)
    if result.exit_code != 0:
        failed = [a.id for a in result.actions if a.outcome.value == "failed"]
        raise ActionFailedError(
            "the build failed"
            + (f" ({', '.join(failed)})" if failed else "")
            + "; nothing was packaged",
            hint="fix the failure ('epbuild build' shows it), then package again",
        )
    return result


def _unreplaced(root: str, snapshot: dict[str, Any]) -> Callable[[], None]:
    """A check, run before the new package is swapped in, that no output it took was
    replaced (by a concurrent build) since it was verified."""

    def check() -> None:
        for rel, st in snapshot.items():
            if stat_of(root, rel) != st:
                raise VerificationError(
                    f"output {rel} was replaced while it was packaged (a build is committing it)",
                    hint="package again once that build is done; the old package is unchanged",
                )

    return check


def _figures(ws: Workspace) -> dict[tuple[str, int], dict[str, Any]]:
    """Each model's last recorded ``verify --numerics`` (as its outputs are now), for the
    deployment manifest; models never checked are left out."""
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for action in ws.actions:
        for i, check in enumerate(last_checks(ws, action) or ()):
            found[action.id, i] = check.to_json()
    return found
