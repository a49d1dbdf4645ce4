"""``flaxheads export``: a model, run, checkpoint or head export to the PyTorch transformers
layout, the sentence-transformers layout, or a head-only safetensors + JSON config; a run
trained with LoRA exports merged weights, or its adapters as a PEFT folder (``--peft``)."""

from __future__ import annotations

import argparse

from flaxheads.cli import flags
from flaxheads.cli.flags import Program
from flaxheads.formats import export_folder


def run_export(args: argparse.Namespace, program: Program | None = None) -> int:
    """Load the source (model folder, head export or checkpoint) and write it in ``--format``."""
    out = export_folder(
        args.src,
        args.out,
        args.format,
        step=args.step,
        backbone=args.backbone,
        tokenizer=args.tokenizer,
        pooling_format=args.pooling_format,
        max_seq_length=args.max_seq_length,
        peft=args.peft,
        overwrite=args.overwrite,
    )
    print(f"wrote {'PEFT adapter' if args.peft else args.format} export to {out}")
    return 0


def add_export_command(sub: argparse._SubParsersAction) -> None:
    """Register ``flaxheads export``."""
    p = sub.add_parser(
        "export",
        help="export a model or head to PyTorch layouts",
        description="Export to the PyTorch transformers layout (HF-exact heads as their own classes, any other "
        "pooler + head with flaxheads' PyTorch code: load with trust_remote_code=True), the "
        "sentence-transformers layout (pooling + dense layers + normalize), a head-only safetensors + "
        "JSON config (any head) or ONNX for onnxruntime. Needs no torch, except ONNX.",
    )
    p.add_argument(
        "--from",
        dest="src",
        required=True,
        help="a run folder, an Orbax checkpoint folder (root or one step), a transformers / "
        "sentence-transformers model folder, a PEFT LoRA adapter folder, or a head export",
    )
    p.add_argument(
        "--format",
        required=True,
        choices=("transformers", "sentence-transformers", "head", "onnx", "cross-encoder"),
        help="transformers: a PyTorch folder; sentence-transformers; head: head.safetensors + config "
        "(any head, no backbone); onnx: model.onnx + config + tokenizer for onnxruntime (needs torch); "
        "cross-encoder: a sentence-transformers CrossEncoder folder whose predict gives the raw "
        "scores, as flaxheads rank (HF-exact heads; other poolings + Dense heads need "
        "sentence-transformers 6)",
    )
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty, unless --overwrite)")
    p.add_argument(
        "--step", type=flags.step_spec, default=None, help="checkpoint step: an integer, 'latest' (default) or 'best'"
    )
    p.add_argument(
        "--backbone",
        default=None,
        help="backbone folder for a checkpoint that did not save its (frozen) backbone, or base model "
        "folder of a PEFT adapter; default: the one the checkpoint's meta or the adapter names",
    )
    p.add_argument("--tokenizer", default=None, help="folder to copy tokenizer files from (default: the backbone's)")
    p.add_argument(
        "--pooling-format",
        default="legacy",
        choices=("legacy", "v6"),
        help="sentence-transformers Pooling config: legacy pooling_mode_* keys (every ST version) or "
        "the pooling_mode key",
    )
    p.add_argument(
        "--max-seq-length",
        type=flags.positive_int,
        default=None,
        help="sentence-transformers max_seq_length (cross-encoder: tokens per pair)",
    )
    p.add_argument(
        "--peft",
        action="store_true",
        help="with --format transformers, for a run trained with LoRA: write the adapters and head as a "
        "PEFT adapter folder (adapter_config.json + adapter_model.safetensors) instead of the merged "
        "model",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=run_export)
