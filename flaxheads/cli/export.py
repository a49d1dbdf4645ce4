"""``flaxheads export``: a model, run, checkpoint or head export to the PyTorch transformers
layout, the sentence-transformers layout, or a head-only safetensors + JSON config; a run
trained with LoRA exports merged weights, or its adapters as a PEFT folder (``--peft``)."""
from __future__ import annotations

import argparse
import os

from .. import export_head, import_model, load_head_export, model_from_checkpoint
from ..checkpoint import is_checkpoint_folder
from ..errors import UsageError
from ..formats import export
from ..interop.files import MARKER, OutputExistsError, has_marker
from ..interop.peft import is_adapter_folder
from ..predict.sources import run_config
from ..preflight import check_folder, export_bytes, with_margin
from . import flags
from .flags import Program

#: The file that marks a head-only export folder.
HEAD_CONFIG = "head_config.json"
#: Keys of a head export's config that describe the file, not the head (dropped when re-exporting).
_FILE_KEYS = ("format", "flaxheads_version", "sequence_head", "hf_names", "params")


def _is_model_folder(path: str) -> bool:
    return not is_checkpoint_folder(path) and any(os.path.isfile(os.path.join(path, f))
                                                   for f in ("config.json", "modules.json", "adapter_config.json"))


def _check_paths(args: argparse.Namespace) -> None:
    if not os.path.isdir(args.src):
        raise UsageError(f"--from {args.src!r} does not exist (expected a run folder, a checkpoint folder, a model "
                         "folder or a head export)")
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputExistsError(f"--out {out!r} is a file, not a folder: choose a new folder (a file is never "
                                "replaced, --overwrite or not)")
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)) and not args.overwrite:
        raise UsageError(f"--out {out!r} already exists and is not empty; pass --overwrite to replace it, or choose "
                         "a new folder")
    if os.path.isdir(out) and os.listdir(out) and not has_marker(out):
        raise OutputExistsError(f"--out {out!r} holds files flaxheads did not write (no {MARKER} marker): --overwrite "
                                "replaces only flaxheads' own exports; choose a new folder, or empty this one yourself")
    head_only = args.format == "head" or os.path.isfile(os.path.join(args.src, HEAD_CONFIG))
    # written beside --out, then renamed into place: its parent folder is what must take the files
    check_folder(os.path.dirname(os.path.abspath(out)), what=f"--out {out!r}: its folder",
                 need_bytes=with_margin(0 if head_only else export_bytes(args.src, args.backbone)))


def _from_checkpoint(args: argparse.Namespace):
    """The model (or, for ``--format head``, the head) saved in a run or checkpoint folder."""
    if args.backbone is not None and not os.path.isdir(args.backbone):
        raise UsageError(f"--backbone {args.backbone!r} is not a folder (expected the Hugging Face folder of the "
                         "backbone the head was trained on)")
    return model_from_checkpoint(args.src, step=args.step, backbone=args.backbone, head_only=args.format == "head")


def _with_adapters(source, args: argparse.Namespace):
    """The source of ``--peft``: a model with LoRA adapters, exported as a transformers adapter."""
    if getattr(source, "lora", None) is None:
        raise UsageError(f"--peft: {args.src} has no LoRA adapters (it was not trained with --lora-rank); export "
                         "the whole model without --peft")
    return source


def _run_threshold(src: str) -> float | None:
    """The multi-label threshold the run that saved ``src`` trained with (None for other sources)."""
    if not is_checkpoint_folder(src):
        return None
    return (run_config(src).get("train") or {}).get("threshold")


def run_export(args: argparse.Namespace, program: Program | None = None) -> int:
    """Load the source (model folder, head export or checkpoint) and write it in ``--format``."""
    _check_paths(args)
    if args.peft and args.format != "transformers":
        raise UsageError(f"--peft writes adapters for a transformers classifier; use it with --format transformers "
                         f"(got --format {args.format})")
    src, common = os.fspath(args.src), {"overwrite": args.overwrite}
    if os.path.isfile(os.path.join(src, HEAD_CONFIG)):
        if args.format != "head":
            raise UsageError(f"{src} is a head-only export (no backbone weights); it can only be re-exported with "
                             "--format head")
        head, params, cfg = load_head_export(src)
        meta = {k: v for k, v in cfg.items() if k not in _FILE_KEYS}
        out = export_head(head, args.out, params=params, meta=meta, hf_names=[tuple(x) for x in cfg["hf_names"]],
                          **common)
    else:
        if _is_model_folder(src):
            # a PEFT adapter folder loads on its base: --backbone, else the one it names
            source = import_model(src, **({"backbone": args.backbone} if is_adapter_folder(src) and args.backbone
                                          else {}))
        else:
            source = _from_checkpoint(args)
        fmt = "peft" if args.peft else args.format
        options = {"transformers": {"tokenizer_from": args.tokenizer, "threshold": _run_threshold(src)},
                   "onnx": {"tokenizer_from": args.tokenizer, "threshold": _run_threshold(src)},
                   # a transformers classifier + the activation CrossEncoder.predict applies
                   "cross-encoder": {"tokenizer_from": args.tokenizer, "max_length": args.max_seq_length},
                   "sentence-transformers": {"tokenizer_from": args.tokenizer, "pooling_format": args.pooling_format,
                                             "max_seq_length": args.max_seq_length}}.get(fmt, {})
        out = export(_with_adapters(source, args) if args.peft else source, args.out, format=fmt, **options, **common)
    print(f"wrote {'PEFT adapter' if args.peft else args.format} export to {out}")
    return 0


def add_export_command(sub: argparse._SubParsersAction) -> None:
    """Register ``flaxheads export``."""
    p = sub.add_parser(
        "export", help="export a model or head to PyTorch layouts",
        description="Export to the PyTorch transformers layout (HF-exact heads as their own classes, any other "
                    "pooler + head with flaxheads' PyTorch code: load with trust_remote_code=True), the "
                    "sentence-transformers layout (pooling + dense layers + normalize), a head-only safetensors + "
                    "JSON config (any head) or ONNX for onnxruntime. Needs no torch, except ONNX.")
    p.add_argument("--from", dest="src", required=True,
                   help="a run folder, an Orbax checkpoint folder (root or one step), a transformers / "
                        "sentence-transformers model folder, a PEFT LoRA adapter folder, or a head export")
    p.add_argument("--format", required=True,
                   choices=("transformers", "sentence-transformers", "head", "onnx", "cross-encoder"),
                   help="transformers: a PyTorch folder; sentence-transformers; head: head.safetensors + config "
                        "(any head, no backbone); onnx: model.onnx + config + tokenizer for onnxruntime (needs torch); "
                        "cross-encoder: a sentence-transformers CrossEncoder folder whose predict gives the raw "
                        "scores, as flaxheads rank (HF-exact heads; other poolings + Dense heads need "
                        "sentence-transformers 6)")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty, unless --overwrite)")
    p.add_argument("--step", type=flags.step_spec, default=None,
                   help="checkpoint step: an integer, 'latest' (default) or 'best'")
    p.add_argument("--backbone", default=None,
                   help="backbone folder for a checkpoint that did not save its (frozen) backbone, or base model "
                        "folder of a PEFT adapter; default: the one the checkpoint's meta or the adapter names")
    p.add_argument("--tokenizer", default=None, help="folder to copy tokenizer files from (default: the backbone's)")
    p.add_argument("--pooling-format", default="legacy", choices=("legacy", "v6"),
                   help="sentence-transformers Pooling config: legacy pooling_mode_* keys (every ST version) or "
                        "the pooling_mode key")
    p.add_argument("--max-seq-length", type=flags.positive_int, default=None,
                   help="sentence-transformers max_seq_length (cross-encoder: tokens per pair)")
    p.add_argument("--peft", action="store_true",
                   help="with --format transformers, for a run trained with LoRA: write the adapters and head as a "
                        "PEFT adapter folder (adapter_config.json + adapter_model.safetensors) instead of the merged "
                        "model")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=run_export)
