"""``epbuild status --detail``: what each build put into EPContext nodes and what fell back
to the CPU EP, with binary sizes, compile seconds and peak memory, from the state journal."""

from __future__ import annotations

import os
import posixpath
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from epbuild._names import CTX_SUFFIX, model_label
from epbuild.inspection.numerics import _quant_line, last_checks
from epbuild.planning.keys import ORT_KEY
from epbuild.planning.staleness import make_plan
from epbuild.planning.workspace import open_workspace

COMPILER_NAMES = {"compile_api": "the compile API", "session": "sessions"}


@dataclass(frozen=True)
class ModelDetail:
    """One built model of one action."""

    model: str
    name: str
    """The output name (the file's stem unless the manifest names the entry)."""
    ctx: str
    context_nodes: int
    source_nodes: int
    cpu_nodes: int
    cpu_op_types: dict[str, int]
    optimization_level: str | None = None
    """The level ``graph_optimization_level = "auto"`` chose (None: not auto)."""
    numerics: dict[str, Any] | None = None
    """The last ``verify --numerics`` of the model as it is now (its ``--json`` form)."""
    quantized_from: str | None = None
    """The float source of a quantized group's model (``model`` is then its QDQ model)."""

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` form."""
        return asdict(self)


@dataclass
class ActionDetail:
    """One action's last build, or that it was never built."""

    id: str
    group: str
    provider: str
    stale: bool
    built: bool
    seconds: float = 0.0
    peak_rss: int = 0
    restored: bool = False
    compiler: str | None = None
    """``compile_api`` or ``session``, as the worker reported (None: recorded before)."""
    files: dict[str, int] = field(default_factory=dict)
    """Workspace-relative output → size in bytes."""
    models: list[ModelDetail] = field(default_factory=list)
    toolchain: dict[str, str] | None = None
    """For a provider with a toolchain: the package versions it was built with."""

    @property
    def binary_bytes(self) -> int:
        """Total size of the outputs that are not ctx models (context binaries, weights)."""
        return sum(s for p, s in self.files.items() if not p.endswith(CTX_SUFFIX))

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` form."""
        doc = asdict(self)  # models become dicts: ModelDetail.to_json is asdict too
        return {**doc, "seconds": round(self.seconds, 3), "binary_bytes": self.binary_bytes}


def status_detail(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
) -> list[ActionDetail]:
    """Per action and model: EPContext coverage, CPU fallback, sizes, time and memory."""
    ws = open_workspace(directory, manifest, selectors)
    # The whole graph: a compile is stale while an action it reads from is (a quantization).
    graph = make_plan(ws.graph, ws.state, ws.keys, ws.stats, ws.root)
    compiles = {a.id for a in ws.actions}
    plans = [p for p in graph if p.action.id in compiles]
    state = ws.state
    details: list[ActionDetail] = []
    for plan, a in zip(plans, ws.actions, strict=True):
        rec = state.records.get(a.id)
        d = ActionDetail(a.id, a.group.name, a.provider.name, plan.stale, rec is not None)
        details.append(d)
        if rec is None:
            continue
        d.seconds, d.peak_rss, d.restored = rec.seconds, rec.peak_rss, rec.restored
        d.compiler = rec.detail.get("compiler")
        if "toolchain" in rec.components:
            versions = rec.components.get("versions", {})
            d.toolchain = {k: v for k, v in versions.items() if v != "absent" and k != ORT_KEY}
        d.files = {p: o.size for p, o in sorted(rec.outputs.items())}
        models = rec.detail.get("models", {})
        d.models = [
            _model_detail(a.out_dir, m, name, models.get(model_label(m, name), {}))
            for m, name in zip(a.models, a.names, strict=True)
        ]
        sources = getattr(a.group, "sources", ())  # a quantized group's float models
        checks = None if plan.stale else last_checks(ws, a)
        for i, m in enumerate(d.models):
            if sources:
                m = d.models[i] = replace(
                    m, quantized_from=sources[a.group.entries.index(a.entries[i])].path
                )
            if checks is not None:
                d.models[i] = replace(m, numerics=checks[i].to_json())
    return details


def _model_detail(out_dir: str, model: str, name: str, info: dict[str, Any]) -> ModelDetail:
    """One model's detail from what the worker reported (absent keys read as zero)."""
    return ModelDetail(
        model=model,
        name=name,
        ctx=posixpath.join(out_dir, info.get("ctx", name + CTX_SUFFIX)),
        context_nodes=int(info.get("context_nodes", 0)),
        source_nodes=int(info.get("source_nodes", 0)),
        cpu_nodes=int(info.get("cpu_nodes", 0)),
        cpu_op_types=dict(info.get("cpu_op_types", {})),
        optimization_level=info.get("optimization_level"),
    )


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def render(details: list[ActionDetail]) -> list[str]:
    """Human-readable lines."""
    lines: list[str] = []
    for d in details:
        state = "stale" if d.stale else "up to date"
        if not d.built:
            lines.append(f"{d.id}  (never built)")
            continue
        how = "restored" if d.restored else f"compiled in {d.seconds:.2f}s"
        if d.compiler:
            how += f" with {COMPILER_NAMES.get(d.compiler, d.compiler)}"
        lines.append(
            f"{d.id}  ({state}; {how}, peak {_size(d.peak_rss)}, binaries {_size(d.binary_bytes)})"
        )
        if d.toolchain:
            used = ", ".join(f"{k} {v}" for k, v in sorted(d.toolchain.items()))
            lines.append(f"  in its toolchain: {used}")
        for m in d.models:
            cpu = ", ".join(f"{op} x{n}" for op, n in sorted(m.cpu_op_types.items())) or "none"
            lines.append(
                f"  {model_label(m.model, m.name)}: {m.context_nodes} "
                f"EPContext node(s) from "
                f"{m.source_nodes} source nodes; on the CPU EP: {cpu}"
                + (f' (auto: level "{m.optimization_level}")' if m.optimization_level else "")
                + (f" (the QDQ model of {m.quantized_from})" if m.quantized_from else "")
            )
            if m.numerics is not None:
                lines.append(f"    numerics: {numerics_summary(m.numerics)}")
        for path, size in d.files.items():
            lines.append(f"    {path}  {_size(size)}")
    return lines


def numerics_summary(doc: dict[str, Any]) -> str:
    """One line of a recorded numerical check (its ``--json`` form)."""
    if doc["status"] != "ok":
        return f"{doc['status']}: {doc['reason']}"
    outs = doc["outputs"]
    if "min_sqnr_db" in (doc.get("tolerance") or {}):  # a quantized model, against its float
        return f"ok ({_quant_line(outs)})"
    worst = max(outs, key=lambda o: o["max_rel"] if o["max_rel"] is not None else 1e300)
    note = f"; {doc['reason']}" if doc.get("reason") else ""  # e.g. run without the EP
    return (
        f"ok (worst output {worst['name']}: max_abs {worst['max_abs']:.3g}, "
        f"max_rel {worst['max_rel']:.3g}, cosine {worst['cosine']:.6f}{note})"
    )
