"""What a compile staged, checked before it is committed: the ctx models were written, are
readable, reference only files written beside them (relative, inside the staging
directory), name no directory of the build machine, and a weight-sharing group's models
share one binary."""

from __future__ import annotations

import os
import posixpath
from typing import TYPE_CHECKING

from epbuild._names import LOG_NAME, RESULT_NAME
from epbuild.errors import UnsafePathError, VerificationError
from epbuild.onnx.context import (
    LazySourceText,
    MachinePaths,
    Problem,
    RefFault,
    Severity,
    check_reference,
    machine_paths,
    path_problems,
    sharing_problems,
    stored_references,
)
from epbuild.onnx.proto import ModelInfo, ProtoError, read_model
from epbuild.providers import get_provider

if TYPE_CHECKING:
    from epbuild.providers.contract import ProviderConfig


def staged_names(root: str, staging: str) -> list[str]:
    """The files a worker staged (its log and result document aside); raises
    ``UnsafePathError`` for anything that is not a regular file."""
    full = os.path.join(root, staging)
    names = sorted(n for n in os.listdir(full) if n not in (LOG_NAME, RESULT_NAME))
    for name in names:
        if os.path.islink(os.path.join(full, name)) or not os.path.isfile(os.path.join(full, name)):
            raise UnsafePathError(f"staged output {name} is not a regular file; refusing it")
    return names


def check_staged(
    root: str,
    staging: str,
    ctx_names: tuple[str, ...],
    sources: tuple[str, ...] = (),
    shared_by: ProviderConfig | None = None,
    machine: MachinePaths | None = None,
) -> tuple[list[str], list[Problem]]:
    """Validate a staging directory: the output file names and the warnings (raises
    `VerificationError` on an error).

    Every staged file is a regular file; every ctx model was written, is readable, references
    only files written beside it, and names no directory of the build ``machine`` in its
    free text (`path_problems`; what it kept from the ``sources``, workspace-relative, is a
    warning; default: `machine_paths` of ``root``). ``shared_by``: the provider of a
    weight-sharing group, whose ctx models must all reference one shared context binary
    (``sharing_problems``).
    """
    full = os.path.join(root, staging)
    names = staged_names(root, staging)
    text = LazySourceText(root, sources)
    if machine is None:
        machine = machine_paths(root)
    warnings: list[Problem] = []
    infos: list[ModelInfo] = []
    for ctx in ctx_names:
        if ctx not in names:
            raise VerificationError(f"expected output {ctx} was not written")
        try:
            info = read_model(os.path.join(full, ctx), strings=True)
        except ProtoError as exc:
            raise VerificationError(f"{ctx}: unreadable ctx model ({exc})") from exc
        infos.append(info)
        _check_references(root, staging, ctx, info, names)
        for problem in path_problems(ctx, info, text, machine):
            if problem.severity is Severity.ERROR:
                raise VerificationError(problem.line())
            warnings.append(problem)
    if shared_by is not None:
        _check_sharing(list(ctx_names), infos, shared_by)
    return names, warnings


def _check_references(root: str, staging: str, ctx: str, info: ModelInfo, names: list[str]) -> None:
    """Every file a staged ctx model references was written beside it, inside staging."""
    for ref in stored_references(info):
        check = check_reference(root, posixpath.join(staging, ctx), ref, staging)
        if check.fault is RefFault.UNSAFE:
            raise VerificationError(
                f"{ctx}: references {ref!r}, which is absolute or climbs out with '..'"
            )
        if check.path is None or posixpath.basename(check.path) not in names:
            raise VerificationError(f"{ctx}: references {ref!r}, which was not written")


def _check_sharing(ctx_names: list[str], infos: list[ModelInfo], config: ProviderConfig) -> None:
    """A weight-sharing group's staged ctx models reference one binary (raises otherwise)."""
    problems = sharing_problems(ctx_names, infos, get_provider(config.ep), config)
    if problems:
        raise VerificationError(
            problems[0].line(),
            hint="compile this group with an EP version that supports ep.share_ep_contexts, "
            "or set share_weights = false",
        )
