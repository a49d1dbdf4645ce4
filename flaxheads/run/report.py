"""``report.html``: one self-contained page of a run folder, written at each evaluation and at the end,
and rebuilt for any run folder by :func:`write_report` (``flaxheads report RUN``).

It reads only the folder's own files (``config.json``, ``metrics.jsonl``, ``summary.json``,
``evaluation.json``, ``worst_examples.json``, ``checkpoints/``, ``profile/``) and holds everything
it shows: styles and its one small script are inline, the curves are inline SVG, and it names no
address on the network, so it opens from disk with the browser offline. Every number that comes
from ``summary.json`` carries it exactly in a ``data-value`` attribute (``data-key`` names it:
``metrics/<split>/<metric>``, ``throughput/<key>``), so a test can hold the page to the summary.
"""

from __future__ import annotations

import html
import json
import math
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPORT = "report.html"


def _read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _read_log(path: Path) -> list[dict]:
    out: list[dict] = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by an interruption
    return out


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


# ---- sections ---------------------------------------------------------------------------------


def _metrics_section(summary: dict | None, live: dict | None) -> str:
    if summary and summary.get("metrics"):
        results, key = summary["metrics"], "metrics"
        note = "final metrics (summary.json)"
    elif live:
        results, key = {n: {k: v for k, v in r.items() if isinstance(v, (int, float))} for n, r in live.items()}, "live"
        note = "latest evaluation (the run is still training)"
    else:
        return '<p class="muted">No evaluation yet.</p>'
    names = sorted({k for r in results.values() for k in r})
    rows = [
        [f"<th>{_e(k)}</th>"]
        + [_num(f"{key}/{split}/{k}", r[k]) if k in r else "<td></td>" for split, r in results.items()]
        for k in names
    ]
    return f'<p class="muted">{_e(note)}</p>' + _table(["metric", *results], rows, "metrics")


def _per_class_section(evaluation: dict | None, id2name: list[str] | None) -> str:
    if not evaluation:
        return ""
    split, r = next(((s, evaluation[s]) for s in ("test", "validation") if s in evaluation), (None, None))
    if r is None:
        return ""
    parts = []
    name = lambda i: id2name[i] if id2name and i < len(id2name) else str(i)
    if "per_class" in r:
        pc = r["per_class"]
        cols = [k for k in ("precision", "recall", "f1", "support") if k in pc]
        rows = [
            [f"<th>{_e(name(i))}</th>"] + [_num(f"per_class/{split}/{name(i)}/{c}", pc[c][i]) for c in cols]
            for i in range(len(pc[cols[0]]))
        ]
        parts.append(f"<h3>per class ({_e(split)})</h3>" + _table(["class", *cols], rows))
    if "per_label_f1" in r:
        rows = [
            [f"<th>{_e(name(i))}</th>", _num(f"per_label_f1/{split}/{name(i)}", v)]
            for i, v in enumerate(r["per_label_f1"])
        ]
        parts.append(
            f"<h3>per label ({_e(split)}, threshold {fmt(r.get('threshold'))})</h3>" + _table(["label", "f1"], rows)
        )
    if "confusion_matrix" in r:
        cm = r["confusion_matrix"]
        top = max((max(row) for row in cm), default=1) or 1
        rows = [
            [f"<th>{_e(name(i))}</th>"]
            + [
                f'<td class="num cm" style="background:rgba(31,119,180,{0.08 + 0.8 * v / top:.2f})">{v}</td>'
                for v in row
            ]
            for i, row in enumerate(cm)
        ]
        parts.append(
            f"<h3>confusion matrix ({_e(split)}: rows true, columns predicted)</h3>"
            + _table(["true \\ predicted", *[name(i) for i in range(len(cm))]], rows, "cm")
        )
    return "".join(parts)


def _worst_section(worst: dict | None) -> str:
    if not worst or not worst.get("rows"):
        return ""
    cols = worst["columns"]
    rows = [
        [f"<td>{_e(r.get(c, ''))}</td>" if c == "text" else f"<td>{fmt(r.get(c, ''))}</td>" for c in cols]
        for r in worst["rows"]
    ]
    return f'<p class="muted">{_e(worst["note"])}</p>' + _table(cols, rows, "worst")


def _data_section(config: dict) -> str:
    sizes = config.get("sizes") or {}
    counts = config.get("label_counts") or {}
    out = _table(["split", "rows"], [[f"<th>{_e(n)}</th>", _num(f"sizes/{n}", v)] for n, v in sizes.items()])
    if counts:
        labels = sorted({k for c in counts.values() for k in c}, key=str)
        rows = [
            [f"<th>{_e(lab)}</th>"] + [f'<td class="num">{fmt(counts[s].get(lab, 0))}</td>' for s in counts]
            for lab in labels
        ]
        out += "<h3>label counts</h3>" + _table(["label", *counts], rows)
    d = config.get("data") or {}
    src = {k: v for k, v in d.items() if v not in (None, False, [], {})}
    if src:
        out += "<h3>source</h3>" + _kv(src)
    return out


def _kv(d: dict) -> str:
    def cell(v):
        return f"<td><code>{_e(json.dumps(v) if isinstance(v, (dict, list)) else v)}</code></td>"

    return _table(["setting", "value"], [[f"<th>{_e(k)}</th>", cell(v)] for k, v in d.items()], "kv")


def _throughput_section(summary: dict | None, log: list[dict]) -> str:
    t = (summary or {}).get("throughput")
    if not t:
        last = next((e for e in reversed(log) if "tokens_per_s" in e), None)
        if last is None:
            return '<p class="muted">No throughput logged yet.</p>'
        t = {
            k: last[k]
            for k in ("examples_per_s", "tokens_per_s", "step_seconds", "model_tflops_per_s", "mfu")
            if k in last
        }
        note = f"the last log line (step {last['step']})"
    else:
        note = "the run's steps after the first (its compile), evaluations left out (summary.json)"
    rows = [[f"<th>{_e(k)}</th>", _num(f"throughput/{k}", v)] for k, v in t.items()]
    extra = (
        ""
        if "mfu" in t
        else (
            '<p class="muted">MFU is left out: the device\'s peak is not known '
            "(CPUs, or a kind not in flaxheads.training.flops.PEAK_TFLOPS).</p>"
        )
    )
    return f'<p class="muted">{_e(note)}</p>' + _table(["", "value"], rows) + extra


def _memory_section(config: dict, summary: dict | None) -> str:
    rows = {k: config[k] for k in ("compute_plan", "precision", "params", "devices", "buckets") if k in config}
    plan = (summary or {}).get("memory_plan")  # per-device memory of a mesh run's compiled step
    return (_kv(rows) if rows else "") + (f"<pre>{_e(chr(10).join(plan))}</pre>" if plan else "")


def _checkpoint_section(run: Path, config: dict, summary: dict | None) -> str:
    root = run / "checkpoints"
    steps = sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit()) if root.is_dir() else []
    q = shlex.quote(str(run))
    out = (
        f"<p>checkpoints: {', '.join(map(str, steps)) or 'none'} in <code>{_e(root)}</code></p>"
        f"<p>Resume or extend (the same spec; it continues from the latest checkpoint):</p>"
        f'<pre>python -c "import flaxheads as fh; fh.train(fh.RunSpec.from_run({_e(repr(str(run)))}))"</pre>'
        f"<p>Export the trained model, predict with it, rebuild this page:</p>"
        f"<pre>flaxheads export --from {_e(q)} --format transformers --out exported\n"
        f"flaxheads predict {_e(q)} --input new.csv --output predicted.csv\n"
        f"flaxheads report {_e(q)}</pre>"
    )
    return out


def _profile_section(run: Path, summary: dict | None) -> str:
    prof = (summary or {}).get("profile")
    files = sorted(p for p in (run / "profile").glob("plugins/profile/*/*") if p.is_file())
    if not prof and not files:
        return ""
    steps = prof.get("steps") if prof else None
    lis = "".join(f"<li><code>{_e(p.relative_to(run))}</code></li>" for p in files)
    return (
        (f"<p>A jax.profiler trace of steps {_e(steps[0])} to {_e(steps[1])}:</p>" if steps else "")
        + f"<ul>{lis}</ul><p><code>tensorboard --logdir {_e(shlex.quote(str(run)))}</code> (profile tab), or open "
        "the <code>.trace.json.gz</code> in Perfetto.</p>"
    )


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


def render(run: str | Path, *, live: dict | None = None) -> str:
    """The page of run folder ``run`` (``live``: the latest evaluation's results, while training)."""
    run = Path(run)
    config = _read_json(run / "config.json", {}) or {}
    summary = _read_json(run / "summary.json")
    evaluation = _read_json(run / "evaluation.json") or live
    worst = _read_json(run / "worst_examples.json")
    log = _read_log(run / "metrics.jsonl")
    spec = config.get("spec") or {}
    objective = (spec.get("task") or {}).get("objective", "classification")
    task = config.get("problem_type") if objective == "classification" else f"ranking ({objective})"
    metric = _headline(config, objective)
    labels = config.get("labels")
    steps = (summary or {}).get("steps") or max((e.get("step", 0) for e in log), default=0)
    status = (
        f"finished: {steps} steps in {(summary or {}).get('seconds', '?')} s"
        if summary
        else f"training: step {steps} of {_total(config)}"
    )
    sections = [
        _section("Metrics", _metrics_section(summary, live), "metrics"),
        _section(
            "Curves",
            curves(log, metric)
            if log
            else '<p class="muted">metrics.jsonl is missing (report_to without jsonl) or empty.</p>',
            "curves",
        ),
        _section(
            "Per class and confusion matrix" if objective == "classification" else "Ranking metrics",
            _per_class_section(evaluation, labels) or '<p class="muted">See Metrics.</p>',
            "classes",
        ),
        _section(
            "Worst-classified examples",
            _worst_section(worst)
            or '<p class="muted">None recorded (a ranking run, a run without texts in memory, or still training).</p>',
            "worst",
        ),
        _section("Throughput", _throughput_section(summary, log), "throughput"),
        _section("Data", _data_section(config), "data"),
        _section("Memory plan and devices", _memory_section(config, summary), "memory"),
        _section("Checkpoints, resume and export", _checkpoint_section(run, config, summary), "checkpoints"),
        _section(
            "Profile",
            _profile_section(run, summary) or '<p class="muted">No profile (--profile-steps A:B records one).</p>',
            "profile",
        ),
        _section("Spec", _spec_tables(spec), "spec"),
    ]
    nav = "".join(
        f'<a href="#{sid}">{sid}</a>'
        for sid in (
            "metrics",
            "curves",
            "classes",
            "worst",
            "throughput",
            "data",
            "memory",
            "checkpoints",
            "profile",
            "spec",
        )
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width"><title>{_e(run.name)}: flaxheads run</title>'
        f"<style>{STYLE}</style></head><body><header><h1>{_e(run.name)}</h1>"
        f'<p>{_e(config.get("model", "?"))} &middot; {_e(task)} &middot; <span id="status">{_e(status)}</span>'
        f"</p><nav>{nav}</nav></header><main>{''.join(sections)}</main><script>{SCRIPT}</script></body></html>"
    )


def _headline(config: dict, objective: str) -> str | None:
    best = (config.get("checkpoints") or {}).get("best_metric")
    if best and "/" in best:
        return best.split("/", 1)[1]
    return config.get("headline")


def _total(config: dict) -> str:
    t = config.get("train") or {}
    return str(t.get("max_steps") or "?")


def _spec_tables(spec: dict) -> str:
    if not spec:
        return '<p class="muted">config.json records no spec.</p>'
    return "".join(f"<h3>{_e(g)}</h3>" + _kv(v) if isinstance(v, dict) else _kv({g: v}) for g, v in spec.items())


def report_run(run: str | Path) -> Path:
    """Rebuild ``report.html`` of an existing run folder (``flaxheads report RUN``)."""
    run = Path(run)
    if not (run / "config.json").is_file():
        from flaxheads.errors import UsageError

        raise UsageError(
            f"{run} has no config.json: not a flaxheads run folder (give the folder a training run "
            "wrote, e.g. runs/<time>-<data>)"
        )
    return write_report(run)


def write_report(run: str | Path, *, live: dict | None = None) -> Path:
    """Write ``<run>/report.html`` (atomically: a page open in a browser never reads half a file)."""
    run = Path(run)
    page = render(run, live=live)
    tmp = run / (REPORT + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(run / REPORT)
    return run / REPORT
