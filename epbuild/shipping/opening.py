"""Opening a group of an epbuild-written model package as ONNX Runtime sessions.

``open_package`` reads the deployment manifest, picks the group's variant (the provider
named, the only one, or the one ONNX Runtime's ``ModelPackageContext`` selects for the EP
of the first variant), checks the variant's files against the manifest (sizes, or sha256
with ``check="hash"``) and opens its ctx models in order exactly as ``open_action`` does:
weight-sharing groups with ``ep.share_ep_contexts=1`` and reverse teardown.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from epbuild.errors import EpNameMismatchError, UserError, VerificationError
from epbuild.fs import digest_file, is_safe_reference
from epbuild.providers import get_provider
from epbuild.providers.contract import ProviderConfig
from epbuild.runtime import BuiltAction, SessionFactory, open_sources
from epbuild.shipping.contents import DEPLOY_FORMAT, DEPLOY_NAME, ORT_MANIFEST_NAME


def read_deployment(package_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The deployment manifest of the package at ``package_dir`` (``UserError`` if none)."""
    path = os.path.join(os.fspath(package_dir), DEPLOY_NAME)
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        raise UserError(
            f"{os.fspath(package_dir)} is not an epbuild package (no {DEPLOY_NAME})",
            hint="write one with 'epbuild package -o DIR'",
        ) from None
    except (OSError, ValueError) as exc:
        raise VerificationError(f"{path}: cannot read the deployment manifest: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("epbuild_package") != DEPLOY_FORMAT:
        raise VerificationError(
            f"{path}: not a deployment manifest of format {DEPLOY_FORMAT}",
            hint="package it again with this epbuild",
        )
    return doc


def check_files(
    package_dir: str | os.PathLike[str], doc: dict[str, Any], paths: list[str], *, rehash: bool
) -> None:
    """Raise ``VerificationError`` naming the first of ``paths`` that is missing or differs
    from the deployment manifest (size; also sha256 with ``rehash``)."""
    files = doc.get("files", {})
    for rel in paths:
        want = files.get(rel)
        if want is None or not is_safe_reference(rel):
            raise VerificationError(f"{rel}: not listed in {DEPLOY_NAME}")
        full = os.path.join(os.fspath(package_dir), rel)
        try:
            size = os.path.getsize(full)
            got = digest_file(full).sha256 if rehash else want["sha256"]
        except OSError as exc:
            raise VerificationError(
                f"package file {rel} cannot be read: {exc.strerror}",
                hint="copy the whole package again",
            ) from exc
        if size != want["size"] or got != want["sha256"]:
            what = (
                f"size {size}, expected {want['size']}"
                if size != want["size"]
                else (f"sha256 {got[:16]}…, expected {want['sha256'][:16]}…")
            )
            raise VerificationError(
                f"package file {rel} is damaged ({what})", hint="copy the whole package again"
            )


def open_package(
    package_dir: str | os.PathLike[str],
    group: str,
    *,
    provider: str | None = None,
    check: Literal["stat", "hash", "size"] = "stat",
    lock_timeout: float | None = None,
    session_factory: SessionFactory | None = None,
    ep_name: str | None = None,
) -> BuiltAction:
    """Open one group of a package (every model, in order) for one provider; see the
    module docstring. ``ep_name`` is the name the app registers the EP under: a variant
    declaring another name is refused (``EpNameMismatchError``), as ONNX Runtime would not
    select it; by default the EP is registered under the name the package declares."""
    if check not in ("stat", "hash", "size"):  # "size": the first name of "stat"
        raise UserError(f"check must be 'stat' or 'hash', not {check!r}")
    doc = read_deployment(package_dir)
    actions = [a for a in doc.get("actions", []) if a.get("group") == group]
    if not actions:
        groups = sorted({str(a.get("group")) for a in doc.get("actions", [])})
        raise UserError(f"the package has no group {group!r}", hint="groups: " + ", ".join(groups))
    providers = list(dict.fromkeys(str(a["provider"]) for a in actions))
    if provider is None and ep_name is not None:
        named = [a for a in actions if declared_name(a) == ep_name]
        provider = str((named or actions)[0]["provider"])
    if provider is None:
        provider = providers[0] if len(providers) == 1 else select_variant(package_dir, actions)
    mine = [a for a in actions if a["provider"] == provider]
    if not mine:
        raise UserError(
            f"group {group!r} of the package has no variant for provider {provider!r}",
            hint="providers: " + ", ".join(providers),
        )
    declared = declared_name(mine[0])
    if ep_name is not None and ep_name != declared:
        raise name_mismatch(f"group {group!r}", provider, declared, ep_name)
    paths = [ORT_MANIFEST_NAME, *(f for a in mine for f in a["files"])]
    check_files(package_dir, doc, paths, rehash=check == "hash")
    config = provider_config(mine[0])
    models = [os.path.join(os.fspath(package_dir), m["ctx"]) for a in mine for m in a["models"]]
    share = bool(mine[0]["share_weights"])
    what = f"{group}/{provider}"
    return open_sources(models, config, share, lock_timeout, session_factory, what, declared)


def declared_name(action: dict[str, Any]) -> str:
    """The EP name an action's variants declare: what an app must register the EP as."""
    return str(action.get("ep_name") or action["ep"])


def name_mismatch(what: str, provider: str, declared: str, registered: str) -> UserError:
    """The error for an app that registers the EP under another name than a variant
    declares: ONNX Runtime's selection finds no variant ("No suitable model variant")."""
    return EpNameMismatchError(
        f"{what} of the package declares its {provider!r} variants for the execution provider "
        f"named {declared!r}, but the app registers it as {registered!r}: ONNX Runtime "
        "selects a variant only by that exact name",
        hint=f"register the EP library as {declared!r} in the app "
        f"(ort.register_execution_provider_library({declared!r}, path)), or package it for "
        f'the app\'s name: [package] ep_names = {{ {provider} = "{registered}" }} in '
        "epbuild.toml",
    )


def provider_config(action: dict[str, Any]) -> ProviderConfig:
    """The provider configuration an action of the deployment manifest was built with."""
    # The action's own ``to_json`` form, but for the names of two keys.
    renamed = {"name": action["provider"], "options": action.get("provider_options", {})}
    return ProviderConfig.from_json({**action, **renamed})


def select_variant(package_dir: str | os.PathLike[str], actions: list[dict[str, Any]]) -> str:
    """The provider whose variant ONNX Runtime's ``ModelPackageContext`` selects for the
    group's first model, with the EP of the group's first (preferred) provider attached."""
    import onnxruntime as ort

    first = actions[0]
    config = provider_config(first)
    so = ort.SessionOptions()
    get_provider(config.ep).attach(ort, so, config, declared_name(first))
    component = f"{first['group']}/{first['models'][0]['name']}"
    try:
        ctx = ort.ModelPackageContext(os.fspath(package_dir))
        chosen = ctx.select_component(component, ort.ModelPackageOptions(so))
        return str(chosen.get_selected_variant_name())
    except Exception as exc:
        text = str(exc).strip().splitlines()
        declared = sorted({f"{a['provider']}: {declared_name(a)}" for a in actions})
        raise UserError(
            f"ONNX Runtime selects no variant of {component}: {text[0] if text else exc} "
            f"(its variants declare the EP names {', '.join(declared)}; the EP was registered "
            f"as {declared_name(first)!r})",
            hint="name the provider to open (provider=...)",
        ) from exc
