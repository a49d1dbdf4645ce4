"""``flaxheads checkpoints``: list a run's checkpoint steps (and verify them), or print one step's meta."""

from __future__ import annotations

import argparse
import json
import os

from flaxheads.checkpoint import format_listing, format_meta, list_checkpoints, read_meta
from flaxheads.checkpoint.inspect import verify_model_folder
from flaxheads.checkpoint.kinds import FolderKind, folder_kind
from flaxheads.cli import flags
from flaxheads.cli.flags import Program


def run_checkpoints(args: argparse.Namespace, program: Program | None = None) -> int:
    """Print the listing or the meta; with ``--verify``, exit 1 when a step fails to read."""
    if args.meta:
        meta, step, root = read_meta(args.path, args.step)
        where = os.path.join(root, str(step))
        if args.json:
            print(json.dumps({"path": where, "step": step, "meta": meta}, indent=2))
        else:
            print(f"{where} (step {step})\n{format_meta(meta)}")
        return 0
    if args.verify and folder_kind(args.path) not in (None, FolderKind.RUN):  # an export or a model folder: its files
        print(verify_model_folder(args.path))
        return 0
    rows = list_checkpoints(args.path, verify=args.verify)
    print(json.dumps(rows, indent=2) if args.json else format_listing(rows))
    bad = [r for r in rows if r["status"] != "ok" and r["step"] is not None]
    return 1 if args.verify and bad else 0


def add_checkpoints_command(sub: argparse._SubParsersAction) -> None:
    """Register ``flaxheads checkpoints``."""
    p = sub.add_parser(
        "checkpoints",
        help="list a run's checkpoints, or print one checkpoint's meta",
        description="List the checkpoint steps of a run folder (items, size, metrics, latest/best, unfinished "
        "or corrupt saves), or with --meta print a head checkpoint's meta readably: backbone, "
        "pooler and head config, labels, parameter shapes.",
    )
    p.add_argument("path", help="a run folder, a checkpoint folder (holding step folders) or one step's folder")
    p.add_argument("--meta", action="store_true", help="print the meta of one step (default: the latest)")
    p.add_argument(
        "--step", type=flags.step_spec, default=None, help="with --meta: an integer, 'latest' (default) or 'best'"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_checkpoints)


def add_report_command(sub: argparse._SubParsersAction) -> None:
    """Register ``flaxheads report RUN``: write the run folder's report.html again from its files."""
    from flaxheads.run.report import report_run

    p = sub.add_parser("report", help="write a run folder's report.html again, from the folder's files (any run)")
    p.add_argument("run", help="a run folder")
    p.set_defaults(func=lambda args, program=None: print(report_run(args.run)) or 0)
