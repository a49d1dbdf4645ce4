"""``flaxheads predict | embed | evaluate``: a trained model on new texts.

SOURCE is a run folder (latest checkpoint; ``--step best`` or a number), a checkpoint folder, a
transformers classifier folder, a sentence-transformers folder, a head export (with
``--backbone``), or a Hugging Face hub id (the local hub cache when offline).

Examples:
  flaxheads predict runs/news --input new.csv --output predicted.csv --top-k 2
  cat sentences.txt | flaxheads predict runs/news --input - > predicted.jsonl
  flaxheads embed path/to/sentence-transformers --input texts.txt --output vectors.npy
  flaxheads evaluate runs/news --input labelled.csv --output-dir eval/
  flaxheads evaluate runs/news --split test            # the run's own test split, as it trained
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import numpy as np

from flaxheads.cli import flags
from flaxheads.cli.flags import Program
from flaxheads.data.tables import LabelSpace, TextTable, encode_labels
from flaxheads.disk.preflight import check_file, check_folder
from flaxheads.errors import UsageError
from flaxheads.losses import REGRESSION
from flaxheads.predict import Classifier
from flaxheads.predict.io import (
    INPUT_FORMATS,
    OUTPUT_FORMATS,
    STDIO,
    check_new_columns,
    output_format,
    prediction_columns,
    read_input,
    read_labelled_input,
    write_embeddings,
    write_rows,
)
from flaxheads.predict.ranking import evaluate_groups, format_ranking, ranking_groups
from flaxheads.run.data import run_split
from flaxheads.run.folder import RunFolder, scalars
from flaxheads.tasks.metrics import compute_metrics, format_table, headline


def _source_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        metavar="SOURCE",
        help="run folder, checkpoint folder, transformers or "
        "sentence-transformers folder, head export or PEFT LoRA adapter folder (with --backbone, "
        "default: the one it names), or hub id (org/name)",
    )
    p.add_argument("--step", type=flags.step_spec, default=None, help="a run's checkpoint: latest (default), best, N")
    p.add_argument(
        "--backbone",
        default=None,
        help="backbone folder of a head export, or base model folder of a PEFT adapter (default: the one it names)",
    )
    p.add_argument("--batch-size", type=flags.positive_int, default=32, help="texts per batch (default 32)")
    p.add_argument(
        "--max-length",
        type=flags.positive_int,
        default=None,
        help="tokens per text (default: the run's --max-length, else the model's maximum)",
    )
    p.add_argument("--no-truncate", action="store_true", help="refuse texts longer than the maximum length")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _input_flags(p: argparse.ArgumentParser, *, labelled: bool = False) -> None:
    p.add_argument(
        "--input",
        required=not labelled,
        default=None,
        help="CSV / TSV / JSON Lines / Parquet file, a .txt file (one text per line), or - (stdin)"
        + (" with a label column" if labelled else ""),
    )
    p.add_argument(
        "--input-format",
        choices=sorted(INPUT_FORMATS),
        default=None,
        help="the --input format when its extension does not say (stdin: txt unless given)",
    )
    p.add_argument("--text-column", default="text")
    p.add_argument("--text-pair-column", default=None, help="second text column (sentence pairs)")


def load_classifier(args: argparse.Namespace) -> Classifier:
    return Classifier.from_pretrained(
        args.source,
        step=args.step,
        backbone=args.backbone,
        threshold=getattr(args, "threshold", None),
        max_length=args.max_length,
    )


def _run(clf: Classifier, method: str, args, texts, pairs, names, **kw):
    """``clf.predict`` / ``clf.embed``, its warnings printed as ``warning:`` lines."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = getattr(clf, method)(
            texts,
            pairs,
            batch_size=args.batch_size,
            truncate=not args.no_truncate,
            progress=False if args.no_progress else None,
            rows=names,
            **kw,
        )
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr, flush=True)
    return out


def run_predict(args: argparse.Namespace, program: Program | None = None) -> int:
    if args.top_k is not None and args.top_k < 1:
        raise UsageError("--top-k must be at least 1")
    table = read_input(
        args.input, fmt=args.input_format, text_column=args.text_column, text_pair_column=args.text_pair_column
    )
    fmt = output_format(args.output, args.output_format)
    if args.output != STDIO:
        check_file(args.output, what="--output")
    clf = load_classifier(args)
    chat = flags.chat_template_wanted(args, clf, reward_model=False)
    if chat and table.pairs is None:
        raise UsageError("--chat-template on writes (prompt, response) pairs: give --text-pair-column (the responses)")
    pred = _run(clf, "predict", args, table.texts, table.pairs, table.names, top_k=args.top_k, chat_template=chat)
    cols, new = prediction_columns(pred)
    check_new_columns(table, cols)
    write_rows(args.output, fmt, [{**r, **n} for r, n in zip(table.rows, new)], table.columns + cols)
    if args.output != STDIO:
        print(f"wrote {len(new)} predictions to {args.output}", file=sys.stderr)
    return 0


def run_embed(args: argparse.Namespace, program: Program | None = None) -> int:
    table = read_input(
        args.input, fmt=args.input_format, text_column=args.text_column, text_pair_column=args.text_pair_column
    )
    if Path(args.output).suffix.lower() not in (".npy", ".parquet"):
        raise UsageError(f"--output {args.output!r}: embeddings are written as .npy or .parquet")
    check_file(args.output, what="--output")
    clf = load_classifier(args)
    emb = _run(clf, "embed", args, table.texts, table.pairs, table.names)
    write_embeddings(args.output, table, emb)
    print(f"wrote {emb.shape[0]} embeddings of width {emb.shape[1]} to {args.output}", file=sys.stderr)
    return 0


def label_space(clf: Classifier) -> LabelSpace:
    names = None if clf.problem_type == REGRESSION else [clf.id2label[i] for i in range(len(clf.id2label))]
    return LabelSpace(clf.problem_type, names, clf.model.num_labels)


def _evaluation_data(args: argparse.Namespace, clf: Classifier):
    """(split name, table, encoded labels): ``--input`` read with the model's labels, or a run's own ``--split``."""
    space = label_space(clf)
    if args.split:
        if args.input:
            raise UsageError("give --input (a labelled file) or --split (the run's own split), not both")
        table = run_split(clf.source, args.split)
        if not isinstance(table, TextTable):  # a ranking run's groups: run_evaluate scores them before this
            raise UsageError(f"--split {args.split}: the run's split holds ranking groups, not labelled rows")
        return args.split, table, encode_labels(table, space, args.split)
    if not args.input:
        raise UsageError("give --input LABELLED_FILE (or --split for a run's own split)")
    table = read_labelled_input(
        args.input,
        fmt=args.input_format,
        text_column=args.text_column,
        label_column=args.label_column,
        text_pair_column=args.text_pair_column,
    )
    return "evaluation", table, encode_labels(table, space, "evaluation")


def run_evaluate(args: argparse.Namespace, program: Program | None = None) -> int:
    if args.output_dir:
        check_folder(args.output_dir, what="--output-dir")
    clf = load_classifier(args)
    if clf.is_embedding:
        raise UsageError(f"{args.source} gives embeddings, not predictions to score against labels")
    groups = ranking_groups(clf.source, split=args.split, input=args.input)
    if groups is not None:  # a ranking run: its groups scored and ranked
        print(format_ranking(evaluate_groups(clf, groups, batch_size=args.batch_size)[0], args.split, args.json))
        return 0
    name, table, labels = _evaluation_data(args, clf)
    names = [f"{table.source}: {r}" for r in table.rows]
    pred = _run(clf, "predict", args, table.texts, table.pairs, names)
    metrics = compute_metrics(clf.problem_type, pred.logits, labels, clf.model.num_labels, threshold=clf.threshold)
    final = {name: metrics}
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        summary = {
            "source": args.source,
            "input": args.input,
            "split": args.split,
            "examples": len(labels),
            "metrics": {name: scalars(metrics)},
        }
        text = RunFolder(out).write_results(
            summary, final, clf.id2label, {name: {"logits": pred.logits, "labels": np.asarray(labels)}}
        )
        if "confusion_matrix" in metrics:
            from flaxheads.run.plots import plot_confusion_matrix  # matplotlib only when there is a matrix to draw

            plot_confusion_matrix(out / "confusion_matrix.png", metrics["confusion_matrix"], clf.id2label, name)
    else:
        text = f"== {name} ==\n{format_table(metrics, clf.id2label)}"
    print(text)
    if args.json:
        print(json.dumps({name: scalars(metrics)}))
    h = headline(clf.problem_type)
    print(f"{name} {h} {metrics[h]:.4f} on {len(labels)} examples", file=sys.stderr)
    return 0


def add_predict_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``flaxheads predict``, ``embed`` and ``evaluate``."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("predict", help="labels and scores for new texts", description=__doc__, formatter_class=fmt)
    _source_flags(p)
    _input_flags(p)
    p.add_argument("--output", default=STDIO, help="CSV or JSON Lines file, or - (stdout, JSON Lines; default)")
    p.add_argument("--output-format", choices=OUTPUT_FORMATS, default=None)
    p.add_argument("--top-k", type=flags.positive_int, default=None, help="single-label: also the K best labels")
    flags.add_chat_template_flag(p, "off; on: a reward model's (--text-column, --text-pair-column) pairs")
    p.add_argument(
        "--threshold",
        type=flags.open_unit,
        default=None,
        help="multi-label decision threshold (default: the run's, else 0.5)",
    )
    p.set_defaults(func=run_predict)

    p = sub.add_parser(
        "embed",
        help="embeddings of texts (projection / identity heads, sentence-transformers)",
        description=__doc__,
        formatter_class=fmt,
    )
    _source_flags(p)
    _input_flags(p)
    p.add_argument("--output", required=True, help="x.npy ([N, D] float32) or x.parquet (input columns + embedding)")
    p.set_defaults(func=run_embed)

    p = sub.add_parser(
        "evaluate",
        help="metrics, per-class table and confusion matrix on labelled texts",
        description=__doc__,
        formatter_class=fmt,
    )
    _source_flags(p)
    _input_flags(p, labelled=True)
    p.add_argument("--label-column", default="label")
    p.add_argument(
        "--split",
        choices=("train", "validation", "test"),
        default=None,
        help="instead of --input: a run's own split, rebuilt from its config.json",
    )
    p.add_argument("--threshold", type=flags.open_unit, default=None, help="multi-label decision threshold")
    p.add_argument(
        "--output-dir", default=None, help="write eval.txt, summary.json, predictions.npz and confusion_matrix.png here"
    )
    p.add_argument("--json", action="store_true", help="also print the scalar metrics as one JSON line")
    p.set_defaults(func=run_evaluate)
