"""In-memory tables as a run's data: a pandas ``DataFrame``, a Hugging Face ``datasets.Dataset``, a
``DatasetDict`` (its splits are the run's), an ``IterableDataset`` (read as a stream), a dict of
columns ``{"text": [...], "label": [...]}`` or a ``(texts, labels)`` / ``(texts, text_pairs, labels)``
tuple.

A spec holds such an object as a :class:`DataObject`; the readers see it as :class:`Columns` (the
column names and each column as Python values, what a table file gives them), so columns are
found as they are for files. A run folder records an object by its :func:`describe`: kind, columns
and their dtypes, rows and a content fingerprint (``Dataset._fingerprint`` for ``datasets`` objects,
else a hash of the columns' Arrow buffers), which is how a run resumed with other data is told
apart. pandas and ``datasets`` are recognised by their classes' modules, never imported here.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from typing import Any, TypeGuard

from flaxheads.errors import UsageError

#: What ``data=``, ``train=``, ``validation=`` and ``test=`` take.
ACCEPTED = (
    "a path, a pandas DataFrame, a datasets Dataset / DatasetDict / IterableDataset, a dict of "
    "columns ({'text': [...], 'label': [...]}) or a (texts, labels) tuple"
)
DATAFRAME, DATASET, ITERABLE = "pandas.DataFrame", "datasets.Dataset", "datasets.IterableDataset"
COLUMNS, TUPLE = "dict of columns", "(texts, labels) tuple"
#: The names a split dictionary may give each split of a run (first found wins).
SPLIT_NAMES = {
    "train": ("train",),
    "validation": ("validation", "valid", "val", "dev", "eval"),
    "test": ("test",),
}
#: A pair tuple's second text column when no ``text_pair_column`` names it.
PAIR_COLUMN = "text_pair"


def _class_names(obj: Any, package: str) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__ if c.__module__.split(".")[0] == package}


def _is_sequence(v: Any) -> bool:
    """A column's values: a list, tuple, numpy array, pandas Series... (not a text, not a mapping)."""
    return hasattr(v, "__len__") and hasattr(v, "__getitem__") and not isinstance(v, (str, bytes, Mapping))


def table_kind(obj: Any) -> str | None:
    """The kind of one in-memory table (:data:`DATAFRAME`, :data:`DATASET`, :data:`ITERABLE`,
    :data:`COLUMNS`, :data:`TUPLE`), or None."""
    pandas, datasets = _class_names(obj, "pandas"), _class_names(obj, "datasets")
    if "DataFrame" in pandas:
        return DATAFRAME
    if "IterableDataset" in datasets:
        return ITERABLE
    if "Dataset" in datasets:
        return DATASET
    if "DatasetDict" in datasets or "IterableDatasetDict" in datasets:
        return None
    if isinstance(obj, Mapping) and obj and all(isinstance(k, str) and _is_sequence(v) for k, v in obj.items()):
        return COLUMNS
    if isinstance(obj, tuple) and len(obj) in (2, 3) and all(_is_sequence(v) for v in obj):
        return TUPLE
    return None


def split_objects(obj: Any) -> dict[str, Any] | None:
    """A ``DatasetDict`` (or a dict of tables) as the run's ``{"train": ..., "validation": ..., "test": ...}``
    (``valid`` / ``val`` / ``dev`` / ``eval`` name the validation split; other splits are not read);
    None for anything else."""
    if not isinstance(obj, Mapping) or not obj or any(table_kind(v) in (None, COLUMNS, TUPLE) for v in obj.values()):
        return None
    out = {split: next((obj[n] for n in names if n in obj), None) for split, names in SPLIT_NAMES.items()}
    if out["train"] is None:
        raise UsageError(
            f"data= got splits {sorted(obj)} and none is named 'train': name the training split 'train' "
            "(or pass train=, validation=, test=)"
        )
    return out


class DataObject:
    """An in-memory table given as ``given_as`` (``data``, ``train``, ``validation``, ``test``); read back
    from a run folder it is only its :func:`describe` (``obj`` None): such a run needs the object again.
    Equal to another when it holds the same object (or, recorded, the same description)."""

    __slots__ = ("obj", "given_as", "_description")

    def __init__(self, obj: Any = None, given_as: str = "data", *, description: Mapping | None = None):
        if obj is None and description is None:
            raise ValueError("a DataObject holds an object or a description of one")
        self.obj, self.given_as = obj, given_as
        self._description = None if description is None else dict(description)

    @property
    def kind(self) -> str:
        return (table_kind(self.obj) or "?") if self.obj is not None else str(self.description["object"])

    @property
    def stem(self) -> str:
        """A file-name word for the kind (``dataframe``, ``dataset``, ``columns``, ...), for run folder names."""
        return {COLUMNS: "columns", TUPLE: "tuple"}.get(self.kind, self.kind.split(".")[-1].lower())

    @property
    def missing(self) -> bool:
        """Only the description of the object is known (a spec read from a run folder)."""
        return self.obj is None

    @property
    def description(self) -> dict:
        """:func:`describe` of the object, computed once per ``DataObject`` (:meth:`fresh` makes a new one)."""
        if self._description is None:
            self._description = describe(self.obj)
        return self._description

    def fresh(self) -> DataObject:
        """The same object, its description to be computed again (the object may have changed)."""
        return self if self.obj is None else DataObject(self.obj, self.given_as)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DataObject):
            return NotImplemented
        if self.obj is None or other.obj is None:
            return self.obj is None and other.obj is None and self.description == other.description
        return self.obj is other.obj

    def __hash__(self) -> int:
        return id(self.obj) if self.obj is not None else hash(str(sorted(self.description.items())))

    def __str__(self) -> str:
        return f"{self.given_as}=<{self.kind}>"

    def __repr__(self) -> str:
        return f"DataObject({self}{', recorded' if self.obj is None else ''})"


def as_source(value: Any, given_as: str = "data") -> Any:
    """``value`` as a spec's data source: a path (or None) unchanged, an in-memory table as a
    :class:`DataObject`; anything else is a :class:`UsageError` naming what is accepted."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):  # a pathlib.Path: the spec (and its JSON) holds text
        return os.fspath(value)
    if isinstance(value, DataObject):
        return value if value.given_as == given_as else DataObject(value.obj, given_as, description=value._description)
    kind = table_kind(value)
    if kind is None:
        what = "a dict of splits" if split_objects_quiet(value) else type(value).__name__
        raise UsageError(f"{given_as}= takes {ACCEPTED}; got {what}")
    if kind in (COLUMNS, TUPLE):
        lengths = {len(v) for v in (value.values() if isinstance(value, Mapping) else value)}
        if len(lengths) > 1:
            raise UsageError(f"{given_as}=: a {kind} needs columns of one length; got lengths {sorted(lengths)}")
    return DataObject(value, given_as)


def split_objects_quiet(value: Any) -> bool:
    try:
        return split_objects(value) is not None
    except UsageError:
        return True


def is_description(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """Whether ``value`` is a :func:`describe` dictionary (as a run folder's JSON holds it)."""
    return isinstance(value, Mapping) and "object" in value and "fingerprint" in value


def recorded(value: Any, given_as: str = "data") -> Any:
    """A source read from a run folder's JSON: a description becomes a recorded :class:`DataObject`."""
    return DataObject(given_as=given_as, description=value) if is_description(value) else value


def record(value: Any) -> Any:
    """What a run folder records of a source: its description for an in-memory table, else the value."""
    return value.description if isinstance(value, DataObject) else value


def summary(description: Mapping) -> str:
    """``pandas.DataFrame of 120 rows (columns text, label; fingerprint 3f2a...)``, for messages."""
    rows = description.get("rows")
    cols = ", ".join(description.get("columns") or {}) or "?"
    fp = description.get("fingerprint") or "none"
    return f"{description.get('object')} of {'?' if rows is None else rows} rows (columns {cols}; fingerprint {fp})"


# ---- columns ------------------------------------------------------------------------------------


def _arrow(obj: Any, kind: str):
    """The table as one ``pyarrow.Table`` (columns as given)."""
    import pyarrow as pa

    if kind == DATAFRAME:
        return pa.Table.from_pandas(obj, preserve_index=False)
    if kind == DATASET:
        return obj.with_format("arrow")[:]
    if kind == ITERABLE:
        chunks = list(iter_chunks(obj))
        return pa.concat_tables(chunks, promote_options="default") if chunks else pa.table({})
    cols = obj if kind == COLUMNS else dict(zip(_tuple_names(len(obj)), obj))
    return pa.table({k: v.tolist() if hasattr(v, "tolist") else list(v) for k, v in cols.items()})


def _tuple_names(n: int, text: str = "text", label: str = "label", pair: str | None = None) -> list[str]:
    return [text, label] if n == 2 else [text, pair or PAIR_COLUMN, label]


def iter_chunks(dataset: Any, rows: int = 8192) -> Iterator[Any]:
    """An ``IterableDataset``, read as it goes, as ``pyarrow.Table`` chunks of up to ``rows`` rows."""
    yield from dataset.with_format("arrow").iter(batch_size=rows)


class Columns:
    """An in-memory table as the readers take a table file's rows: ``column_names``, ``len`` and each
    column as a list of Python values (missing values None). ``text`` / ``label`` / ``pair`` name a
    tuple's columns (text, label; text, pair, label), as the run's column settings do."""

    def __init__(self, source: DataObject, *, text: str = "text", label: str = "label", pair: str | None = None):
        if source.obj is None:
            raise UsageError(missing_message({source.given_as: source}))
        self.source, self.obj, self.kind = str(source), source.obj, source.kind
        self._names = _tuple_names(len(self.obj), text, label, pair) if self.kind == TUPLE else None
        self._arrow = _arrow(self.obj, ITERABLE) if self.kind == ITERABLE else None

    @property
    def column_names(self) -> list[str]:
        if self.kind == DATAFRAME:
            return [str(c) for c in self.obj.columns]
        if self.kind == DATASET:
            return list(self.obj.column_names)
        if self._arrow is not None:
            return list(self._arrow.column_names)
        return list(self.obj) if self.kind == COLUMNS else list(self._names or ())

    def __len__(self) -> int:
        if self._arrow is not None:
            return self._arrow.num_rows
        if self.kind == COLUMNS:
            return len(next(iter(self.obj.values())))
        return len(self.obj[0]) if self.kind == TUPLE else len(self.obj)

    def __getitem__(self, column: str) -> list:
        if self.kind == DATAFRAME:
            col = self.obj[column]
            return col.astype(object).where(col.notna(), None).tolist()
        if self.kind == DATASET:
            return list(self.obj[column])
        if self._arrow is not None:
            return self._arrow.column(column).to_pylist()
        values = self.obj[column] if self.kind == COLUMNS else self.obj[(self._names or []).index(column)]
        return values.tolist() if hasattr(values, "tolist") else list(values)


# ---- description and fingerprint ------------------------------------------------------------------


def describe(obj: Any) -> dict:
    """A JSON description of an in-memory table: ``object`` (its kind), ``columns`` (name -> dtype),
    ``rows`` and ``fingerprint``: ``Dataset._fingerprint`` for a ``datasets.Dataset``, else a hash of
    the content (the columns' Arrow IPC bytes). An ``IterableDataset`` has none: ``rows`` and
    ``fingerprint`` are None and ``note`` says that a resumed run cannot check it."""
    kind = table_kind(obj)
    if kind is None:
        raise UsageError(f"data= takes {ACCEPTED}; got {type(obj).__name__}")
    out: dict[str, Any] = {"object": kind}
    if kind in (DATASET, ITERABLE):
        features = obj.features or {}
        columns = {str(c): str(getattr(f, "dtype", None) or f) for c, f in features.items()}
        if kind == ITERABLE:
            return {**out, "columns": columns, "rows": None, "fingerprint": None, "note": ITERABLE_NOTE}
        return {**out, "columns": columns, "rows": len(obj), "fingerprint": obj._fingerprint}
    try:
        table = _arrow(obj, kind)
    except Exception:  # values Arrow cannot hold in one column (mixed types): hashed by their repr
        cols = Columns(DataObject(obj))
        content = {c: cols[c] for c in cols.column_names}
        fp = hashlib.blake2b(repr(sorted(content.items())).encode(), digest_size=8).hexdigest()
        columns = {c: "object" for c in content}
        rows = len(cols)
    else:
        columns = {n: str(t) for n, t in zip(table.column_names, table.schema.types)}
        fp, rows = fingerprint(table), table.num_rows
    if kind == DATAFRAME:
        columns = {str(c): str(t) for c, t in obj.dtypes.items()}
    return {**out, "columns": columns, "rows": rows, "fingerprint": fp}


ITERABLE_NOTE = "read as a stream: no fingerprint, so a resumed run cannot check that it is the same data"


def fingerprint(table: Any) -> str:
    """A hash of a ``pyarrow.Table``'s columns (names, types, values), without schema metadata: the
    same table gives the same hash in any process."""
    import pyarrow as pa

    table = table.replace_schema_metadata(None).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.blake2b(sink.getvalue().to_pybytes(), digest_size=8).hexdigest()


def missing_message(missing: Mapping[str, DataObject]) -> str:
    """One line: the objects a spec read from a run folder needs passed again, and how."""
    what = "; ".join(f"{name}= was a {summary(o.description)}" for name, o in missing.items())
    how = ", ".join(f"{name}=<that {o.kind.split('.')[-1]}>" for name, o in missing.items())
    return (
        f"this run trained on in-memory data, which a run folder does not keep ({what}): pass it again, "
        f"e.g. fh.train(spec, {how})"
    )
