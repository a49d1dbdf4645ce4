"""Checks a command makes before it loads a model or compiles anything: every folder and file it will
write can be written, and the disk has room for what it writes. Finding out after an hour of
training that the checkpoint folder is read-only or full loses the hour.

Sizes are estimated from the parameter shapes in the weights' file headers (nothing is loaded):
a checkpoint of a fine-tuned model holds the float32 params and Adam's two moments of each."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable

from flaxheads.disk.files import MARKER, has_marker
from flaxheads.errors import UsageError

#: Room kept beyond an estimate: run-folder files, logs, plots, and the estimate's slack.
MARGIN_BYTES = 32 * 2**20
MARGIN_SHARE = 0.10
#: Bytes per parameter of a fine-tuning checkpoint: float32 params + AdamW's first and second moments.
TRAIN_STATE_BYTES_PER_PARAM = 12
#: Folders of saved arrays in a flaxheads checkpoint step that hold params (not optimizer state).
PARAM_ITEMS = ("head", "backbone", "lora")


class PreflightError(UsageError):
    """A path the command will write that cannot be written, or a disk without room for it."""


def disk_free(path: str) -> int:
    """Free bytes for this user on the filesystem of ``path`` (an existing path)."""
    return shutil.disk_usage(path).free


def _existing_ancestor(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _probe(folder: str) -> OSError | None:
    """The error creating a file in ``folder`` gives (None: it can be written). ``os.access`` alone
    misses read-only mounts for root and quotas."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".flaxheads-write-check-"):
            return None
    except OSError as e:
        return e


def _why(e: OSError) -> str:
    return {
        errno.EROFS: "the filesystem is read-only",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exhausted",
    }.get(e.errno or 0, e.strerror or type(e).__name__)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def check_folder(path: str | os.PathLike, *, what: str, need_bytes: int = 0) -> None:
    """``path`` is a folder (or can be made one) this process can write, on a disk with
    ``need_bytes`` free; else :class:`PreflightError` naming ``what`` (the flag) and the cause."""
    path = os.fspath(path)
    base = _existing_ancestor(path)
    if not os.path.isdir(base):
        where = "is a file" if base == os.path.abspath(path) else f"is inside {base!r}, which is a file"
        raise PreflightError(f"{what} {path!r} {where}, not a folder: choose a folder path")
    _check_writable(base, path, what)
    _check_room(base, path, what, need_bytes)


def check_file(path: str | os.PathLike, *, what: str) -> None:
    """``path`` is a file this process can create or replace (its folder exists or can be made)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise PreflightError(f"{what} {path!r} is a folder; name a file")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise PreflightError(f"{what} {path!r} cannot be replaced: permission denied")
    check_folder(os.path.dirname(os.path.abspath(path)), what=f"{what}'s folder")


def _check_writable(base: str, path: str, what: str) -> None:
    e = _probe(base)
    if e is not None:
        inside = "" if base == os.path.abspath(path) else f" (in {base!r})"
        raise PreflightError(
            f"{what} {path!r} cannot be written{inside}: {_why(e)}; choose another folder or fix its permissions"
        )


def _check_room(base: str, path: str, what: str, need: int) -> None:
    if need <= 0:
        return
    free = disk_free(base)
    if free < need:
        raise PreflightError(
            f"{what} {path!r}: {_size(free)} free on its disk, and this command needs about "
            f"{_size(need)} (estimated from the model's parameter shapes); free some space or "
            "choose another disk"
        )


# ---- sizes --------------------------------------------------------------------------------------


def _safetensors_elements(path: str) -> int:
    """Parameters in a safetensors file, from its JSON header (8-byte length, then the header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 * 2**20:
            raise ValueError("header too large")
        header = json.loads(f.read(n))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def weight_elements(folder: str | os.PathLike) -> int | None:
    """Parameters in an HF model folder's weights, read from the safetensors headers (a
    ``pytorch_model.bin`` counts as float32 by its size); None where there is nothing to read."""
    folder = os.fspath(folder)
    try:
        single = os.path.join(folder, "model.safetensors")
        if os.path.isfile(single):
            return _safetensors_elements(single)
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return sum(_safetensors_elements(os.path.join(folder, s)) for s in shards)
        bins = [
            os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("pytorch_model") and n.endswith(".bin")
        ]
        return sum(os.path.getsize(b) for b in bins) // 4 or None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a broken folder is reported by the loader, with its own message


def with_margin(n: float) -> int:
    return int(n * (1 + MARGIN_SHARE)) + MARGIN_BYTES


def folder_bytes(paths: Iterable[str]) -> int:
    """Bytes of the files under ``paths`` (missing ones count 0)."""
    total = 0
    for p in paths:
        for root, _, files in os.walk(p):
            for name in files:
                try:
                    total += os.path.getsize(os.path.join(root, name))
                except OSError:
                    pass
    return total


def checkpoints_bytes(
    params: int | None, *, trains_backbone: bool, keep: int, keep_best: bool, existing: int = 0
) -> int:
    """Disk a run's checkpoints need beyond the ``existing`` bytes of its checkpoint folder: ``keep``
    latest steps, the best one, and the one being written before the oldest is deleted. A frozen
    backbone (or LoRA) saves the head alone: only the margin."""
    per = TRAIN_STATE_BYTES_PER_PARAM * (params or 0) if trains_backbone else 0
    total = per * (keep + int(keep_best) + 1)
    return with_margin(max(total - existing, per))


#: The files a run writes into its folder (besides checkpoints/), replaced when it runs again.
RUN_OUTPUTS = (
    "config.json",
    "metrics.jsonl",
    "eval.txt",
    "summary.json",
    "predictions.npz",
    "curve.png",
    "confusion_matrix.png",
    "sweep.md",
)


def check_run_folder(
    out: str | os.PathLike,
    model_path: str | os.PathLike,
    *,
    trains_backbone: bool,
    keep: int,
    keep_best: bool,
    checkpoints: bool,
) -> None:
    """``train``'s run folder: writable, with room for its checkpoints (``checkpoints=False``: the
    run saves none, only its small result files)."""
    _check_own_folder(out)
    ckpts = os.path.join(os.fspath(out), "checkpoints")
    existing = folder_bytes([ckpts])
    need = (
        checkpoints_bytes(
            weight_elements(model_path),
            trains_backbone=trains_backbone,
            keep=keep,
            keep_best=keep_best,
            existing=existing,
        )
        if checkpoints
        else with_margin(0)
    )
    check_folder(out, what="--output-dir", need_bytes=need)
    # a resumed run writes into what is already there: a read-only checkpoints/ (another mount, another
    # owner) would fail at the first save, after the compute; a read-only result file at the end
    if checkpoints and os.path.lexists(ckpts):
        check_folder(ckpts, what="--output-dir's checkpoints folder", need_bytes=need)
    for name in RUN_OUTPUTS:
        if os.path.lexists(os.path.join(os.fspath(out), name)):
            check_file(os.path.join(os.fspath(out), name), what=f"--output-dir's {name}")


def export_bytes(src: str | os.PathLike, backbone: str | os.PathLike | None = None) -> int:
    """About what an export of ``src`` writes: its params in float32. ``src`` is a model folder, or
    a run / checkpoint folder (its latest step's param items, and the backbone folder its run
    config names when the backbone was frozen and not saved)."""
    src = os.fspath(src)
    root = os.path.join(src, "checkpoints") if os.path.isdir(os.path.join(src, "checkpoints")) else src
    steps = sorted(int(n) for n in os.listdir(root) if n.isdigit()) if os.path.isdir(root) else []
    if os.path.basename(os.path.abspath(src)).isdigit() and os.path.isdir(os.path.join(src, "meta")):
        step_dir = src
    elif steps:
        step_dir = os.path.join(root, str(steps[-1]))
    else:
        return 4 * (weight_elements(src) or 0)
    total = folder_bytes(os.path.join(step_dir, item) for item in PARAM_ITEMS)
    if not os.path.isdir(os.path.join(step_dir, "backbone")):
        total += 4 * (weight_elements(backbone or _run_model(src) or "") or 0)
    return total


def _run_model(src: str) -> str | None:
    """The model folder a run's ``config.json`` names (None when unknown)."""
    try:
        with open(os.path.join(src, "config.json")) as f:
            model = json.load(f).get("model")
    except (OSError, ValueError, AttributeError):
        return None
    return model if isinstance(model, str) and os.path.isdir(model) else None


#: Files only a flaxheads run folder has (folders written before the marker existed are recognised by them).
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json")


def _check_own_folder(out: str | os.PathLike) -> None:
    """A run writes ``config.json`` and more into ``--output-dir``: an existing folder must be
    empty or a flaxheads run folder (its marker, or a run's own files), never one of the user's."""
    out = os.fspath(out)
    if not os.path.isdir(out) or not os.listdir(out) or has_marker(out):
        return
    if any(os.path.exists(os.path.join(out, f)) for f in RUN_FILES):
        return
    raise PreflightError(
        f"--output-dir {out!r} holds files that are not a flaxheads run (no {MARKER} marker), and "
        "a run would write config.json and more among them: choose a new or empty folder"
    )
