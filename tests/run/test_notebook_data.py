"""Runs on the data objects a notebook holds: ``fh.train`` given a pandas DataFrame, a ``datasets``
Dataset / DatasetDict, a dict of columns or a ``(texts, labels)`` tuple trains exactly as on the same
rows written to files by pandas' and ``datasets``' own writers; a run interrupted and called again with
the same object resumes bitwise; other data on that folder is refused; a spec read back from the
folder says which object it needs."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from run_helpers import TOPICS, metrics_rows

import flaxheads as fh
from flaxheads.errors import UsageError
from flaxheads.run.data import run_split
from flaxheads.training.loop import hooks
from flaxheads.training.preemption import Interrupted

pd = pytest.importorskip("pandas")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.full

SETTINGS = dict(max_length=16, bucket_step=16, batch_size=4, max_steps=6, eval_every=3, log_every=1, lr=3e-3, keep=2)


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    labels = [f"c{i % 3}" for i in range(40)]
    texts = [" ".join(rng.choice(TOPICS[int(c[1])], int(rng.integers(3, 9)))) for c in labels]
    return pd.DataFrame({"text": texts, "label": labels})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_bert, frame):
    """The same rows trained from a CSV file pandas wrote and from the DataFrame itself."""
    d = tmp_path_factory.mktemp("notebook")
    frame.to_csv(d / "news.csv", index=False)
    base = dict(SETTINGS, model=tiny_bert, split=(0.6, 0.2, 0.2))
    csv = fh.train(**base, data=str(d / "news.csv"), output_dir=str(d / "csv"), progress=False)
    df = fh.train(**base, data=frame, output_dir=str(d / "frame"), progress=False)
    return {"dir": d, "base": base, "csv": csv, "frame": df}


def test_a_dataframe_trains_as_the_csv_pandas_writes(runs, frame):
    d = runs["dir"]
    assert metrics_rows(d / "frame") == metrics_rows(d / "csv")
    assert runs["frame"].metrics == runs["csv"].metrics
    recorded = _config(d / "frame")
    # the folder records the object by its description: kind, columns, rows, a fingerprint
    want = {"object": "pandas.DataFrame", "rows": 40, "columns": {c: str(t) for c, t in frame.dtypes.items()}}
    for where in (recorded["data"]["data"], recorded["spec"]["data"]["data"]):
        assert {k: where[k] for k in want} == want and len(where["fingerprint"]) == 16
    assert recorded["sizes"] == _config(d / "csv")["sizes"]
    # the report's resume line asks for the same table again; a run from a file needs nothing more
    assert "data=&lt;the same pandas.DataFrame&gt;" in (d / "frame" / "report.html").read_text()
    assert "=&lt;the same" not in (d / "csv" / "report.html").read_text()
    with pytest.raises(UsageError, match="trained on in-memory data .*give --input with a labelled file"):
        run_split(d / "frame", "test")  # what `flaxheads predict --split test` rebuilds from a folder


@pytest.mark.parametrize("kind", ["dataset", "columns", "tuple"])
def test_every_kind_trains_as_the_dataframe(runs, frame, kind):
    made = {
        "dataset": lambda: datasets.Dataset.from_pandas(frame),
        "columns": lambda: {"text": frame.text.tolist(), "label": frame.label.to_numpy()},
        "tuple": lambda: (frame.text.tolist(), frame.label.tolist()),
    }
    out = runs["dir"] / kind
    run = fh.train(**runs["base"], data=made[kind](), output_dir=str(out), progress=False)
    assert metrics_rows(out) == metrics_rows(runs["dir"] / "frame")
    assert run.metrics == runs["frame"].metrics


def test_a_dataset_dict_gives_its_own_splits(runs, frame):
    """``data=DatasetDict``: its train / validation / test are the run's (a ``dev`` split is the validation
    one), the same run as the three CSV files ``datasets`` writes of them."""
    d, full = runs["dir"], datasets.Dataset.from_pandas(frame)
    parts = {"train": full.select(range(24)), "dev": full.select(range(24, 32)), "test": full.select(range(32, 40))}
    for name, part in parts.items():
        part.to_csv(d / f"{name}.csv", index=False)
    base = {k: v for k, v in runs["base"].items() if k != "split"}
    files = fh.train(
        **base,
        train=str(d / "train.csv"),
        validation=str(d / "dev.csv"),
        test_file=str(d / "test.csv"),
        output_dir=str(d / "dd_files"),
        progress=False,
    )
    run = fh.train(**base, data=datasets.DatasetDict(parts), output_dir=str(d / "dd"), progress=False)
    assert metrics_rows(d / "dd") == metrics_rows(d / "dd_files")
    assert run.metrics == files.metrics
    cfg = _config(d / "dd")
    assert cfg["sizes"] == {"train": 24, "validation": 8, "test": 8}
    assert cfg["data"]["validation_file"]["fingerprint"] == parts["dev"]._fingerprint
    assert run.spec.data.data is None


def test_a_ranking_dataset_trains_as_its_file(runs, tiny_bert):
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(24):
        a, b = rng.choice(len(TOPICS), 2, replace=False)
        rows.append(
            {
                "prompt": " ".join(rng.choice(TOPICS[a], 3)),
                "chosen": " ".join(rng.choice(TOPICS[a], 5)),
                "rejected": " ".join(rng.choice(TOPICS[b], 5)),
            }
        )
    ds = datasets.Dataset.from_list(rows)
    d = runs["dir"]
    ds.to_json(d / "pref.jsonl")
    base = dict(runs["base"], objective="pairwise", split=(0.5, 0.25, 0.25))
    file_run = fh.train(**base, data=str(d / "pref.jsonl"), output_dir=str(d / "rank_file"), progress=False)
    run = fh.train(**base, data=ds, output_dir=str(d / "rank"), progress=False)
    assert metrics_rows(d / "rank") == metrics_rows(d / "rank_file")
    assert run.metrics == file_run.metrics and "pairwise_accuracy" in run.metrics["test"]
    assert _config(d / "rank")["data"]["data"]["fingerprint"] == ds._fingerprint


def test_interrupted_then_given_the_same_frame_resumes_bitwise(runs, frame):
    """A spec read back from the folder names the DataFrame it needs; given it again, the run resumes
    and logs what the uninterrupted run logged; another DataFrame on that folder is refused."""
    d = runs["dir"]
    out = d / "interrupted"

    def interrupt(state, step, metrics):
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)  # what a notebook's interrupt button sends

    with pytest.raises(Interrupted):
        fh.train(
            **runs["base"], data=frame, output_dir=str(out), progress=False, callbacks=[hooks(on_step_end=interrupt)]
        )
    spec = fh.RunSpec.from_run(out)
    recorded = _config(out)["data"]["data"]
    assert spec.needs_data == {"data": recorded}
    with pytest.raises(UsageError) as needs:
        fh.train(spec, progress=False)
    message = str(needs.value)
    assert "\n" not in message and "data=<that DataFrame>" in message
    assert "pandas.DataFrame of 40 rows" in message and recorded["fingerprint"] in message
    assert fh.RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec

    other = frame.copy()
    other.loc[3, "text"] = "alpha beta"
    before = sorted(os.listdir(out))
    with pytest.raises(UsageError) as refused:
        fh.train(spec, data=other, progress=False)
    message = str(refused.value)
    assert "\n" not in message and "holds a run trained on data=pandas.DataFrame of 40 rows" in message
    assert recorded["fingerprint"] in message and "a new output_dir" in message
    assert sorted(os.listdir(out)) == before

    again = fh.train(spec, data=frame, progress=False)
    assert again.summary["resumed_from"] == 4
    assert metrics_rows(out) == metrics_rows(d / "frame")


def test_a_wrong_type_is_one_line_naming_what_is_accepted(tmp_path):
    for bad, name in ((42, "data"), ({"a", "b"}, "validation")):
        with pytest.raises(UsageError) as e:
            fh.train(**{name: bad}, output_dir=str(tmp_path / "r"))
        assert "\n" not in str(e.value) and f"{name}= takes a path, a pandas DataFrame" in str(e.value)
    assert not (tmp_path / "r").exists()


def test_a_data_spec_made_directly_may_hold_the_table(frame):
    from flaxheads.run.checks import check_spec
    from flaxheads.run.spec import DataSpec

    spec = check_spec(fh.RunSpec(data=DataSpec(data=frame)))
    assert spec.data.data.obj is frame and spec.run_folder().name.endswith("-dataframe")
    dd = datasets.DatasetDict(train=datasets.Dataset.from_pandas(frame))
    spec = check_spec(fh.RunSpec(data=DataSpec(data=dd)))
    assert spec.data.data is None and spec.data.train_file.obj is dd["train"]
