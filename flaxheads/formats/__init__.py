"""One loader and one exporter for every format: :func:`load` reads anything flaxheads reads (a run
folder or one of its steps, transformers / sentence-transformers / PEFT / head-export folders, hub
ids in the local cache); :func:`export` writes any format; :func:`export_folder` is both, from a
folder to a folder (``flaxheads export``). What a folder is, every reader asks :func:`folder_kind`
(:mod:`flaxheads.checkpoint.kinds`, low enough that :mod:`flaxheads.interop` asks it too).
The per-format functions stay in :mod:`flaxheads.interop`."""

from __future__ import annotations

import os
from typing import Any

from flaxheads.checkpoint.kinds import MODEL_FOLDERS, FolderKind, folder_kind
from flaxheads.checkpoint.models import model_from_checkpoint
from flaxheads.disk.files import MARKER, has_marker
from flaxheads.disk.preflight import check_folder, export_bytes, with_margin
from flaxheads.errors import UsageError
from flaxheads.formats.sources import Loaded, load_source, run_config
from flaxheads.interop import import_model
from flaxheads.interop.cross_encoder import export_cross_encoder
from flaxheads.interop.files import OutputExistsError
from flaxheads.interop.head_files import export_head, load_head_export
from flaxheads.interop.peft import export_peft
from flaxheads.interop.sentence_transformers import export_sentence_transformers
from flaxheads.interop.transformers import export_transformers
from flaxheads.model.sequence import SequenceModel
from flaxheads.runtime import phases

__all__ = ["FORMATS", "load", "export", "export_folder", "load_source", "Loaded", "FolderKind", "folder_kind"]

#: ``format=`` values of :func:`export`.
FORMATS = ("transformers", "sentence-transformers", "head", "onnx", "cross-encoder", "peft")


def load(
    source: str | os.PathLike,
    *,
    step: int | str | None = None,
    backbone: str | os.PathLike | None = None,
    dtype: Any = None,
    revision: str | None = None,
    verify: bool = False,
    task: str | None = None,
) -> SequenceModel:
    """The model in ``source``: a run folder (``step``: ``"latest"``, ``"best"`` or a number), a
    checkpoint folder, a transformers classifier, a sentence-transformers folder, a PEFT LoRA
    adapter or a head export (on ``backbone``, default: the folder it names), or a hub id found in
    the local cache. Files flaxheads wrote are checked against their recorded checksums (size and
    sampled bytes; ``verify=True``: every byte); a difference raises
    :class:`~flaxheads.disk.checksums.ChecksumError`. ``task``: a transformers folder's task adapters
    (Jina Embeddings v3), as :func:`flaxheads.from_pretrained` takes it."""
    return load_source(
        source, step=step, backbone=backbone, dtype=dtype, revision=revision, verify=verify, task=task
    ).model


def export(
    model: SequenceModel,
    dest: str | os.PathLike,
    format: str = "transformers",  # noqa: A002
    **options: Any,
) -> str:
    """Write ``model`` to the folder ``dest`` in ``format`` (one of :data:`FORMATS`); ``options``
    go to that format's exporter in :mod:`flaxheads.interop` (``overwrite``, ``tokenizer_from``,
    ``max_seq_length``, ...). Returns the folder written."""
    model = model.to_functional() if hasattr(model, "to_functional") else model  # an NNX model: its functional form
    if format == "transformers":
        return export_transformers(model, dest, **options)
    if format == "sentence-transformers":
        return export_sentence_transformers(model, dest, **options)
    if format == "head":
        return export_head(model, dest, **options)
    if format == "onnx":
        from flaxheads.interop.onnx import export_onnx  # torch: imported only for this format

        return export_onnx(model, dest, **options)
    if format == "cross-encoder":
        return export_cross_encoder(model, dest, **options)
    if format == "peft":
        if getattr(model, "lora", None) is None:
            raise UsageError(
                "format='peft' writes LoRA adapters, and this model has none (it was not trained with "
                "lora_rank); export the whole model in another format"
            )
        return export_peft(model, dest, **options)
    raise UsageError(f"unknown export format {format!r}: expected one of {', '.join(FORMATS)}")


def export_folder(
    src: str | os.PathLike,
    out: str | os.PathLike,
    format: str,
    *,  # noqa: A002
    step: int | str | None = None,
    backbone: str | None = None,
    tokenizer: str | None = None,
    pooling_format: str = "legacy",
    max_seq_length: int | None = None,
    peft: bool = False,
    overwrite: bool = False,
) -> str:
    """``flaxheads export``: the model in the folder ``src`` (run or checkpoint, transformers /
    sentence-transformers / PEFT folder, head export) written to ``out`` in ``format``, every path
    checked before anything loads. ``peft``: a LoRA run's adapters as a PEFT folder."""
    src, out = os.fspath(src), os.fspath(out)
    _check_paths(src, out, format, backbone, overwrite)
    if peft and format != "transformers":
        raise UsageError(
            f"--peft writes adapters for a transformers classifier; use it with --format transformers "
            f"(got --format {format})"
        )
    with phases.phase(f"loading {src}"):
        source = _load_for_export(src, out, format, step, backbone, peft, overwrite)
    if isinstance(source, str):  # a head export, re-exported
        return source
    fmt = "peft" if peft else format
    by_format: dict[str, dict[str, Any]] = {
        "transformers": {"tokenizer_from": tokenizer, "threshold": _run_threshold(src)},
        "onnx": {"tokenizer_from": tokenizer, "threshold": _run_threshold(src)},
        # a transformers classifier + the activation CrossEncoder.predict applies
        "cross-encoder": {"tokenizer_from": tokenizer, "max_length": max_seq_length},
        "sentence-transformers": {
            "tokenizer_from": tokenizer,
            "pooling_format": pooling_format,
            "max_seq_length": max_seq_length,
        },
    }
    options = by_format.get(fmt, {})
    return export(_with_adapters(source, src) if peft else source, out, format=fmt, **options, overwrite=overwrite)


def _load_for_export(src: str, out: str, format: str, step, backbone, peft: bool, overwrite: bool):  # noqa: A002
    """The model to export (a head export is re-exported here, and its folder returned)."""
    kind = folder_kind(src)
    if kind is FolderKind.HEAD_EXPORT:
        if format != "head":
            raise UsageError(
                f"{src} is a head-only export (no backbone weights); it can only be re-exported with --format head"
            )
        head, params, cfg = load_head_export(src)
        meta = {k: v for k, v in cfg.items() if k not in _FILE_KEYS}
        return export_head(
            head, out, params=params, meta=meta, hf_names=[tuple(x) for x in cfg["hf_names"]], overwrite=overwrite
        )
    if kind in MODEL_FOLDERS:
        # a PEFT adapter folder loads on its base: backbone, else the one it names
        return import_model(src, **({"backbone": backbone} if kind is FolderKind.PEFT_ADAPTER and backbone else {}))
    return _from_checkpoint(src, step, backbone, format)  # a run, or a folder that says what it lacks


#: Keys of a head export's config that describe the file, not the head (dropped when re-exporting).
_FILE_KEYS = ("format", "flaxheads_version", "sequence_head", "hf_names", "params")


def _check_paths(src: str, out: str, fmt: str, backbone: str | None, overwrite: bool) -> None:
    if not os.path.isdir(src):
        raise UsageError(
            f"--from {src!r} does not exist (expected a run folder, a checkpoint folder, a model "
            "folder or a head export)"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputExistsError(
            f"--out {out!r} is a file, not a folder: choose a new folder (a file is never replaced, --overwrite or not)"
        )
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)) and not overwrite:
        raise UsageError(
            f"--out {out!r} already exists and is not empty; pass --overwrite to replace it, or choose a new folder"
        )
    if os.path.isdir(out) and os.listdir(out) and not has_marker(out):
        raise OutputExistsError(
            f"--out {out!r} holds files flaxheads did not write (no {MARKER} marker): --overwrite "
            "replaces only flaxheads' own exports; choose a new folder, or empty this one yourself"
        )
    head_only = fmt == "head" or folder_kind(src) is FolderKind.HEAD_EXPORT
    # written beside --out, then renamed into place: its parent folder is what must take the files
    check_folder(
        os.path.dirname(os.path.abspath(out)),
        what=f"--out {out!r}: its folder",
        need_bytes=with_margin(0 if head_only else export_bytes(src, backbone)),
    )


def _from_checkpoint(src: str, step, backbone: str | None, fmt: str):
    """The model (or, for ``--format head``, the head) saved in a run or checkpoint folder."""
    if backbone is not None and not os.path.isdir(backbone):
        raise UsageError(
            f"--backbone {backbone!r} is not a folder (expected the Hugging Face folder of the "
            "backbone the head was trained on)"
        )
    return model_from_checkpoint(src, step=step, backbone=backbone, head_only=fmt == "head")


def _with_adapters(source, src: str):
    """The source of ``--peft``: a model with LoRA adapters, exported as a transformers adapter."""
    if getattr(source, "lora", None) is None:
        raise UsageError(
            f"--peft: {src} has no LoRA adapters (it was not trained with --lora-rank); export "
            "the whole model without --peft"
        )
    return source


def _run_threshold(src: str) -> float | None:
    """The multi-label threshold the run that saved ``src`` trained with (None for other sources)."""
    if folder_kind(src) is not FolderKind.RUN:
        return None
    return (run_config(src).get("train") or {}).get("threshold")
