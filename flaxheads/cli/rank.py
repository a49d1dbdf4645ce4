"""``flaxheads rank``: scores and ranks of candidates for their queries, from a one-output model
(a reranker or reward model: a run trained with ``--objective``, a sentence-transformers
CrossEncoder folder, a transformers ``XForSequenceClassification`` folder with one label).

The input table has one row per (query, candidate) pair (``--query-column``, ``--passage-column``);
rows with the same query text are ranked together. The output keeps every input column and adds
``score`` and ``rank`` (1 = the best candidate of its query). With ``--preference`` the input has
``prompt``, ``chosen`` and ``rejected`` columns, and the output adds ``chosen_score``,
``rejected_score`` and ``prefers_chosen``.

Examples:
  flaxheads rank runs/reranker --input pairs.csv --output ranked.csv
  flaxheads rank path/to/cross-encoder --input pairs.jsonl --query-column question --passage-column answer
  flaxheads rank runs/reward-model --input prefs.csv --preference --output scored.csv
"""

from __future__ import annotations

import argparse
import sys

from flaxheads.cli import flags
from flaxheads.cli.flags import Program
from flaxheads.cli.predict import _run, _source_flags, load_classifier
from flaxheads.data.tables import DataError
from flaxheads.predict.io import (
    INPUT_FORMATS,
    OUTPUT_FORMATS,
    STDIO,
    check_new_columns,
    output_format,
    read_input,
    write_rows,
)
from flaxheads.predict.ranking import check_scorer, ranks_within


def run_rank(args: argparse.Namespace, program: Program | None = None) -> int:
    if args.preference:
        return run_preferences(args)
    table = read_input(
        args.input,
        fmt=args.input_format,
        text_column=args.query_column or "query",
        text_pair_column=args.passage_column,
    )
    fmt = output_format(args.output, args.output_format)
    check_new_columns(table, ["score", "rank"])
    clf = load_classifier(args)
    check_scorer(clf)
    scores = _run(
        clf,
        "outputs",
        args,
        table.texts,
        table.pairs,
        table.names,
        chat_template=flags.chat_template_wanted(args, clf, reward_model=False),
    )[0][:, 0]
    ranks = ranks_within(scores, table.texts)
    rows = [{**r, "score": float(s), "rank": int(k)} for r, s, k in zip(table.rows, scores, ranks)]
    write_rows(args.output, fmt, rows, table.columns + ["score", "rank"])
    if args.output != STDIO:
        print(f"wrote {len(rows)} scores for {len(set(table.texts))} queries to {args.output}", file=sys.stderr)
    return 0


def run_preferences(args: argparse.Namespace) -> int:
    """``--preference``: a reward model's score of each row's chosen and rejected response."""
    table = read_input(
        args.input, fmt=args.input_format, text_column=args.query_column or "prompt", text_pair_column="chosen"
    )
    if "rejected" not in table.columns:
        raise DataError(
            f"{table.source}: no column 'rejected' (columns: {table.columns}); --preference reads "
            "prompt, chosen and rejected columns"
        )
    new = ["chosen_score", "rejected_score", "prefers_chosen"]
    fmt = output_format(args.output, args.output_format)
    check_new_columns(table, new)
    clf = load_classifier(args)
    check_scorer(clf)
    rejected = [r["rejected"] for r in table.rows]
    chosen = table.pairs
    if chosen is None:  # read_input gives the pair column it was asked for
        raise DataError(f"{table.source}: no column 'chosen'; --preference reads prompt, chosen and rejected columns")
    names = table.names + [
        n.replace(f"column {args.query_column or 'prompt'!r}", "column 'rejected'") for n in table.names
    ]
    scores = _run(
        clf,
        "outputs",
        args,
        table.texts * 2,
        list(chosen) + rejected,
        names,
        chat_template=flags.chat_template_wanted(args, clf, reward_model=True),
    )[0][:, 0]
    n = len(table.rows)
    rows = [
        {**r, "chosen_score": float(c), "rejected_score": float(j), "prefers_chosen": bool(c > j)}
        for r, c, j in zip(table.rows, scores[:n], scores[n:])
    ]
    write_rows(args.output, fmt, rows, table.columns + new)
    if args.output != STDIO:
        share = sum(r["prefers_chosen"] for r in rows) / max(n, 1)
        print(f"wrote {n} preference scores to {args.output} (chosen scored higher in {share:.1%})", file=sys.stderr)
    return 0


def add_rank_command(sub: argparse._SubParsersAction) -> None:
    """Register ``flaxheads rank``."""
    p = sub.add_parser(
        "rank",
        help="scores and ranks of (query, candidate) pairs with a reranker or reward model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _source_flags(p)
    p.add_argument(
        "--input", required=True, help="CSV / TSV / JSON Lines / Parquet file, or - (stdin, with --input-format)"
    )
    p.add_argument("--input-format", choices=sorted(set(INPUT_FORMATS) - {"txt"}), default=None)
    p.add_argument("--query-column", default=None, help="default: query (prompt with --preference)")
    p.add_argument("--passage-column", default="passage", help="the candidate column (default: passage)")
    p.add_argument(
        "--preference",
        action="store_true",
        help="the input has prompt, chosen and rejected columns: write chosen_score, rejected_score and "
        "prefers_chosen for each row (a reward model's view of the pairs)",
    )
    flags.add_chat_template_flag(p, "on with --preference when the tokenizer has one")
    p.add_argument("--output", default=STDIO, help="output .csv or .jsonl (default: JSON Lines on stdout)")
    p.add_argument("--output-format", choices=OUTPUT_FORMATS, default=None)
    p.set_defaults(func=run_rank)


__all__ = ["add_rank_command", "run_rank"]
