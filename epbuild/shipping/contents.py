"""What an ONNX Runtime model package of a workspace holds: its files, ONNX Runtime's
``manifest.json`` and epbuild's deployment manifest, computed from committed actions.

ONNX Runtime's package format gives a *variant* exactly one ``model_file``, so the unit of
selection is one model: each model of a group is one component, ``<group>/<name>``, with
one variant per provider. The variants of one group and provider all name the same
directory, ``<group>/<provider>`` (the build's own output layout), so a weight-sharing
group's shared context binary is stored once beside its ctx models, whose
``ep_cache_context`` already names it relative to themselves. Everything written here is
relative and free of timestamps: the same outputs give the same bytes wherever the workspace
lives.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from epbuild._dataclass import dataclass, field
from epbuild._names import CTX_SUFFIX, PACKAGE_MANIFEST, model_label
from epbuild.manifest.model import PackageSettings
from epbuild.planning.actions import CompileAction
from epbuild.providers import get_provider
from epbuild.state.journal import ActionRecord

DEPLOY_NAME = PACKAGE_MANIFEST
"""epbuild's deployment manifest at the package root; also what marks a directory as a
package epbuild may replace."""
ORT_MANIFEST_NAME = "manifest.json"
"""ONNX Runtime's package manifest."""
DEPLOY_FORMAT = 1
"""Version of the deployment manifest's layout (its ``epbuild_package`` value)."""
ANY_DEVICE = "any"
"""``[package] devices`` value that declares no device constraint."""


@dataclass(frozen=True)
class PackagedFile:
    """One built output as the package holds it."""

    path: str
    """Package-relative POSIX path."""
    source: str
    """Workspace-relative path of the committed output it comes from."""
    size: int
    sha256: str


@dataclass
class Contents:
    """Everything one package holds."""

    files: list[PackagedFile] = field(default_factory=list)
    ort_manifest: dict[str, Any] = field(default_factory=dict)
    deployment: dict[str, Any] = field(default_factory=dict)

    def generated(self) -> dict[str, bytes]:
        """The two manifests as the bytes written (the deployment manifest lists the
        ``manifest.json`` it goes with, by size and digest)."""
        ort = dumps(self.ort_manifest)
        deploy = dict(self.deployment)
        deploy["files"] = {
            **deploy["files"],
            ORT_MANIFEST_NAME: {"size": len(ort), "sha256": _sha256(ort)},
        }
        return {ORT_MANIFEST_NAME: ort, DEPLOY_NAME: dumps(deploy)}


def dumps(doc: dict[str, Any]) -> bytes:
    """The one JSON spelling of both manifests: stable, indented, UTF-8, newline-ended."""
    return (json.dumps(doc, indent=1, ensure_ascii=False) + "\n").encode()


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def package_contents(
    out_dir: str,
    committed: list[tuple[CompileAction, ActionRecord]],
    settings: PackageSettings,
    figures: dict[tuple[str, int], dict[str, Any]] | None = None,
) -> Contents:
    """The package of ``committed`` actions (up to date, outputs verified), in manifest order;
    ``figures``: the last numerical check of (action id, model index)."""
    contents = Contents()
    components: dict[str, dict[str, Any]] = {}
    actions: list[dict[str, Any]] = []
    for action, rec in committed:
        variant_dir = posixpath.relpath(action.out_dir, out_dir)
        for rel, out in sorted(rec.outputs.items()):
            path = posixpath.relpath(rel, out_dir)
            contents.files.append(PackagedFile(path, rel, out.size, out.digest))
        described = describe_action(action, rec, variant_dir, settings)
        for i, model in enumerate(described["models"]):
            model["numerics"] = (figures or {}).get((action.id, i))
        actions.append(described)
        for model in described["models"]:
            component = components.setdefault(
                f"{action.group.name}/{model['name']}", _component(action, model["name"])
            )
            variant = _variant(described, model, settings.compatibility_strings)
            component["variants"][action.provider.name] = variant
    contents.files.sort(key=lambda f: f.path)
    ep_names = {a["provider"]: a["ep_name"] for a in actions}
    contents.ort_manifest = _ort_manifest(components, settings, ep_names)
    contents.deployment = {
        "epbuild_package": DEPLOY_FORMAT,
        "package": _package_labels(settings),
        "ort_manifest": ORT_MANIFEST_NAME,
        "ep_names": ep_names,
        "components": [_component_entry(name, c) for name, c in components.items()],
        "actions": actions,
        "files": {f.path: {"size": f.size, "sha256": f.sha256} for f in contents.files},
    }
    return contents


def describe_action(
    action: CompileAction, rec: ActionRecord, variant_dir: str, settings: PackageSettings
) -> dict[str, Any]:
    """One action in the deployment manifest: key, EP, target, toolchain versions,
    compiler, per model its source digests and partition coverage, and its files."""
    provider = action.provider
    ep_name, device = variant_target(action, settings)
    models = [_model_entry(rec, action, i, variant_dir) for i in range(len(action.entries))]
    return {
        "id": action.id,
        "group": action.group.name,
        "provider": provider.name,
        "variant_directory": variant_dir,
        "key": rec.key,
        "ep": provider.ep,
        "ep_name": ep_name,
        "device": device,
        "target": next((m["compatibility"] for m in models if m["compatibility"]), None),
        "provider_options": dict(provider.options),
        "session_options": dict(provider.session_options),
        "settings": {k: v for k, v in provider.settings.items() if k != "library"},
        "versions": dict(rec.components.get("versions", {})),
        "compile": dict(rec.components.get("compile", {})),
        "compiler": rec.detail.get("compiler"),
        "share_weights": action.group.context.share_weights,
        "embed_mode": action.group.context.embed_mode,
        "models": models,
        "files": sorted(
            posixpath.join(variant_dir, posixpath.relpath(r, action.out_dir)) for r in rec.outputs
        ),
    }


def variant_target(action: CompileAction, settings: PackageSettings) -> tuple[str, str | None]:
    """The EP name and device constraint of an action's variants (``[package] ep_names``
    and ``devices`` over the adapter's own). The EP name is the one an app must register the
    EP under for ONNX Runtime to select the variant."""
    ep_name, device = get_provider(action.provider.ep).package_target(action.provider)
    chosen = settings.devices.get(action.provider.name, device)
    ep_name = settings.ep_names.get(action.provider.name, ep_name)
    return str(ep_name), None if chosen in (None, ANY_DEVICE) else str(chosen)


def _model_entry(
    rec: ActionRecord, action: CompileAction, i: int, variant_dir: str
) -> dict[str, Any]:
    entry = action.entries[i]
    info = rec.detail.get("models", {}).get(model_label(entry.path, entry.name), {})
    sources = rec.components.get("models", [])
    source = sources[i] if i < len(sources) and isinstance(sources[i], dict) else {}
    return {
        "name": entry.name,
        "source": entry.path,
        "source_sha256": source.get("digest"),
        "external": dict(source.get("external", {})),
        "ctx": posixpath.join(variant_dir, str(info.get("ctx", entry.name + CTX_SUFFIX))),
        "compatibility": info.get("compatibility"),
        "context_nodes": int(info.get("context_nodes", 0)),
        "source_nodes": int(info.get("source_nodes", 0)),
        "cpu_nodes": int(info.get("cpu_nodes", 0)),
        "cpu_op_types": dict(info.get("cpu_op_types", {})),
    }


def _component(action: CompileAction, name: str) -> dict[str, Any]:
    group = action.group
    return {
        "component_name": f"{group.name}/{name}",
        "variants": {},
        "additional_metadata": {
            "epbuild": {
                "group": group.name,
                "model": name,
                "position": [e.name for e in group.entries].index(name),
                "group_size": len(group.entries),
                "share_weights": group.context.share_weights,
            }
        },
    }


def _variant(action: dict[str, Any], model: dict[str, Any], compatibility: bool) -> dict[str, Any]:
    """A variant body in ONNX Runtime's schema (``executor_info["ort"]`` is its slot): ORT's
    default ``create_session`` applies its session options (``ep.share_ep_contexts`` for a
    sharing group, the provider's own) and provider options. ``compatibility`` off leaves
    ``compatibility_string`` out (``[package] compatibility_strings``): onnxruntime-qnn
    2.7.0 crashes judging one on x86_64 (docs/research/model-package.md).
    """
    session_options = dict(action["session_options"])
    if action["share_weights"]:  # each member's session joins the EP's shared workspace
        session_options["ep.share_ep_contexts"] = "1"
    body: dict[str, Any] = {
        "variant_directory": action["variant_directory"],
        "ep": action["ep_name"],
    }
    if action["device"]:
        body["device"] = action["device"]
    if compatibility and model["compatibility"]:
        body["compatibility_string"] = model["compatibility"]
    ort: dict[str, Any] = {"model_file": posixpath.basename(model["ctx"])}
    if session_options:
        ort["session_options"] = session_options
    ort["provider_options"] = action["provider_options"]
    body["executor_info"] = {"ort": ort}
    body["additional_metadata"] = {"epbuild": {"action": action["id"], "key": action["key"]}}
    return body


def _package_labels(settings: PackageSettings) -> dict[str, str]:
    labels = {
        "name": settings.name,
        "version": settings.version,
        "description": settings.description,
    }
    return {k: v for k, v in labels.items() if v is not None}


def _ort_manifest(
    components: dict[str, dict[str, Any]], settings: PackageSettings, ep_names: dict[str, str]
) -> dict[str, Any]:
    doc: dict[str, Any] = {"schema_version": "1.0"}
    labels = _package_labels(settings)
    for ours, theirs in (("name", "package_name"), ("version", "package_version")):
        if ours in labels:
            doc[theirs] = labels[ours]
    if "description" in labels:
        doc["description"] = labels["description"]
    doc["layout"] = "portable"
    doc["components"] = components
    doc["additional_metadata"] = {
        "epbuild": {
            "deployment_manifest": DEPLOY_NAME,
            "format": DEPLOY_FORMAT,
            "ep_names": ep_names,  # provider → the name the app registers its EP as
        }
    }
    return doc


def _component_entry(name: str, component: dict[str, Any]) -> dict[str, Any]:
    meta = component["additional_metadata"]["epbuild"]
    return {"name": name, **meta, "variants": list(component["variants"])}
