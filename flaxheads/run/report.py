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

import json
import shlex
from pathlib import Path

from flaxheads.data.objects import is_description
from flaxheads.run.report_html import SCRIPT, STYLE, _e, _kv, _num, _section, _table, curves, fmt

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
    # a run trained on in-memory tables resumes only when they are passed again (the spec holds their description)
    data = (config.get("spec") or {}).get("data") or {}
    given = {k: v["object"] for k, v in data.items() if is_description(v)}
    again = "".join(f", {k.removesuffix('_file')}=<the same {kind}>" for k, kind in given.items())
    out = (
        f"<p>checkpoints: {', '.join(map(str, steps)) or 'none'} in <code>{_e(root)}</code></p>"
        f"<p>Resume or extend (the same spec; it continues from the latest checkpoint"
        + ("; pass the same in-memory data again" if given else "")
        + "):</p>"
        f'<pre>python -c "import flaxheads as fh; fh.train(fh.RunSpec.from_run({_e(repr(str(run)))}){_e(again)})"</pre>'
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
