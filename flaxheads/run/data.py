"""A run's data, decided in one place: :func:`load_data` reads a spec's examples in memory, as a
stream (large tables, globs, ``stream=True``), or as groups (ranking objectives), finds the label
space once; :meth:`RunData.task` is the task of that data and :meth:`RunData.tokenize` turns the
splits into what ``fit`` batches. :func:`run_split` rebuilds a split a run trained on."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, cast

import numpy as np

from flaxheads.checkpoint import CheckpointError, read_meta, resolve_root
from flaxheads.checkpoint.meta import CHECKPOINTS_SUBDIR
from flaxheads.data.groups import GroupTable, check_unit_relevance, load_groups, split_groups, tokenize_groups
from flaxheads.data.objects import DataObject, is_description, record, summary
from flaxheads.data.splits import SOURCE_FIELDS, DataConfig, TableSources, load_splits, source_record, tokenize_shared
from flaxheads.data.streaming import open_stream, split_table, streams
from flaxheads.data.tables import DataError, LabelSpace, TextTable
from flaxheads.errors import UsageError
from flaxheads.run.spec import RunSpec, TaskSpec
from flaxheads.runtime import phases
from flaxheads.tasks.ranking.objectives import MARGIN_OBJECTIVES
from flaxheads.tasks.ranking.task import Ranking, objective_options
from flaxheads.tasks.task import Classification, Task


@dataclasses.dataclass
class RunData:
    """The splits of a run before tokenisation. ``space`` is None for ranking (one score per row);
    ``kind`` is ``"rows"``, or the group table's layout (``"preference"`` / ``"ranking"``)."""

    tables: dict[str, Any]  # TextTable, GroupTable, or a stream's sources
    space: LabelSpace | None
    kind: str
    config: dict  # what the run's config.json records of the data
    labels: dict[str, np.ndarray] | None = None  # encoded labels of in-memory rows
    stream: Any = None  # the stream's scan (training.streaming.StreamData) when the data streams

    @property
    def has_validation(self) -> bool:
        return "validation" in self.tables

    @property
    def group_size(self) -> int:
        """The most candidates of a group (ranking); 1 for rows."""
        return max(t.max_group for t in self.tables.values()) if self.kind != "rows" else 1

    def task(self, t: TaskSpec) -> Task:
        """The task ``t`` sets on this data: ranking of groups (no label space), else classification."""
        space = self.space
        if space is None:
            options = objective_options(t.objective, margin=t.margin, scale=t.scale)
            return Ranking(t.objective, self.group_size, options=options, kind=self.kind)
        return Classification(space.problem_type, space.num_labels, threshold=t.threshold)

    def tokenize(self, tokenizer, max_length: int) -> dict[str, Any]:
        """Every split as ``fit`` takes it: ``Split``, ``StreamSplit`` or ``GroupedSplit``. Rows are
        tokenized once across the processes of a multi-host run (each its share, then gathered)."""
        if self.stream is not None:
            return self.stream.splits(tokenizer, max_length)
        if self.kind != "rows":
            return {n: tokenize_groups(t, tokenizer, max_length, n) for n, t in self.tables.items()}
        labels = self.labels
        assert labels is not None, "in-memory rows carry their encoded labels"
        return {n: tokenize_shared(t, labels[n], tokenizer, max_length, n) for n, t in self.tables.items()}


def data_config(spec: RunSpec) -> DataConfig:
    """The in-memory / streamed reader's settings of ``spec``."""
    d = spec.data
    sources = {f.name: getattr(d, f.name) for f in dataclasses.fields(TableSources)}
    split = cast("tuple[float, float, float]", tuple(d.split))  # a spec's three fractions (a list read from JSON)
    return DataConfig(
        **sources,
        problem_type=spec.task.problem_type,
        split=split,
        seed=spec.seed,
        limit=d.limit,
        label_ids=d.label_ids,
        labels=d.labels,
        eval_limit=d.eval_limit,
        stream=d.stream,
    )


def load_data(spec: RunSpec) -> RunData:
    """Read ``spec``'s data: groups for a ranking objective, else rows in memory or streamed."""
    if spec.ranking:
        return _groups(spec)
    cfg = data_config(spec)
    if streams(cfg.train_file or cfg.data, cfg.stream):
        if spec.cached:
            raise UsageError(
                "--cache-features/--sweep encode the whole training split once, in memory; streamed "
                "data cannot: train the head with --freeze-backbone, or use --no-stream for a table "
                "that fits"
            )
        with phases.phase("scanning the data stream"):
            stream = open_stream(cfg)
        return RunData(stream.sources, stream.space, "rows", source_record(cfg), stream=stream)
    tables, space, labels = load_splits(cfg)
    return RunData(tables, space, "rows", source_record(cfg), labels)


def run_split(source: str | os.PathLike, name: str) -> TextTable | GroupTable:
    """Split ``name`` of the run that saved ``source`` (a run or checkpoint folder), as it trained
    on it: a ranking run's groups, a streamed run's hash split, an in-memory run's stratified one."""
    from flaxheads.formats.sources import run_config

    cfg = run_config(os.fspath(source))
    if not cfg.get("data"):
        raise UsageError(
            f"--split needs a run folder that recorded its data (config.json); {source} has "
            "none: give --input with a labelled file"
        )
    held = [f"{k}= was a {summary(v)}" for k, v in cfg["data"].items() if k in SOURCE_FIELDS and is_description(v)]
    if held:
        raise UsageError(
            f"--split reads a run's data again, and {source} trained on in-memory data ({held[0]}), which "
            "a run folder does not keep: give --input with a labelled file"
        )
    if cfg.get("objective", "classification") != "classification":
        tables = _groups(run_spec(source)).tables
    else:
        data = DataConfig(**dict(cfg["data"], split=tuple(cfg["data"]["split"])))
        if streams(data.train_file or data.data, data.stream):  # the run's hash split, not the in-memory one
            table = split_table(data, name)
            if table is None:
                raise UsageError(f"the run has no {name} split")
            return table
        tables, _, _ = load_splits(data)
    if name not in tables:
        raise UsageError(f"the run has no {name} split (it has {sorted(tables)})")
    return tables[name]


def run_spec(source: str | os.PathLike) -> RunSpec:
    """The spec of the run that saved ``source`` (a run folder, its checkpoints or one of them)."""
    root, _ = resolve_root(os.fspath(source))
    return RunSpec.from_run(os.path.dirname(root) if os.path.basename(root) == CHECKPOINTS_SUBDIR else root)


def _groups(spec: RunSpec) -> RunData:
    d, objective = spec.data, spec.task.objective
    opts = dict(query_column=d.query_column, negatives=d.negatives, seed=spec.seed, limit=d.limit)
    if d.train_file:
        tables = {"train": load_groups(d.train_file, **opts)}
        for name, f in (("validation", d.validation_file), ("test", d.test_file)):
            if f:
                tables[name] = load_groups(f, **opts)
    else:
        assert d.data is not None, "a checked spec names its data when it has no --train-file"
        full = load_groups(d.data, **opts)
        if d.limit and d.data != "bbc_news" and d.limit < len(full):
            full = full.take(np.sort(np.random.default_rng(spec.seed + 1).permutation(len(full))[: d.limit]))
        tables = split_groups(full, d.split, spec.seed)
        if "train" not in tables:
            raise DataError(f"{d.data}: the split {d.split} of {len(full)} groups leaves no training groups")
    if objective == "pointwise":
        for t in tables.values():
            check_unit_relevance(t, objective)
    with_margins = [t.source for t in tables.values() if t.margins is not None]
    if with_margins and objective not in MARGIN_OBJECTIVES:
        raise UsageError(
            f"{with_margins[0]} has a margin column, which the {' and '.join(MARGIN_OBJECTIVES)} "
            f"objectives use, not --objective {objective}: drop the column or change the objective"
        )
    kind = tables["train"].kind
    config = {
        **{k: record(getattr(d, k)) for k in SOURCE_FIELDS},
        "split": list(d.split),
        "seed": spec.seed,
        "limit": d.limit,
        "kind": kind,
        "negatives": d.negatives if d.data == "bbc_news" else None,
    }
    return RunData(tables, None, kind, config)


def check_same_data(out: str | os.PathLike, spec: RunSpec) -> None:
    """Before any model loads: a run folder with checkpoints trained on an in-memory table resumes
    only on the same one (same kind, columns, rows and fingerprint), and one trained on files is not
    resumed on an in-memory table (one line, exit 2). Files against files are the resume's to warn about."""
    root = os.path.join(os.fspath(out), CHECKPOINTS_SUBDIR)
    resume = spec.checkpoints.resume
    if resume == "never" or not os.path.isdir(root) or not any(p.isdigit() for p in os.listdir(root)):
        return
    try:
        meta, step, _ = read_meta(root, None if resume == "auto" else int(resume))
    except CheckpointError:
        return  # no finished step, or a damaged one: the restore reports it
    before = (meta.get("run") or {}).get("data") or {}
    for key in SOURCE_FIELDS:
        was, now = before.get(key), getattr(spec.data, key)
        if not (is_description(was) or isinstance(now, DataObject)) or key not in before:
            continue
        now = record(now)
        fields = ("object", "columns", "rows", "fingerprint")
        if is_description(was) and is_description(now) and all(was.get(f) == now.get(f) for f in fields):
            continue
        name = key.removesuffix("_file")
        raise UsageError(
            f"{out} holds a run trained on {name}={_shown(was)} (checkpoint step {step}), not {name}={_shown(now)}: "
            f"pass the same {name}= to resume it, or train this data in a new output_dir"
        )


def _shown(source) -> str:
    return summary(source) if is_description(source) else repr(source)
