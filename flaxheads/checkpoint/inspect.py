"""Looking at checkpoints: verify a step's files, list a run's steps, and print both readably
(the ``flaxheads checkpoints`` command)."""

from __future__ import annotations

import json
import os

import numpy as np

from flaxheads.checkpoint import io, kinds
from flaxheads.checkpoint.meta import (
    ARRAY_ITEMS,
    JSON_ITEMS,
    META,
    OWN_KEYS,
    STEP,
    CheckpointError,
    CheckpointNotFoundError,
)
from flaxheads.disk import checksums
from flaxheads.disk.preflight import folder_bytes
from flaxheads.errors import UsageError


def _written_items(mgr, root: str, step: int) -> list[str]:
    """The array items the save of ``step`` wrote (from its metadata), or whose folders are there."""
    d = os.path.join(root, str(step))
    try:
        with open(os.path.join(d, "_CHECKPOINT_METADATA")) as f:
            written = set(json.load(f).get("item_handlers") or {})
    except Exception as e:
        raise io.corrupt(root, step, "metadata", mgr.all_steps(), e) from e
    return [x for x in ARRAY_ITEMS if x in written or os.path.isdir(os.path.join(d, x))]


def _verify_step(mgr, root: str, step: int) -> None:
    """Read every array of every item of ``step`` (onto the first device); raises
    :class:`CorruptCheckpointError` on the first unreadable item."""
    items = _written_items(mgr, root, step)
    for item in items:
        io.require_item(mgr, root, step, item)
    for item, target in io.item_targets(mgr, root, step, items).items():
        io.restore_arrays(mgr, root, step, {item: target})
    for item in JSON_ITEMS:
        io.read_json(mgr, root, step, item)


def verify_checkpoint(directory: str | os.PathLike, step: int | str | None = None) -> int:
    """Read every file of a checkpoint step; returns the step, or raises
    :class:`CorruptCheckpointError` naming the damaged item and the earlier steps."""
    with io.open_step(directory, step) as (mgr, root, step):
        _verify_step(mgr, root, step)
        return step


def _step_row(mgr, root: str, step: int, latest: bool, verify: bool) -> tuple[dict, tuple[str, str] | None]:
    """One listing row, and the (best_metric, mode) the step was saved with, if any."""
    d = os.path.join(root, str(step))
    items = sorted(x for x in os.listdir(d) if os.path.isdir(os.path.join(d, x)) and x in ARRAY_ITEMS + JSON_ITEMS)
    row = {
        "step": step,
        "path": d,
        "items": items,
        "bytes": folder_bytes([d]),
        "latest": latest,
        "metrics": None,
        "best": False,
        "status": "ok",
    }
    best_by = None
    try:
        info = io.read_json(mgr, root, step, STEP)
        row["metrics"] = info.get("metrics")
        if info.get("best_metric"):
            best_by = (info["best_metric"], info.get("mode", "max"))
        io.read_json(mgr, root, step, META)
        if verify:
            with checksums.full():
                io.check_step(mgr, root, step)
            _verify_step(mgr, root, step)
    except CheckpointError as e:
        row["status"] = f"corrupt: {str(e)[:120]}"
    return row, best_by


def _unfinished_rows(root: str) -> list[dict]:
    return [
        {
            "step": None,
            "path": os.path.join(root, name),
            "items": [],
            "bytes": folder_bytes([os.path.join(root, name)]),
            "latest": False,
            "best": False,
            "metrics": None,
            "status": "incomplete (unfinished save; ignored)",
        }
        for name in sorted(os.listdir(root))
        if ".orbax-checkpoint-tmp" in name
    ]


def verify_model_folder(path: str | os.PathLike) -> str:
    """Check every byte of a model or export folder: against its recorded checksums, or (a folder
    written elsewhere) each safetensors header's bounds and every tensor for NaN / Inf. Returns one
    line saying what was checked; :class:`~flaxheads.disk.checksums.ChecksumError` names a damaged file."""
    how, n = checksums.verify_any(path)
    if how == "checksums":
        return f"{path}: ok, {n} files match the SHA-256 recorded when flaxheads wrote them"
    if n == 0:
        return f"{path}: no recorded checksums and no safetensors file: nothing to check"
    return f"{path}: ok, {n} safetensors files (no checksums recorded): headers in bounds, every tensor finite"


def list_checkpoints(directory: str | os.PathLike, *, verify: bool = False) -> list[dict]:
    """One dict per step folder of a run: step, items, metrics, size, latest/best flags,
    and ``status`` ("ok", or what is wrong); unfinished saves show as ``"incomplete"``.
    The JSON items are always read and the files checked against their checksums (sampled);
    ``verify=True`` reads every array and hashes every byte."""
    root, _ = io.resolve_root(directory)
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"checkpoint folder {root} does not exist")
    kind = kinds.folder_kind(directory)
    if kind not in (None, kinds.FolderKind.RUN):
        raise UsageError(
            f"{os.fspath(directory)} is {kind.described}, not a run: `flaxheads checkpoints` lists a "
            "run's checkpoint steps (pass a run folder, its checkpoints/ folder or one step's folder); "
            "add --verify to check this folder's files instead"
        )
    mgr = io.manager(root, read_only=True)
    try:
        steps = sorted(mgr.all_steps())
        rows, best_by = [], None
        for s in steps:
            row, by = _step_row(mgr, root, s, s == steps[-1], verify)
            rows.append(row)
            best_by = by or best_by
        if best_by is not None:
            name, mode = best_by
            best = io.pick_best(
                [(float(r["metrics"][name]), r["step"]) for r in rows if r["metrics"] and name in r["metrics"]], mode
            )
            for r in rows:
                r["best"] = r["step"] == best
        return rows + _unfinished_rows(root)
    finally:
        mgr.close()


def _one_line(cfg) -> str:
    if not isinstance(cfg, dict):
        return str(cfg)
    kind = cfg.get("type", "?")
    rest = ", ".join(f"{k}={_one_line(v) if isinstance(v, dict) else v}" for k, v in cfg.items() if k != "type")
    return f"{kind}({rest})"


def _extra_lines(meta: dict) -> list[str]:
    """Lines for the keys flaxheads does not write itself (e.g. the train program's run settings)."""
    lines = []
    for k in sorted(set(meta) - OWN_KEYS):
        v = meta[k]
        if isinstance(v, dict):
            lines.append(f"{k}:")
            for sub, val in v.items():
                text = (
                    ", ".join(f"{a}={json.dumps(b)}" for a, b in val.items())
                    if isinstance(val, dict)
                    else json.dumps(val)
                )
                lines.append(f"  {sub + ':':<14}{text}")
        else:
            lines.append(f"{k + ':':<13} {json.dumps(v)}")
    return lines


def format_meta(meta: dict) -> str:
    """A readable multi-line summary of a head checkpoint's meta."""
    hc = meta.get("head_config", {})
    lines = [
        f"flaxheads {meta.get('library_version')} checkpoint ({meta.get('format')}), written {meta.get('created')}",
        f"backbone:     {meta.get('backbone_model_type')} {meta.get('backbone_name_or_path')!r} "
        f"(hidden_size={meta.get('hidden_size')}, dtype={meta.get('dtype')}, "
        f"{'saved in this checkpoint' if meta.get('backbone_saved') else 'referenced, not saved'})",
        f"pooler:       {_one_line(hc.get('pooler'))}",
        f"head:         {_one_line(hc.get('head'))}",
        f"pool mask:    {meta.get('pool_mask')} (pad_token_id={meta.get('pad_token_id')}, "
        f"eos_token_id={meta.get('eos_token_id')})",
        f"HF preset:    {meta.get('arch') or '-'}",
        f"problem:      {meta.get('problem_type')}, num_labels={meta.get('num_labels')}",
    ]
    lora = meta.get("lora")
    if lora:
        lines.append(
            f"LoRA:         rank {lora.get('rank')}, alpha {lora.get('alpha')}, targets "
            f"{','.join(lora.get('targets') or [])} ({len(lora.get('modules') or {})} kernels)"
        )
    labels = sorted((meta.get("id2label") or {}).items(), key=lambda kv: int(kv[0]))
    if labels:
        lines.append("labels:       " + ", ".join(f"{k}={v}" for k, v in labels))
    shapes = meta.get("head_shapes", {})
    n = sum(int(np.prod(s)) for s, _ in shapes.values())
    lines.append(
        f"head params:  {n:,} in {len(shapes)} arrays, dtype {meta.get('param_dtype')}, "
        f"shapes hash {meta.get('head_shapes_hash')}"
    )
    lines += [f"  {p:<32} {str(tuple(s)):<14} {dt}" for p, (s, dt) in sorted(shapes.items())]
    return "\n".join(lines + _extra_lines(meta))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_listing(rows: list[dict]) -> str:
    """The rows of :func:`list_checkpoints` as a table."""
    if not rows:
        return "no checkpoints"
    out = [f"{'step':>8}  {'items':<40} {'size':>10}  {'metrics':<28} flags"]
    for r in rows:
        flags = ",".join(f for f, on in (("latest", r["latest"]), ("best", r["best"])) if on)
        if r["status"] != "ok":
            flags = (flags + " " if flags else "") + r["status"]
        m = ", ".join(f"{k}={v:.4g}" for k, v in (r["metrics"] or {}).items())
        step = "-" if r["step"] is None else str(r["step"])
        out.append(f"{step:>8}  {','.join(r['items']):<40} {_human(r['bytes']):>10}  {m:<28} {flags}")
    return "\n".join(out)
