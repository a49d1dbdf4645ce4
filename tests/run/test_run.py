"""A run as a library call: ``fh.train`` with the settings of a ``flaxheads train`` command makes the
same run folder with bitwise-equal logged losses and metrics, for classification and a ranking
objective; a run interrupted from Python (SIGINT, as a notebook's interrupt sends) and called again
resumes bitwise; the spec round-trips through the run's config.json; ``fh.load`` / ``fh.export``
read and write what the run saved."""

from __future__ import annotations

import csv
import gc
import json
import os
import signal

import jax
import numpy as np
import pytest
from run_helpers import TOPICS, metrics_rows, write_news
from train_helpers import tiny_bert_folder

import flaxheads as fh
from flaxheads.errors import UsageError
from flaxheads.training.preemption import Interrupted

pytestmark = pytest.mark.full

#: One setting, two spellings: the command's flags and the library's keywords.
SETTINGS = {
    "max_length": 16,
    "bucket_step": 16,
    "batch_size": 4,
    "max_steps": 6,
    "eval_every": 3,
    "log_every": 1,
    "lr": 3e-3,
    "keep": 2,
}


def _argv(settings: dict) -> list[str]:
    return [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def _config(path) -> dict:
    c = json.loads((path / "config.json").read_text())
    for k in ("argv",):
        c.pop(k)
    c["spec"]["checkpoints"].pop("output_dir")
    return c


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    write_news(d / "news.csv", rng)
    with open(d / "pref.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "chosen", "rejected"])
        for _ in range(32):
            a, b = rng.choice(len(TOPICS), 2, replace=False)
            w.writerow(
                [
                    " ".join(rng.choice(TOPICS[a], 3)),
                    " ".join(rng.choice(TOPICS[a], 5)),
                    " ".join(rng.choice(TOPICS[b], 5)),
                ]
            )
    return {
        "bert": tiny_bert_folder(d / "bert", num_labels=3),
        "news": str(d / "news.csv"),
        "pref": str(d / "pref.csv"),
        "dir": d,
    }


@pytest.fixture(scope="module")
def classification(files):
    """The same run from the command and from Python."""
    from flaxheads.cli.main import main

    d = files["dir"]
    base = dict(SETTINGS, model=files["bert"], data=files["news"])
    assert main(["train", *_argv(base), "--no-progress", "--output-dir", str(d / "cli")]) == 0
    live = {}
    earlier = {id(x): x for x in jax.live_arrays()}  # this process's other arrays (held: their ids stay theirs)

    def after_first_step(state, step, metrics):
        if step == 1:
            gc.collect()  # arrays only a reference cycle still holds are not the run's
            run = [x for x in jax.live_arrays() if id(x) not in earlier]
            live.update(params=_bytes(state.params), state=_bytes(state), all=_bytes(run))

    run = fh.train(
        **base,
        output_dir=str(d / "lib"),
        progress=False,
        callbacks=[fh.training.loop.hooks(on_step_end=after_first_step)],
    )
    return d / "cli", d / "lib", run, base, live


def _bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if not x.is_deleted())


def test_a_run_holds_its_params_once(classification):
    """The state takes the loaded model's device arrays instead of copying them: after the first step
    the run's arrays are the state and small buffers (batch, metrics), not a second copy of the params."""
    live = classification[-1]
    assert live["params"] > 0 and live["all"] - live["state"] < 0.25 * live["params"], live


def test_a_python_run_equals_the_command(classification):
    cli, lib, run, *_ = classification
    assert metrics_rows(cli) == metrics_rows(lib)
    assert _config(cli) == _config(lib)
    for name in ("summary.json", "eval.txt", "predictions.npz", "curve.png", "confusion_matrix.png"):
        assert (lib / name).is_file(), name
    cli_summary = json.loads((cli / "summary.json").read_text())
    assert cli_summary["metrics"] == run.metrics and run.summary["steps"] == 6
    assert sorted(os.listdir(cli / "checkpoints")) == sorted(os.listdir(lib / "checkpoints"))
    a, b = np.load(cli / "predictions.npz"), np.load(lib / "predictions.npz")
    np.testing.assert_array_equal(a["test_logits"], b["test_logits"])


def test_the_spec_round_trips_through_the_run_folder(classification):
    _, lib, run, base, _ = classification
    spec = fh.RunSpec.from_run(lib)
    assert spec == run.spec.replace(output_dir=str(lib))
    assert spec.optim.max_steps == 6 and spec.data.max_length == 16 and spec.model.model == base["model"]
    assert fh.RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert fh.RunSpec.from_kwargs(**spec.flat()) == spec


def test_interrupted_from_python_and_called_again_resumes_bitwise(classification, files):
    _, lib, _, base, _ = classification
    out = files["dir"] / "interrupted"

    def interrupt(state, step, metrics):
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C or a notebook's interrupt button sends

    with pytest.raises(Interrupted) as caught:
        fh.train(**base, output_dir=str(out), progress=False, callbacks=[fh.training.loop.hooks(on_step_end=interrupt)])
    assert caught.value.saved == 4
    again = fh.train(fh.RunSpec.from_run(out), progress=False)
    assert again.summary["resumed_from"] == 4
    assert metrics_rows(out) == metrics_rows(lib)


def test_load_and_export_what_the_run_saved(classification, tmp_path):
    _, lib, run, *_ = classification
    ids = np.array([[101, 40, 41, 42, 102, 0]], np.int32)
    mask = (ids != 0).astype(np.int32)

    def logits(model):  # jitted: the three models are one program (eagerly ~110 per model's operations)
        return np.asarray(jax.jit(model.apply)(model.params, ids, mask))

    want = logits(run.model)
    loaded = fh.load(lib)
    np.testing.assert_array_equal(logits(loaded), want)
    head = fh.export(loaded, tmp_path / "head", format="head")
    again = fh.load(head, backbone=run.spec.model.model)
    np.testing.assert_allclose(logits(again), want, atol=1e-6)
    with pytest.raises(UsageError, match="unknown export format 'torchscript'"):
        fh.export(loaded, tmp_path / "x", format="torchscript")


def test_a_ranking_run_from_python_equals_the_command(files):
    from flaxheads.cli.main import main

    d = files["dir"]
    base = dict(
        SETTINGS,
        model=files["bert"],
        data=files["pref"],
        objective="pairwise",
        pooler="preset",
        head="preset",
        split="0.5,0.25,0.25",
    )
    assert main(["train", *_argv(base), "--no-progress", "--output-dir", str(d / "rank_cli")]) == 0
    run = fh.train(**dict(base, split=(0.5, 0.25, 0.25)), output_dir=str(d / "rank_lib"), progress=False)
    assert metrics_rows(d / "rank_cli") == metrics_rows(d / "rank_lib")
    assert _config(d / "rank_cli") == _config(d / "rank_lib")
    assert run.summary["objective"] == "pairwise" and "pairwise_accuracy" in run.metrics["test"]
    assert isinstance(run.model, fh.SequenceModel) and run.model.num_labels == 1


@pytest.mark.parametrize(
    "settings,needle",
    [
        ({"bogus": 1}, "'bogus' is not a run setting"),
        ({"sweep": 2, "parallel": "pmap"}, "--cache-features/--sweep run on one device"),
        ({"lora_rank": 4, "freeze_backbone": True}, "--lora-rank trains adapters inside the backbone"),
        ({"objective": "listwise", "pack": True}, "--pack does not apply to --objective listwise"),
        ({"objective": "ranking"}, "objective 'ranking' is not one of classification"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"split": (0.5, 0.6, 0.1)}, "that sum to 1"),
        ({"resume": "latest"}, "resume 'latest': expected auto, never or a step number"),
    ],
)
def test_bad_settings_are_refused_before_any_work(settings, needle, tmp_path):
    with pytest.raises(UsageError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        fh.train(**settings, output_dir=str(tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_spec_from_an_old_or_foreign_folder_is_one_clear_error(tmp_path):
    with pytest.raises(UsageError, match="has no config.json: not a flaxheads run folder"):
        fh.RunSpec.from_run(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model": "x", "max_length": 16}))
    with pytest.raises(UsageError, match="records no run spec"):
        fh.RunSpec.from_run(tmp_path)
    with pytest.raises(UsageError, match="run spec group 'optim' has no setting 'epoch'"):
        fh.RunSpec.from_dict({"optim": {"epoch": 3}})
