"""Streamed tables (flaxheads.data.streaming): hash splits, the scan's label space and bad-row
errors against the in-memory reader's, the tokens against in-memory tokenisation, epochs that see
every row once in an order that is a pure function of (seed, epoch, step), and per-host rows."""

import json

import jax
import numpy as np
import pytest
from train_helpers import WORDS

from flaxheads.data import splits as D
from flaxheads.data import streaming as S
from flaxheads.data import tables as T

CLASSES = ("business", "sport", "politics")
#: rows in several Arrow chunks, and several shuffle windows of batches of 8
N = 3 * S.CHUNK_ROWS // 2
BUCKETS = (8, 16)


def _rows(n, seed=0, sort=False):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        c = i % 3
        words = [WORDS[(c * 9 + int(k)) % len(WORDS)] for k in rng.integers(0, 9, size=int(rng.integers(2, 14)))]
        rows.append((" ".join(words), CLASSES[c]))
    return sorted(rows, key=lambda r: r[1]) if sort else rows


def _csv(path, rows):
    path.write_text("text,label\n" + "".join(f"{t},{lab}\n" for t, lab in rows))
    return str(path)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    return {"file": _csv(d / "big.csv", _rows(N)), "dir": d}


@pytest.fixture(scope="module")
def tok(tiny_bert):
    from flaxheads.interop.tokenizers import load_tokenizer

    return load_tokenizer(tiny_bert)


def _cfg(data, **kw):
    return D.DataConfig(data=data, stream=True, **kw)


def test_hash_split_partitions_the_rows_and_is_stable(big):
    sd = S.open_stream(_cfg(big["file"], split=(0.7, 0.2, 0.1), seed=3))
    assert sum(sd.counts.values()) == N
    for name, frac in zip(D.SPLITS, (0.7, 0.2, 0.1)):
        assert abs(sd.counts[name] / N - frac) < 0.02
    seen = {}
    for name, src in sd.sources.items():
        rows = np.concatenate([r for _, r, _ in S.source_rows(src)])
        assert len(rows) == sd.counts[name]
        seen[name] = set(rows.tolist())
    assert set.union(*seen.values()) == set(range(1, N + 1)) and sum(map(len, seen.values())) == N
    again = S.open_stream(_cfg(big["file"], split=(0.7, 0.2, 0.1), seed=3))
    assert again.counts == sd.counts
    other = S.open_stream(_cfg(big["file"], split=(0.7, 0.2, 0.1), seed=4))
    assert other.counts != sd.counts
    # chunking does not move a row: the hash is of (seed, file, row number)
    u = S.row_hash(3, 0, np.arange(1, 101))
    assert np.array_equal(np.concatenate([S.row_hash(3, 0, np.arange(1, 51)), S.row_hash(3, 0, np.arange(51, 101))]), u)


@pytest.mark.parametrize("kind", ["names", "ids", "floats", "lists"])
def test_scan_finds_the_label_space_the_in_memory_reader_infers(tmp_path, kind):
    rows = _rows(40)
    value = {
        "names": lambda i, c: c,
        "ids": lambda i, c: CLASSES.index(c) * 2,
        "floats": lambda i, c: i / 7,
        "lists": lambda i, c: [c] + (["urgent"] if i % 4 == 0 else []),
    }[kind]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": value(i, c)}) + "\n" for i, (t, c) in enumerate(rows)))
    want = T.infer_label_space(T.load_table(path))
    got = S.open_stream(D.DataConfig(train_file=str(path), stream=True)).space
    assert got == want
    if kind == "ids":
        want = T.infer_label_space(T.load_table(path), label_ids=True)
        assert S.open_stream(D.DataConfig(train_file=str(path), stream=True, label_ids=True)).space == want


def _in_memory_error(path, **kw) -> str:
    with pytest.raises(T.DataError) as e:
        D.load_splits(D.DataConfig(train_file=path, **kw))
    return str(e.value)


def _stream_error(path, **kw) -> str:
    with pytest.raises(T.DataError) as e:
        S.open_stream(D.DataConfig(train_file=path, stream=True, **kw))
    return str(e.value)


@pytest.mark.parametrize("bad", ["empty text", "no label", "mixed kinds"])
def test_bad_row_deep_in_a_large_file_gives_the_in_memory_message(tmp_path, bad):
    rows = [list(r) for r in _rows(N)]
    at = N - 5  # in the last chunk
    if bad == "empty text":
        rows[at][0] = " "
    elif bad == "no label":
        rows[at][1] = ""
    path = tmp_path / "bad.jsonl"
    path.write_text(
        "".join(
            json.dumps({"text": t, "label": (7 if bad == "mixed kinds" and i == at else c)}) + "\n"
            for i, (t, c) in enumerate(rows)
        )
    )
    got = _stream_error(str(path))
    assert f"row {at + 1}" in got and str(path) in got
    assert got == _in_memory_error(str(path))


def test_missing_column_names_its_flag_as_in_memory(tmp_path):
    path = _csv(tmp_path / "d.csv", _rows(10))
    for flag in ("label_column", "text_column", "text_pair_column"):
        got = _stream_error(path, **{flag: "nope"})
        assert got == _in_memory_error(path, **{flag: "nope"})
        assert "--" + flag.replace("_", "-") in got


def test_unknown_label_in_the_validation_file_and_labels_flag(tmp_path):
    tr = _csv(tmp_path / "tr.csv", _rows(30))
    va = _csv(tmp_path / "va.csv", _rows(20) + [("alpha beta", "weather")])
    got = _stream_error(tr, validation_file=va)
    assert got == _in_memory_error(tr, validation_file=va)
    assert "row 21, column 'label': label 'weather' appears only in the validation split" in got
    sd = S.open_stream(D.DataConfig(train_file=tr, stream=True, labels=("sport", "politics", "business")))
    assert sd.space.names == ["sport", "politics", "business"]
    got = _stream_error(tr, labels=("sport", "business"))
    assert "label 'politics' is not among --labels" in got and "row 3" in got


def test_tokens_and_labels_equal_the_in_memory_path(big, tok):
    sd = S.open_stream(_cfg(big["file"], split=(0.8, 0.1, 0.1), eval_limit=300))
    splits = sd.splits(tok, 16)
    table = T.load_table(big["file"])
    space = T.infer_label_space(table)
    assert sd.space == space
    src = sd.sources["test"]
    rows = np.concatenate([r for _, r, _ in S.source_rows(src)])
    want = D.tokenize(table.take(rows - 1), T.encode_labels(table.take(rows - 1), space), tok, 16)
    got = [b for b in S.ordered_batches(splits["test"], 64, BUCKETS)]
    ids = [x[m > 0] for b in got for x, m, w in zip(b["input_ids"], b["attention_mask"], b["weights"]) if w > 0]
    assert len(ids) == len(want) == sd.counts["test"]
    assert all(np.array_equal(a, b) for a, b in zip(ids, want.input_ids))
    assert np.array_equal(np.concatenate([b["labels"][b["weights"] > 0] for b in got]), want.labels)
    # the evaluation sample: exactly eval_limit validation rows, every class although the file's
    # classes cycle (a sorted file is the test below)
    assert len(splits["validation"]) == 300 and set(splits["validation"].labels.tolist()) == {0, 1, 2}


def test_sample_of_a_sorted_file_is_spread_over_it(tmp_path, tok):
    path = _csv(tmp_path / "sorted.csv", _rows(3000, sort=True))
    sd = S.open_stream(_cfg(path, split=(0.5, 0.5, 0.0), eval_limit=90))
    labels = T.encode_labels(sd.samples["validation"], sd.space)
    assert len(labels) == 90 and np.bincount(labels).min() >= 15


def _epoch(split, bs=8, **kw):
    return list(S.stream_batches(split, bs, BUCKETS, **kw))


def test_an_epoch_sees_every_row_once_and_resumes_mid_epoch(big, tok):
    sd = S.open_stream(_cfg(big["file"], split=(1.0, 0.0, 0.0)))
    train = sd.splits(tok, 16)["train"]
    train.window_batches = 4  # many windows
    n = len(train)
    a = _epoch(train, seed=1, epoch=0)
    assert len(a) == -(-n // 8)
    assert sum(int(b["weights"].sum()) for b in a) == n
    # each row once: the multiset of token sequences equals the file's
    seqs = sorted(
        tuple(x[m > 0].tolist())
        for b in a
        for x, m, w in zip(b["input_ids"], b["attention_mask"], b["weights"])
        if w > 0
    )
    want = sorted(
        tuple(np.asarray(x).tolist())
        for x in tok([t for t, _ in _rows(N)], truncation=True, max_length=16, padding=False)["input_ids"]
    )
    assert seqs == want
    # a pure function of (seed, epoch, start): from batch 13 (mid window 3) on, the same batches
    tail = _epoch(train, seed=1, epoch=0, start=13)
    assert len(tail) == len(a) - 13
    for x, y in zip(a[13:], tail):
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
    b = _epoch(train, seed=1, epoch=1)
    assert not all(
        np.array_equal(x["input_ids"], y["input_ids"])
        for x, y in zip(a, b)
        if x["input_ids"].shape == y["input_ids"].shape
    )
    # grouping by length pads less than the same rows ungrouped
    flat = _epoch(train, seed=1, epoch=0, group_by_length=False)
    assert sum(x["input_ids"].size for x in a) < sum(x["input_ids"].size for x in flat)


def test_each_process_tokenizes_and_holds_only_its_rows(big, tok, monkeypatch):
    sd = S.open_stream(_cfg(big["file"], split=(0.9, 0.1, 0.0)))
    train = sd.splits(tok, 16)["train"]
    single = _epoch(train, seed=2, epoch=1, start=5)
    from flaxheads.runtime.parallel import process_rows

    calls = []

    class Counting:
        def __call__(self, texts, *a, **kw):
            calls.append(len(texts))
            return tok(texts, *a, **kw)

    for p in range(2):
        calls.clear()
        lengths = iter([b["input_ids"].shape[1] for b in single])  # what the all-gather agrees on
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        monkeypatch.setattr(jax, "process_index", lambda p=p: p)
        monkeypatch.setattr(S.batches, "agreed_length", lambda local: next(lengths))
        mine = S.StreamSplit(train.name, train.source, train.n, train.space, Counting(), train.max_length)
        got = _epoch(mine, seed=2, epoch=1, start=5)
        assert len(got) == len(single)
        for g, s in zip(got, single):
            want = process_rows(s, p, 2)
            local = process_rows(g, p, 2)
            assert local.keys() == want.keys() and all(np.array_equal(local[k], want[k]) for k in want)
        # half of the rows (of the batches from the start on), no more
        assert sum(calls) == sum(int(process_rows(s, p, 2)["weights"].sum()) for s in single)
    monkeypatch.undo()


def _examples(batch) -> list:
    """(tokens, label) of every real example of a batch, packed or not, sorted."""
    if "segment_ids" not in batch:
        return sorted(
            (tuple(x[m > 0].tolist()), int(y))
            for x, m, w, y in zip(batch["input_ids"], batch["attention_mask"], batch["weights"], batch["labels"])
            if w > 0
        )
    rows, slots, _ = batch["segment_index"].shape
    return sorted(
        (
            tuple(batch["input_ids"][r, batch["segment_index"][r, s][batch["segment_mask"][r, s] > 0]].tolist()),
            int(batch["labels"][r, s]),
        )
        for r in range(rows)
        for s in range(slots)
        if batch["weights"][r, s] > 0
    )


def test_packed_stream_holds_the_unpacked_batches_and_resumes(tmp_path, tok, monkeypatch):
    path = _csv(tmp_path / "short.csv", _rows(300))
    train = S.open_stream(_cfg(path, split=(1.0, 0.0, 0.0))).splits(tok, 16)["train"]
    train.window_batches = 4
    plain = _epoch(train, seed=3, epoch=0)
    packed = _epoch(train, seed=3, epoch=0, pack=True, row_multiple=2)
    assert len(packed) == len(plain)
    for p, q in zip(packed, plain):
        assert _examples(p) == _examples(q) and len(p["input_ids"]) % 2 == 0
    assert sum(b["input_ids"].size for b in packed) < sum(b["input_ids"].size for b in plain)
    tail = _epoch(train, seed=3, epoch=0, start=6, pack=True, row_multiple=2)  # mid-window: same shapes too
    for x, y in zip(packed[6:], tail):
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)

    # two processes: each packs its rows of a batch into its block of rows, in the shape both agree on
    own: dict[int, list] = {0: [], 1: []}
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for p in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda p=p: p)
        monkeypatch.setattr(S.batches, "agreed_shape", lambda shape, p=p: own[p].append(shape) or shape)
        _epoch(train, seed=3, epoch=0, pack=True, row_multiple=2)
    halves = []
    for p in (0, 1):
        agreed = iter([tuple(map(max, a, b)) for a, b in zip(own[0], own[1])])
        monkeypatch.setattr(jax, "process_index", lambda p=p: p)
        monkeypatch.setattr(S.batches, "agreed_shape", lambda shape: next(agreed))
        halves.append(_epoch(train, seed=3, epoch=0, pack=True, row_multiple=2))
    for a, b, whole in zip(*halves, plain):
        assert a["input_ids"].shape == b["input_ids"].shape
        k = len(a["input_ids"]) // 2
        assert not a["weights"][k:].any() and not b["weights"][:k].any()  # each fills only its own block
        assert sorted(_examples(a) + _examples(b)) == _examples(whole)


def test_shards_glob_and_file_order_per_epoch(tmp_path, tok):
    rows = _rows(600)
    d = tmp_path / "shards"
    d.mkdir()
    for k in range(3):
        _csv(d / f"part-{k}.csv", rows[k * 200 : (k + 1) * 200])
    assert S.streams(str(d / "part-*.csv"), None) and not S.streams(str(d / "part-0.csv"), None)
    sd = S.open_stream(_cfg(str(d / "part-*.csv"), split=(1.0, 0.0, 0.0)))
    assert sd.counts["train"] == 600 and sd.sources["train"].files == tuple(str(d / f"part-{k}.csv") for k in range(3))
    train = sd.splits(tok, 16)["train"]
    orders = {tuple(S.batches._epoch_order(3, 0, e, True)) for e in range(6)}
    assert len(orders) > 1  # the shards are read in another order in another epoch
    assert sum(int(b["weights"].sum()) for b in _epoch(train, bs=16, epoch=3)) == 600
    with pytest.raises(T.DataError, match="no such file matches"):
        S.table_files(str(d / "nothing-*.csv"))


def test_labels_and_eval_limit_in_memory_too(tmp_path):
    path = _csv(tmp_path / "d.csv", _rows(300))
    tables, space, labels = D.load_splits(
        D.DataConfig(data=path, labels=("sport", "politics", "business"), eval_limit=12)
    )
    assert space.names == ["sport", "politics", "business"]
    full, _, _ = D.load_splits(D.DataConfig(data=path))
    assert len(tables["validation"]) == 12 and len(full["validation"]) == 30
    assert set(tables["validation"].texts) <= set(full["validation"].texts)  # a sample of the same split
    assert len(tables["test"]) == len(full["test"])  # the test split stays whole
    assert [space.names[i] for i in labels["train"]] == tables["train"].labels


def test_closing_the_batches_stops_the_reader_and_errors_reach_the_loop(big, tok):
    import threading

    train = S.open_stream(_cfg(big["file"], split=(1.0, 0.0, 0.0))).splits(tok, 16)["train"]
    it = S.stream_batches(train, 8, BUCKETS)
    next(it)
    it.close()
    assert not any(t.name == "flaxheads-stream" and t.is_alive() for t in threading.enumerate())

    def broken(*a, **kw):
        raise T.DataError("bad.csv: row 3, column 'text': text is empty")

    train.tokenizer = broken
    with pytest.raises(T.DataError, match="row 3"):
        next(S.stream_batches(train, 8, BUCKETS))
