"""The pieces of ``report.html`` that know no run: escaping and number formatting, tables and
sections, the inline SVG curves, and the page's inline styles and script. What each section shows
of a run folder is :mod:`flaxheads.run.report`'s.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable
from typing import Any


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def fmt(v: Any) -> str:
    """How the page shows a number (4 significant digits; integers as they are)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _e(v)
    if isinstance(v, int):
        return f"{v:,}"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"


def _num(key: str, v: Any) -> str:
    return f'<td class="num" data-key="{_e(key)}" data-value="{_e(json.dumps(v))}">{fmt(v)}</td>'


def _table(head: Iterable[str], rows: Iterable[Iterable[str]], cls: str = "") -> str:
    h = "".join(f"<th>{_e(x)}</th>" for x in head)
    body = "".join("<tr>" + "".join(r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def _section(title: str, body: str, sid: str) -> str:
    return f'<section id="{sid}"><h2>{_e(title)}</h2>{body}</section>'


def _kv(d: dict) -> str:
    def cell(v):
        return f"<td><code>{_e(json.dumps(v) if isinstance(v, (dict, list)) else v)}</code></td>"

    return _table(["setting", "value"], [[f"<th>{_e(k)}</th>", cell(v)] for k, v in d.items()], "kv")


# ---- curves -----------------------------------------------------------------------------------

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def svg_curve(
    series: dict[str, list[tuple[float, float]]], *, title: str, ylabel: str, width: int = 640, height: int = 260
) -> str:
    """Inline SVG lines of ``{name: [(step, value), ...]}`` with axes, ticks and a legend; each point
    has a tooltip (``<title>``)."""
    pts = [(x, y) for s in series.values() for x, y in s if math.isfinite(y)]
    if not pts:
        return f'<p class="muted">{_e(title)}: nothing logged yet.</p>'
    left, right, top, bottom = 60, 150, 24, 36
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)
    w, h = width - left - right, height - top - bottom

    def sx(x):
        return left + (x - x0) / (x1 - x0) * w

    def sy(y):
        return top + (1 - (y - y0) / (y1 - y0)) * h

    out = [
        f'<svg class="curve" role="img" aria-label="{_e(title)}" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}">',
        f'<text x="{left}" y="15" class="ttl">{_e(title)}</text>',
        f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" class="axis"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" class="axis"/>',
    ]
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{left - 6}" y="{sy(yv) + 4:.1f}" class="tick" text-anchor="end">{fmt(yv)}</text>')
    for xv in sorted({round(x0 + (x1 - x0) * i / 4) for i in range(5)}):  # whole steps, each once
        out.append(f'<text x="{sx(xv):.1f}" y="{top + h + 16}" class="tick" text-anchor="middle">{xv}</text>')
    out.append(f'<text x="{left + w / 2}" y="{height - 4}" class="tick" text-anchor="middle">step</text>')
    out.append(
        f'<text x="12" y="{top + h / 2}" class="tick" transform="rotate(-90 12 {top + h / 2})" '
        f'text-anchor="middle">{_e(ylabel)}</text>'
    )
    for i, (name, s) in enumerate(series.items()):
        s = [(x, y) for x, y in s if math.isfinite(y)]
        if not s:
            continue
        color = PALETTE[i % len(PALETTE)]
        d = " ".join(f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(s))
        out.append(
            f'<g class="series" data-series="{_e(name)}"><path d="{d}" stroke="{color}" fill="none" '
            f'stroke-width="1.8"/>'
        )
        out += [
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"><title>{_e(name)} at step '
            f"{x:.0f}: {fmt(y)}</title></circle>"
            for x, y in s
        ]
        out.append("</g>")
        ly = top + 14 * i + 6
        out.append(
            f'<g class="legend" data-series="{_e(name)}"><rect x="{left + w + 10}" y="{ly - 8}" width="10" '
            f'height="10" fill="{color}"/><text x="{left + w + 24}" y="{ly + 1}" class="tick">{_e(name)}'
            "</text></g>"
        )
    out.append("</svg>")
    return "".join(out)


def curves(log: list[dict], metric: str | None) -> str:
    train = [e for e in log if "loss" in e and "eval" not in e and "final" not in e]
    evals = [e for e in log if "eval" in e]
    parts = [
        svg_curve(
            {"train loss": [(e["step"], e["loss"]) for e in train]},
            title="training loss (mean since the last log line)",
            ylabel="loss",
        )
    ]
    metrics = sorted({k for e in evals for r in e["eval"].values() for k in r})
    show: list[str] = [metric] if metric is not None and metric in metrics else metrics[:3]
    if evals:
        parts.append(
            svg_curve(
                {
                    f"{split} {k}": [(e["step"], e["eval"][split][k]) for e in evals if k in e["eval"].get(split, {})]
                    for split in sorted({s for e in evals for s in e["eval"]})
                    for k in show
                },
                title="evaluation",
                ylabel=", ".join(show),
            )
        )
    if any("tokens_per_s" in e for e in train):
        parts.append(
            svg_curve(
                {"tokens/s": [(e["step"], e["tokens_per_s"]) for e in train if "tokens_per_s" in e]},
                title="throughput (token slots per second)",
                ylabel="tokens/s",
            )
        )
    return "".join(parts)


STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1b1f24;background:#f6f7f9}
header{background:#1b2a3a;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;color:#c9d3de}main{padding:8px 24px 40px;max-width:1100px}
section{background:#fff;border:1px solid #dde2e8;border-radius:6px;padding:10px 16px;margin:14px 0}
h2{font-size:16px;margin:4px 0 8px}h3{font-size:14px;margin:12px 0 6px}
table{border-collapse:collapse;margin:4px 0}th,td{border-bottom:1px solid #e6e9ee;padding:3px 10px;text-align:left;
vertical-align:top}td.num{text-align:right;font-variant-numeric:tabular-nums}table.worst td{max-width:560px}
.muted{color:#5e6b78}pre{background:#f0f2f5;padding:8px;overflow:auto}code{font-size:12px}
svg.curve{display:block;margin:6px 0}svg .axis{stroke:#888}svg .tick{font-size:11px;fill:#445}
svg .ttl{font-size:13px;font-weight:600;fill:#223}svg .legend{cursor:pointer}svg .off{opacity:.15}
nav a{color:#c9d3de;margin-right:12px;font-size:13px}
"""

#: Legend entries toggle their series; clicking a table header sorts it. No network, no libraries.
SCRIPT = """
document.querySelectorAll('svg.curve').forEach(function(svg){
  svg.querySelectorAll('g.legend').forEach(function(g){
    g.addEventListener('click',function(){
      svg.querySelectorAll('g.series').forEach(function(s){
        if(s.dataset.series===g.dataset.series){s.classList.toggle('off');}});});});});
document.querySelectorAll('table').forEach(function(t){
  t.querySelectorAll('thead th').forEach(function(th,i){th.addEventListener('click',function(){
    var rows=Array.prototype.slice.call(t.tBodies[0].rows);
    var key=function(r){var c=r.cells[i];if(!c)return '';var v=c.dataset.value;
      return v!==undefined?parseFloat(v):c.textContent;};
    rows.sort(function(a,b){var x=key(a),y=key(b);return x<y?-1:x>y?1:0;});
    rows.forEach(function(r){t.tBodies[0].appendChild(r);});});});});
document.body.dataset.ready='1';
"""
