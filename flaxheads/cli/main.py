"""The ``flaxheads`` command line: one ``add_<name>_command(subparsers)`` function per subcommand.

To add a subcommand, write ``add_x_command(sub)`` that registers its parser and sets
``func=`` (``func(args) -> exit code``), and append it to :data:`SUBCOMMANDS`.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable


# ---- export ------------------------------------------------------------------------------------
def _is_checkpoint_folder(path: str) -> bool:
    """A run folder (``checkpoints/`` inside; its ``config.json`` is the training config), a
    checkpoint root (step folders with ``meta``) or one step's folder."""
    def is_step(p):
        return os.path.basename(p).isdigit() and os.path.isdir(os.path.join(p, "meta"))

    return (os.path.isdir(os.path.join(path, "checkpoints")) or is_step(path)
            or any(is_step(os.path.join(path, d)) for d in os.listdir(path)))


def _load_export_source(args):
    """A model (or, for ``--format head``, a head) from a model folder, head export or checkpoint."""
    from ..interop.export import HEAD_CONFIG, load_head_export, model_from_checkpoint

    src = os.fspath(args.src)
    if not os.path.isdir(src):
        raise FileNotFoundError(f"--from {src!r} does not exist (expected a run folder, a checkpoint folder or a "
                                "model folder)")
    if os.path.isfile(os.path.join(src, HEAD_CONFIG)):
        if args.format != "head":
            raise ValueError(f"{src} is a head-only export (no backbone weights); it can only be re-exported with "
                             "--format head")
        head, params, cfg = load_head_export(src)
        return head, params, cfg
    if not _is_checkpoint_folder(src) and (os.path.isfile(os.path.join(src, "config.json"))
                                           or os.path.isfile(os.path.join(src, "modules.json"))):
        from ..interop.hf_import import import_model

        return import_model(src), None, None
    return model_from_checkpoint(src, step=args.step, backbone=args.backbone, head_only=args.format == "head"), \
        None, None


def run_export(args) -> int:
    from ..interop.export import export_head, export_sentence_transformers, export_transformers

    source, params, cfg = _load_export_source(args)
    if args.format == "head":
        if cfg is not None:  # re-export of a head export
            meta = {k: v for k, v in cfg.items() if k not in ("format", "flaxheads_version", "sequence_head",
                                                               "hf_names", "params")}
            out = export_head(source, args.out, params=params, meta=meta, hf_names=[tuple(x) for x in cfg["hf_names"]],
                              overwrite=args.overwrite)
        else:
            out = export_head(source, args.out, overwrite=args.overwrite)
    elif args.format == "transformers":
        out = export_transformers(source, args.out, tokenizer_from=args.tokenizer, overwrite=args.overwrite)
    else:
        out = export_sentence_transformers(source, args.out, tokenizer_from=args.tokenizer,
                                           pooling_format=args.pooling_format, max_seq_length=args.max_seq_length,
                                           overwrite=args.overwrite)
    print(f"wrote {args.format} export to {out}")
    return 0


def add_export_command(sub) -> None:
    p = sub.add_parser(
        "export", help="export a model or head to PyTorch layouts",
        description="Export to the PyTorch transformers layout (HF-exact heads), the sentence-transformers layout "
                    "(pooling + dense layers + normalize) or a head-only safetensors + JSON config (any head). "
                    "Needs no torch.")
    p.add_argument("--from", dest="src", required=True,
                   help="a run folder, an Orbax checkpoint folder (root or one step), a transformers / "
                        "sentence-transformers model folder, or a head export")
    p.add_argument("--format", required=True, choices=("transformers", "sentence-transformers", "head"))
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty, unless --overwrite)")
    p.add_argument("--step", default=None, help="checkpoint step: an integer, 'latest' (default) or 'best'")
    p.add_argument("--backbone", default=None,
                   help="backbone folder for a checkpoint that did not save its (frozen) backbone; default: the "
                        "backbone_name_or_path recorded in the checkpoint's meta")
    p.add_argument("--tokenizer", default=None, help="folder to copy tokenizer files from (default: the backbone's)")
    p.add_argument("--pooling-format", default="legacy", choices=("legacy", "v6"),
                   help="sentence-transformers Pooling config: legacy pooling_mode_* keys (every ST version) or "
                        "the pooling_mode key")
    p.add_argument("--max-seq-length", type=int, default=None, help="sentence-transformers max_seq_length")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=run_export)


# ---- checkpoints ---------------------------------------------------------------------------------
def run_checkpoints(args) -> int:
    import json

    from ..checkpoint import format_listing, format_meta, list_checkpoints, read_meta

    if args.meta:
        step = args.step if args.step in (None, "latest", "best") else int(args.step)
        meta, step, root = read_meta(args.path, step)
        if args.json:
            print(json.dumps({"path": os.path.join(root, str(step)), "step": step, "meta": meta}, indent=2))
        else:
            print(f"{os.path.join(root, str(step))} (step {step})\n{format_meta(meta)}")
        return 0
    rows = list_checkpoints(args.path, verify=args.verify)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_listing(rows))
    return 0


def add_checkpoints_command(sub) -> None:
    p = sub.add_parser(
        "checkpoints", help="list a run's checkpoints, or print one checkpoint's meta",
        description="List the checkpoint steps of a run folder (items, size, metrics, latest/best, unfinished "
                    "or corrupt saves), or with --meta print a head checkpoint's meta readably: backbone, "
                    "pooler and head config, labels, parameter shapes.")
    p.add_argument("path", help="a run folder, a checkpoint folder (holding step folders) or one step's folder")
    p.add_argument("--meta", action="store_true", help="print the meta of one step (default: the latest)")
    p.add_argument("--step", default=None, help="with --meta: an integer, 'latest' (default) or 'best'")
    p.add_argument("--verify", action="store_true", help="read every array of every step (finds truncated files)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_checkpoints)


# ---- entry point -------------------------------------------------------------------------------------
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_export_command, add_checkpoints_command]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flaxheads", description="flaxheads command-line tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:
        from .train import main as train_main

        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError, KeyError) as e:
        print(f"flaxheads {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
