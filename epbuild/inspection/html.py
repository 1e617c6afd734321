"""``epbuild report --html FILE``: one self-contained page (no network) showing the build
graph (every action of every kind, its dependencies, state, how it was last made and how
long that took), the last build's timeline and a table per compile action: outcome,
compile seconds, peak memory, binary sizes, nodes compiled vs. left on the CPU EP, cache
hit or miss, and each model's last numerical check.

The graph and the table are rendered here (readable without JavaScript); the timeline is
drawn by a small inline script from the trace the last build left in the state directory."""

from __future__ import annotations

import html
import json
import os
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass
from epbuild._names import CTX_SUFFIX, TRACE_NAME
from epbuild.engine.trace import KINDS, load_trace
from epbuild.fs import atomic_write_bytes, format_bytes
from epbuild.inspection.detail import COMPILER_NAMES, ActionDetail, numerics_summary, status_detail
from epbuild.kinds.contract import kind_of
from epbuild.planning.staleness import make_plan
from epbuild.planning.workspace import open_workspace

if TYPE_CHECKING:
    from epbuild.planning.workspace import Workspace

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px;margin:0 0 4px} .sub{color:#666;margin-bottom:16px}
table{border-collapse:collapse;width:100%;margin-top:16px}
th,td{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4} td.n{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#17823b}.stale{color:#b35900}.never{color:#888}.hit{color:#17823b}
#timeline{border:1px solid #ddd;overflow-x:auto} #timeline svg{display:block}
.legend span{display:inline-block;margin-right:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
small{color:#666}
"""

_COLORS = {
    "plan": "#9e9e9e",
    "hash": "#7e57c2",
    "lock": "#ef5350",
    "compile": "#1e88e5",
    "verify": "#43a047",
    "commit": "#fb8c00",
    "restore": "#00acc1",
}

_JS = """
(function () {
  var data = JSON.parse(document.getElementById('trace-data').textContent);
  var colors = JSON.parse(document.getElementById('trace-colors').textContent);
  var box = document.getElementById('timeline');
  var spans = data.traceEvents.filter(function (e) { return e.ph === 'X'; });
  var names = {};
  data.traceEvents.forEach(function (e) {
    if (e.ph === 'M' && e.name === 'thread_name') { names[e.tid] = e.args.name; }
  });
  if (!spans.length) {
    box.textContent = 'No build timeline recorded yet (run epbuild build).';
  } else {
    var lanes = Array.from(new Set(spans.map(function (e) { return e.tid; })))
      .sort(function (a, b) { return a - b; });
    var end = Math.max.apply(null, spans.map(function (e) { return e.ts + e.dur; })) || 1;
    var W = Math.max(box.clientWidth || 900, 600) - 2, left = 90, lh = 22;
    var scale = (W - left - 10) / end;
    var ns = 'http://www.w3.org/2000/svg';
    var svg = document.createElementNS(ns, 'svg');
    svg.setAttribute('width', W);
    svg.setAttribute('height', lanes.length * lh + 24);
    lanes.forEach(function (tid, i) {
      var t = document.createElementNS(ns, 'text');
      t.setAttribute('x', 4); t.setAttribute('y', i * lh + 15);
      t.setAttribute('font-size', '12');
      t.textContent = names[tid] || ('lane ' + tid);
      svg.appendChild(t);
    });
    spans.forEach(function (e) {
      var r = document.createElementNS(ns, 'rect');
      r.setAttribute('x', left + e.ts * scale);
      r.setAttribute('y', lanes.indexOf(e.tid) * lh + 3);
      r.setAttribute('width', Math.max(1, e.dur * scale));
      r.setAttribute('height', lh - 6);
      r.setAttribute('fill', colors[e.cat] || '#555');
      var tip = document.createElementNS(ns, 'title');
      tip.textContent = e.name + ' ' + (e.dur / 1000).toFixed(1) + ' ms';
      r.appendChild(tip);
      svg.appendChild(r);
    });
    var axis = document.createElementNS(ns, 'text');
    axis.setAttribute('x', left); axis.setAttribute('y', lanes.length * lh + 18);
    axis.setAttribute('font-size', '11');
    axis.textContent = '0 s … ' + (end / 1e6).toFixed(2) + ' s';
    svg.appendChild(axis);
    box.appendChild(svg);
  }
  document.documentElement.setAttribute('data-rendered', 'ok');
})();
"""

_ONERROR = """
window.addEventListener('error', function (e) {
  var el = document.documentElement;
  el.setAttribute('data-errors', (el.getAttribute('data-errors') || '') + e.message + ';');
});
"""


def _json_script(element_id: str, data: Any) -> str:
    text = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return f'<script type="application/json" id="{element_id}">{text}</script>'


def _row(d: ActionDetail) -> str:
    e = html.escape
    if not d.built:
        state = '<span class="never">never built</span>'
        cells = ["—"] * 6
    else:
        state = (
            '<span class="stale">stale</span>' if d.stale else '<span class="ok">up to date</span>'
        )
        ctx = sum(s for p, s in d.files.items() if p.endswith(CTX_SUFFIX))
        compiled = sum(m.context_nodes for m in d.models)
        source = sum(m.source_nodes for m in d.models)
        cpu = sum(m.cpu_nodes for m in d.models)
        ops = ", ".join(
            f"{e(op)} x{n}" for m in d.models for op, n in sorted(m.cpu_op_types.items())
        )
        cells = [
            "—" if d.restored else f"{d.seconds:.2f}",
            format_bytes(d.peak_rss) if d.peak_rss else "—",
            f"{format_bytes(d.binary_bytes)} <small>bin</small> + "
            f"{format_bytes(ctx)} <small>ctx</small>",
            f"{compiled} EPContext <small>from {source} nodes</small> / {cpu} on CPU"
            + (f" <small>({ops})</small>" if ops else ""),
            '<span class="hit">hit</span>' if d.restored else "miss",
            "<br>".join(
                f"{e(m.name)}: {e(numerics_summary(m.numerics))}"
                + _layers_svg(m.numerics.get("layers") or [])
                for m in d.models
                if m.numerics is not None
            )
            or "—",
        ]
    how = "" if not d.built else (" (restored)" if d.restored else " (compiled)")
    if d.built and d.compiler:
        how += f" <small>{e(COMPILER_NAMES.get(d.compiler, d.compiler))}</small>"
    return (
        f"<tr><td>{e(d.id)}</td><td>{state}{how}</td>"
        + "".join(
            f'<td class="n">{c}</td>' if i < 2 else f"<td>{c}</td>" for i, c in enumerate(cells)
        )
        + "</tr>"
    )


def _layers_svg(layers: list[list[Any]]) -> str:
    """A quantized model's worst layers as bars of their SQNR in dB (0–60 dB wide; drawn
    with lines, the timeline's rects stay the page's only ones)."""
    if not layers:
        return ""
    row, width, label = 16, 180, 200
    parts = []
    for i, (tensor, db) in enumerate(layers):
        y = i * row + row // 2
        length = max(1.0, min(float(db if db is not None else 0.0), 60.0) / 60.0 * width)
        colour = "#c0392b" if (db or 0.0) < 20 else "#2e86c1"
        parts.append(
            f'<text x="0" y="{y + 4}" font-size="11">{html.escape(str(tensor)[:32])}</text>'
            f'<line x1="{label}" y1="{y}" x2="{label + length:.1f}" y2="{y}" '
            f'stroke="{colour}" stroke-width="10"/>'
            f'<text x="{label + length + 4:.1f}" y="{y + 4}" font-size="11">'
            f"{'n/a' if db is None else f'{db:.1f} dB'}</text>"
        )
    height = row * len(layers)
    return (
        f'<br><svg class="layers" xmlns="http://www.w3.org/2000/svg" width="{label + width + 60}" '
        f'height="{height}"><title>SQNR per layer against the float model</title>'
        + "".join(parts)
        + "</svg>"
    )


@dataclass(frozen=True)
class GraphNode:
    """One action in the page's drawing of the build graph."""

    id: str
    kind: str
    deps: tuple[str, ...]
    state: str
    """``up to date``, ``stale`` or ``never built``."""
    made: str
    """How its outputs were last made: ``compiled`` (or the kind's word), ``restored``, or
    empty when never built."""
    seconds: float


_STATE_FILL = {"up to date": "#e3f4e8", "stale": "#fdebd3", "never built": "#eeeeee"}


def graph_svg(nodes: list[GraphNode]) -> str:
    """The build graph as an inline SVG: one column per depth (an action right of what it
    depends on), an arrow per dependency, each box holding the action's id, kind, state and
    last time. Rendered here: readable without JavaScript."""
    e = html.escape
    if not nodes:
        return "<p>No actions.</p>"
    depth: dict[str, int] = {}
    for n in nodes:  # graph order: dependencies first
        depth[n.id] = 1 + max((depth.get(d, -1) for d in n.deps), default=-1)
    rows: dict[int, int] = {}
    place: dict[str, tuple[int, int]] = {}
    w, h, gap_x, gap_y = 230, 54, 60, 14
    for n in nodes:
        col = depth[n.id]
        row = rows.get(col, 0)
        rows[col] = row + 1
        place[n.id] = (10 + col * (w + gap_x), 10 + row * (h + gap_y))
    width = 20 + (max(depth.values()) + 1) * (w + gap_x) - gap_x
    height = 20 + max(rows.values()) * (h + gap_y) - gap_y
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-size="12" font-family="system-ui,sans-serif">',
        '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="8" '
        'markerHeight="8" orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#888"/></marker></defs>',
    ]
    for n in nodes:
        x, y = place[n.id]
        for d in n.deps:
            if d in place:
                dx, dy = place[d]
                parts.append(
                    f'<line x1="{dx + w}" y1="{dy + h // 2}" x2="{x}" y2="{y + h // 2}" '
                    'stroke="#888" marker-end="url(#arrow)"/>'
                )
    for n in nodes:
        x, y = place[n.id]
        made = f"{n.made} in {n.seconds:.2f} s" if n.made else ""
        parts.append(
            f'<g class="node" data-id="{e(n.id)}"><polygon points="{x},{y} {x + w},{y} '
            f'{x + w},{y + h} {x},{y + h}" fill="{_STATE_FILL.get(n.state, "#fff")}" '
            'stroke="#999"/>'
            f'<text x="{x + 6}" y="{y + 16}" font-weight="600">{e(n.id)}</text>'
            f'<text x="{x + 6}" y="{y + 32}">{e(n.kind)} · {e(n.state)}</text>'
            f'<text x="{x + 6}" y="{y + 47}" fill="#555">{e(made)}</text>'
            f"<title>{e(n.id)}</title></g>"
        )
    parts.append("</svg>")
    return "".join(parts)


def render_html(
    details: list[ActionDetail],
    trace: dict[str, Any] | None,
    title: str,
    graph: list[GraphNode] | None = None,
) -> str:
    """The page, as one string with its CSS, data and script inline."""
    trace = trace or {"traceEvents": []}
    legend = "".join(f'<span><i style="background:{_COLORS[k]}"></i>{k}</span>' for k in KINDS)
    rows = "\n".join(_row(d) for d in details)
    built = sum(1 for d in details if d.built)
    hits = sum(1 for d in details if d.restored)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; \
style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>epbuild report: {html.escape(title)}</title>
<script>{_ONERROR}</script>
<style>{_CSS}</style></head>
<body>
<h1>epbuild report</h1>
<div class="sub">{html.escape(title)} · {len(details)} action(s), {built} built, \
{hits} from the cache</div>
<h2>Build graph</h2>
<div id="graph">{graph_svg(graph or [])}</div>
<h2>Last build</h2>
<div class="legend">{legend}</div>
<div id="timeline"></div>
<h2>Actions</h2>
<table>
<thead><tr><th>action</th><th>outcome</th><th>compile s</th><th>peak memory</th>
<th>binary sizes</th><th>nodes compiled / on CPU</th><th>cache</th>
<th>numerics (last verify --numerics)</th></tr></thead>
<tbody>
{rows}
</tbody></table>
{_json_script("trace-data", trace)}
{_json_script("trace-colors", _COLORS)}
<script>{_JS}</script>
</body></html>
"""


def write_html_report(
    directory: str | os.PathLike[str],
    manifest: str | os.PathLike[str] | None,
    selectors: list[str] | tuple[str, ...],
    path: str | os.PathLike[str],
) -> int:
    """Write the report page to ``path``; returns how many actions it lists."""
    ws = open_workspace(directory, manifest, selectors)
    details = status_detail(directory, manifest, selectors)
    trace = load_trace(os.path.join(ws.state_dir, TRACE_NAME))
    page = render_html(details, trace, os.path.basename(ws.root), _graph_nodes(ws))
    atomic_write_bytes(os.fspath(path), page.encode("utf-8"), leftovers=True)
    return len(details)


def _graph_nodes(ws: Workspace) -> list[GraphNode]:
    """Every selected action of the graph as the page draws it."""
    nodes = []
    for plan in make_plan(ws.graph, ws.state, ws.keys, ws.stats, ws.root):
        a = plan.action
        rec = ws.state.records.get(a.id)
        state = "never built" if rec is None else "stale" if plan.stale else "up to date"
        made = "" if rec is None else "restored" if rec.restored else kind_of(a).words.past
        seconds = rec.seconds if rec is not None else 0.0
        nodes.append(GraphNode(a.id, a.kind, a.deps, state, made, seconds))
    return nodes
