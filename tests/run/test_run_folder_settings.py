"""``--report-to`` and ``--profile-steps``: the flags reach the spec (and its JSON), bad values are
refused in one line before any work, and a log entry's TensorBoard tags."""
from __future__ import annotations

import pytest

import flaxheads as fh
from flaxheads.cli.main import main
from flaxheads.cli.train import build_parser, spec_from_args
from flaxheads.errors import UsageError
from flaxheads.run.reporters import resolve_report_to, scalars_of, tensorboard_available
from flaxheads.training.profiling import parse_steps


def test_the_flags_reach_the_spec_and_round_trip():
    spec = spec_from_args(build_parser().parse_args(["--report-to", "tensorboard,jsonl", "--profile-steps", "2:3"]))
    assert spec.checkpoints.report_to == ("tensorboard", "jsonl") and spec.checkpoints.profile_steps == "2:3"
    assert fh.RunSpec.from_dict(spec.to_dict()) == spec
    assert spec_from_args(build_parser().parse_args([])).checkpoints.report_to is None


def test_report_to_values():
    assert resolve_report_to("none") == () == resolve_report_to(("none",))
    assert resolve_report_to("jsonl") == ("jsonl",)
    assert resolve_report_to(None) == (("jsonl", "tensorboard") if tensorboard_available() else ("jsonl",))
    with pytest.raises(UsageError, match="expected one or more of jsonl, tensorboard"):
        resolve_report_to("wandb")


@pytest.mark.parametrize("text", ["5:2", "0:3", "3", "a:b", "1:2:3"])
def test_profile_steps_refused(text):
    with pytest.raises(UsageError, match="expected A:B"):
        parse_steps(text)


def test_the_command_refuses_bad_values_in_one_line(tmp_path, capsys):
    assert parse_steps("20:25") == (20, 25) and parse_steps("4:4") == (4, 4)
    for flag, value in (("--profile-steps", "5:2"), ("--report-to", "csv")):
        assert main(["train", "--data", str(tmp_path / "none.csv"), flag, value, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and flag in err


def test_tags_of_a_log_entry():
    assert scalars_of({"step": 3, "loss": 0.5, "lr_head": 1e-3}) == [("train/loss", 0.5), ("train/lr_head", 1e-3)]
    assert scalars_of({"step": 3, "eval": {"validation": {"ndcg@10": 0.7}}}) == [("validation/ndcg_10", 0.7)]
    assert scalars_of({"step": 3, "final": {"test": {"mrr": 1}}}) == [("final/test/mrr", 1.0)]
