"""In-memory tables as data (flaxheads.data.objects): every kind reads as the same rows written to a file
by pandas' or ``datasets``' own writers; descriptions are stable across processes and change with the
content; a wrong type is one line naming what is accepted."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from flaxheads.data.groups import load_group_table, load_groups
from flaxheads.data.objects import DataObject, as_source, describe, split_objects
from flaxheads.data.splits import DataConfig
from flaxheads.data.streaming import open_stream, split_table
from flaxheads.data.tables import DataError, load_source, load_table, object_table
from flaxheads.errors import UsageError
from flaxheads.run.spec import RunSpec

pd = pytest.importorskip("pandas")
datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def frame():
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta red green blue stock bank goal".split()
    return pd.DataFrame(
        {
            "text": [" ".join(rng.choice(words, 4)) for _ in range(30)],
            "pair": [" ".join(rng.choice(words, 3)) for _ in range(30)],
            "label": [f"c{i % 3}" for i in range(30)],
        }
    )


@pytest.fixture(scope="module")
def csv_table(frame, tmp_path_factory):
    path = tmp_path_factory.mktemp("objects") / "rows.csv"
    frame.to_csv(path, index=False)
    return load_table(path, text_pair_column="pair")


def _same_rows(a, b):
    assert a.texts == b.texts and a.labels == b.labels and a.pairs == b.pairs and a.rows == b.rows


@pytest.mark.parametrize("kind", ["frame", "dataset", "iterable", "columns", "numpy columns", "tuple"])
def test_every_kind_reads_as_the_file_pandas_writes(frame, csv_table, kind):
    made = {
        "frame": lambda: frame,
        "dataset": lambda: datasets.Dataset.from_pandas(frame),
        "iterable": lambda: datasets.Dataset.from_pandas(frame).to_iterable_dataset(),
        "columns": lambda: {c: frame[c].tolist() for c in frame.columns},
        "numpy columns": lambda: {c: frame[c].to_numpy() for c in frame.columns},
        "tuple": lambda: (frame.text.tolist(), frame.pair.tolist(), frame.label.tolist()),
    }
    got = load_source(as_source(made[kind]()), text_pair_column="pair")
    _same_rows(got, csv_table)
    assert got.source == f"data=<{as_source(made[kind]()).kind}>"


def test_columns_are_found_as_for_files(frame):
    renamed = frame.rename(columns={"text": "sentence", "label": "y"})
    t = object_table(as_source(renamed, "train"), text_column="sentence", label_column="y")
    assert t.texts == frame.text.tolist() and t.labels == frame.label.tolist()
    with pytest.raises(DataError, match=r"train=<pandas.DataFrame>: no column 'text' .* choose one with text_column="):
        object_table(as_source(renamed, "train"))
    # a (texts, labels) tuple's columns are the ones the settings name
    t = object_table(as_source((frame.text.tolist(), frame.label.tolist())), text_column="s", label_column="y")
    assert t.texts == frame.text.tolist() and t.text_column == "s"


def test_a_missing_text_names_the_row(frame):
    bad = frame.copy()
    bad.loc[4, "text"] = None
    with pytest.raises(DataError, match=r"data=<pandas.DataFrame>: row 5, column 'text': text is missing"):
        load_source(as_source(bad))


def test_ranking_groups_read_as_the_file(tmp_path):
    pref = pd.DataFrame(
        {"prompt": ["a b", "c d", "e f"], "chosen": ["x y", "z w", "u v"], "rejected": ["q r", "s t", "o p"]}
    )
    pref.to_json(tmp_path / "pref.jsonl", orient="records", lines=True)
    want = load_group_table(tmp_path / "pref.jsonl")
    for obj in (pref, datasets.Dataset.from_pandas(pref), pref.to_dict(orient="list")):
        got = load_groups(as_source(obj))
        assert (got.queries, got.candidates, got.labels, got.kind) == (
            want.queries,
            want.candidates,
            want.labels,
            want.kind,
        )


def test_an_iterable_dataset_streams_as_the_file(frame, tmp_path):
    ds = datasets.Dataset.from_pandas(frame)
    ds.to_json(tmp_path / "rows.jsonl")
    opts = dict(split=(0.6, 0.2, 0.2), seed=3, eval_limit=4)
    from_file = DataConfig(data=str(tmp_path / "rows.jsonl"), stream=True, **opts)
    from_object = DataConfig(data=as_source(ds.to_iterable_dataset()), **opts)
    a, b = open_stream(from_file), open_stream(from_object)
    assert a.counts == b.counts and a.space == b.space
    _same_rows_but_source(a.samples["validation"], b.samples["validation"])
    _same_rows_but_source(split_table(from_file, "test"), split_table(from_object, "test"))


def _same_rows_but_source(a, b):
    assert a.texts == b.texts and a.labels == b.labels and a.rows == b.rows


def test_a_description_is_stable_and_follows_the_content(frame):
    d = describe(frame)
    assert d["object"] == "pandas.DataFrame" and d["rows"] == 30
    assert d["columns"] == {c: str(t) for c, t in frame.dtypes.items()}
    assert describe(frame.copy()) == d  # the content, not the object
    code = (
        "import json, sys, pandas as pd; from flaxheads.data.objects import describe; "
        "print(json.dumps(describe(pd.read_json(sys.stdin, orient='split'))))"
    )
    other_process = subprocess.run(
        [sys.executable, "-c", code], input=frame.to_json(orient="split"), capture_output=True, text=True, check=True
    )
    assert json.loads(other_process.stdout) == d
    changed = frame.copy()
    changed.loc[7, "label"] = "c0" if changed.loc[7, "label"] != "c0" else "c1"
    assert describe(changed)["fingerprint"] != d["fingerprint"]
    assert describe(frame.iloc[::-1])["fingerprint"] != d["fingerprint"]  # row order is content too
    columns = {c: frame[c].tolist() for c in frame.columns}
    assert describe(columns)["fingerprint"] == describe(dict(columns))["fingerprint"]
    assert describe({**columns, "text": columns["text"][::-1]})["fingerprint"] != describe(columns)["fingerprint"]


def test_a_dataset_is_described_by_its_own_fingerprint(frame):
    ds = datasets.Dataset.from_pandas(frame)
    d = describe(ds)
    assert d["fingerprint"] == ds._fingerprint and d["rows"] == 30 and list(d["columns"]) == ds.column_names
    mapped = ds.map(lambda r: {"text": r["text"].upper()})
    assert describe(mapped)["fingerprint"] == mapped._fingerprint != d["fingerprint"]
    it = describe(ds.to_iterable_dataset())
    assert it["fingerprint"] is None and it["rows"] is None and "cannot check" in it["note"]


def test_a_dataset_dict_is_the_run_splits(frame):
    ds = datasets.Dataset.from_pandas(frame)
    dd = datasets.DatasetDict(train=ds.select(range(20)), dev=ds.select(range(20, 25)), unsupervised=ds)
    spec = RunSpec.from_kwargs(data=dd)
    d = spec.data
    assert d.data is None and d.test_file is None
    assert d.train_file.obj is dd["train"] and d.validation_file.obj is dd["dev"]
    assert str(d.validation_file) == "validation=<datasets.Dataset>"
    assert split_objects({"train": frame, "valid": frame})["validation"] is frame
    with pytest.raises(UsageError, match=r"data= got splits \['dev', 'test'\] and none is named 'train'"):
        RunSpec.from_kwargs(data=datasets.DatasetDict(dev=ds, test=ds))
    with pytest.raises(UsageError, match="give one or the other"):
        RunSpec.from_kwargs(validation=ds, data=dd)


def test_the_spec_json_holds_descriptions(frame):
    spec = RunSpec.from_kwargs(train=frame, validation_file=(["a b"], ["c0"]), max_length=32)
    assert spec.data.train_file == as_source(frame, "train") and spec.data.train_file.obj is frame
    d = spec.to_dict()
    assert d["data"]["train_file"] == describe(frame) and d["data"]["validation_file"]["rows"] == 1
    back = RunSpec.from_dict(json.loads(json.dumps(d)))
    assert back.data.train_file.missing and back.data.train_file.description == describe(frame)
    assert back == RunSpec.from_dict(d) and back.to_dict() == d
    assert back.replace(train=frame).data.train_file.obj is frame
    assert isinstance(spec.data.train_file, DataObject) and spec.run_folder().name.endswith("-dataframe")
    assert RunSpec.from_kwargs(data=(["a"], ["b"])).run_folder().name.endswith("-tuple")


@pytest.mark.parametrize(
    "value,needle",
    [
        (42, "got int"),
        ({"a", "b"}, "got set"),
        ({"text": "not a column"}, "got dict"),
        ((["a"], ["b"], ["c"], ["d"]), "got tuple"),
    ],
)
def test_a_wrong_type_is_one_line(value, needle):
    with pytest.raises(UsageError) as e:
        RunSpec.from_kwargs(test=value)
    assert "\n" not in str(e.value) and str(e.value).startswith("test= takes a path, a pandas DataFrame")
    assert str(e.value).endswith(needle)


def test_columns_of_different_lengths_are_refused():
    with pytest.raises(UsageError, match=r"data=: a dict of columns needs columns of one length; got lengths \[1, 2\]"):
        as_source({"text": ["a", "b"], "label": [1]})
    with pytest.raises(UsageError, match="train= and train_file= are one setting"):
        RunSpec.from_kwargs(train="a.csv", train_file="b.csv")
