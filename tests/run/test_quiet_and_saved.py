"""A run is quiet by default and loud on request, and always holds its model.

- A notebook's run (``fh.train``, ``progress=False``) prints one start line (model, rows per split,
  devices) and the final metrics table, no memory plan on a CPU; with the ``flaxheads`` logger at
  WARNING it prints nothing at all (file descriptors 1 and 2 both empty).
- ``flaxheads train -q`` prints nothing (errors still one line, exit 2); ``-v`` adds the DEBUG lines.
- A run with ``checkpoint_every=0`` still saves its last step: ``fh.load`` (latest, ``step="best"``)
  and ``Classifier.from_pretrained`` give the logits of the model the run returned.
- A folder that cannot be loaded says what it is and what it lacks."""

from __future__ import annotations

import json
import logging
import shutil

import jax
import numpy as np
import pytest
from log_helpers import fresh_logging
from run_helpers import write_news

import flaxheads as fh
from flaxheads.backbones.base import BackboneError
from flaxheads.checkpoint import CheckpointNotFoundError
from flaxheads.cli.main import main
from flaxheads.errors import UsageError
from flaxheads.runtime import logs

pytestmark = pytest.mark.full

SETTINGS = dict(max_length=16, bucket_step=16, batch_size=4, max_steps=4, lr=3e-3, checkpoint_every=0)
IDS = np.array([[2, 40, 41, 42, 3, 0], [2, 50, 3, 0, 0, 0]], np.int32)


@pytest.fixture(scope="module")
def news(tmp_path_factory):
    d = tmp_path_factory.mktemp("quiet")
    rng = np.random.default_rng(0)
    write_news(d / "news.csv", rng)
    return d


def _logits(model) -> np.ndarray:
    return np.asarray(jax.jit(model.apply)(model.params, IDS, (IDS != 0).astype(np.int32)))


@pytest.fixture(scope="module")
def default_run(news, tiny_bert):
    """A run as a new notebook makes it (the logger untouched), with what it printed."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with fresh_logging(install=False), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        run = fh.train(
            model=tiny_bert, data=str(news / "news.csv"), output_dir=str(news / "run"), progress=False, **SETTINGS
        )
    return run, out.getvalue(), err.getvalue()


def test_a_default_run_prints_its_start_line_and_metrics_table(default_run, tiny_bert):
    run, out, err = default_run
    assert err == ""
    lines = out.splitlines()
    sizes = json.loads((run.folder / "config.json").read_text())["sizes"]
    start = lines[0]
    assert start.startswith(f"{tiny_bert}: {sizes['train']} train / {sizes['validation']} validation / ")
    assert f"{sizes['test']} test examples" in start and "1 cpu device" in start
    # then the table alone: a header of the metric names, a row per split with the run's numbers
    header, *rows = lines[1:]
    assert header.split() == list(run.metrics["test"])
    assert [r.split()[0] for r in rows] == list(run.metrics)
    for r in rows:
        split, *values = r.split()
        assert values == [f"{v:.4f}" for v in run.metrics[split].values()]
    assert "memory plan" not in out and "run folder" not in out and "?" not in out


def test_at_warning_a_run_prints_nothing(news, tiny_bert, capfd):
    with fresh_logging(install=False) as logger:
        logger.setLevel(logging.WARNING)
        run = fh.train(
            model=tiny_bert,
            data=str(news / "news.csv"),
            output_dir=str(news / "silent"),
            progress=False,
            report_to="none",  # no metrics.jsonl: the folder is still a run (its marker)
            **SETTINGS,
        )
        assert logger.level == logging.WARNING  # the run kept the user's level
    assert capfd.readouterr() == ("", "")
    np.testing.assert_array_equal(_logits(fh.load(run.folder)), _logits(run.model))


def test_verbosity_of_one_call_and_paths_as_pathlib(news, tiny_bert, capfd):
    """``verbosity=`` quiets this call alone; a ``pathlib.Path`` is taken wherever a path is."""
    from pathlib import Path

    with fresh_logging(install=False) as logger:
        before = logger.level
        run = fh.train(
            model=Path(tiny_bert),
            data=news / "news.csv",
            output_dir=news / "by-path",
            progress=False,
            verbosity="warning",
            **SETTINGS,
        )
        assert logger.level == before
    assert capfd.readouterr() == ("", "")
    assert fh.RunSpec.from_run(run.folder).model.model == str(tiny_bert)


def test_a_run_without_checkpoints_along_the_way_holds_its_last_step(default_run):
    run = default_run[0]
    want = _logits(run.model)
    assert sorted(p.name for p in (run.folder / "checkpoints").iterdir() if p.name.isdigit()) == ["4"]
    for model in (
        fh.load(run.folder),
        fh.load(run.folder, step="best"),
        fh.load(run.folder, step="latest"),
        fh.Classifier.from_pretrained(run.folder).model,
    ):
        np.testing.assert_array_equal(_logits(model), want)


def test_folders_that_cannot_be_loaded_say_what_they_are(default_run, tmp_path):
    run = default_run[0]
    finished = tmp_path / "finished"  # a finished run of an earlier release: no checkpoint at all
    shutil.copytree(run.folder, finished, ignore=shutil.ignore_patterns("checkpoints"))
    for load in (fh.load, lambda p: fh.load(p, step="best"), fh.Classifier.from_pretrained):
        with pytest.raises(
            CheckpointNotFoundError, match=rf"^{finished} is a run folder with no checkpoint .*finished"
        ):
            load(finished)
    (finished / "summary.json").unlink()  # interrupted before its first save
    with pytest.raises(
        CheckpointNotFoundError, match="is a run folder with no checkpoint .*interrupted before its first save"
    ):
        fh.load(finished)
    with pytest.raises(BackboneError, match=rf"{finished} is a flaxheads run folder, not a base model.*fh.load"):
        fh.from_pretrained(finished)
    with pytest.raises(
        CheckpointNotFoundError, match=r"empty has no checkpoints: no <step>/meta folders inside \(it is empty\)"
    ):
        (tmp_path / "empty").mkdir()
        fh.load_head(tmp_path / "empty")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("x")
    with pytest.raises(
        UsageError, match=rf"^{junk} is not a model, run or checkpoint folder: no config.json.*notes.txt"
    ):
        fh.load(junk, step="best")


def test_the_command_quiet_and_verbose(news, tiny_bert, capfd):
    out = news / "cli"
    argv = ["train", "--model", tiny_bert, "--data", str(news / "news.csv"), "--output-dir", str(out)]
    argv += ["--max-length", "16", "--bucket-step", "16", "--batch-size", "4", "--lr", "3e-3"]
    capfd.readouterr()
    assert main([*argv, "--max-steps", "2", "-q"]) == 0  # no --no-progress: -q drops the bar too
    assert capfd.readouterr() == ("", "")
    assert main([*argv, "--max-steps", "2", "--verbose", "--no-progress"]) == 0  # resumes at its end: no step
    got = capfd.readouterr()
    assert "resuming from step 2" in got.out and "run folder" in got.out
    # DEBUG: the memory plan of a CPU host, saying what it leaves out and why
    assert "memory plan per device" in got.out and "activation memory and the peak not estimated: " in got.out
    assert "?" not in got.out and got.err == ""
    assert main([*argv, "-q", "--max-steps", "0"]) == 2  # an error is still its one line
    err = capfd.readouterr()
    assert err.out == "" and len(err.err.splitlines()) == 1 and err.err.startswith("error: ")


def test_set_verbosity_and_the_handler(capsys):
    with fresh_logging(install=False) as logger:
        fh.set_verbosity("info")
        log = logs.get_logger("run")
        assert log.name == "flaxheads.run" and not logger.propagate
        log.debug("hidden")
        log.info("told")
        log.log(logs.SUMMARY, "summary")
        log.warning("careful")
        assert capsys.readouterr() == ("told\nsummary\n", "warning: careful\n")
        fh.set_verbosity("warning")
        log.log(logs.SUMMARY, "summary")
        assert capsys.readouterr() == ("", "")
        with pytest.raises(UsageError, match="verbosity 'loud': expected one of debug, info"):
            fh.set_verbosity("loud")
    with fresh_logging(install=False) as logger:  # a handler of the user's: flaxheads adds none
        mine = logging.StreamHandler()
        logger.addHandler(mine)
        logs.use_default_handler()
        assert logger.handlers == [mine] and logger.propagate and logger.level == logs.DEFAULT
