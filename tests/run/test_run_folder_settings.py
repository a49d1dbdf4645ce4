"""``--report-to`` and ``--profile-steps``: the flags reach the spec (and its JSON), bad values are
refused in one line before any work, and a log entry's TensorBoard tags."""

from __future__ import annotations

import pytest
from log_helpers import fresh_logging

import flaxheads as fh
from flaxheads.cli.main import main
from flaxheads.cli.train import build_parser, spec_from_args
from flaxheads.errors import UsageError
from flaxheads.run.reporters import resolve_report_to, scalars_of
from flaxheads.training.profiling import parse_steps


def test_the_flags_reach_the_spec_and_round_trip():
    spec = spec_from_args(build_parser().parse_args(["--report-to", "tensorboard,jsonl", "--profile-steps", "2:3"]))
    assert spec.checkpoints.report_to == ("tensorboard", "jsonl") and spec.checkpoints.profile_steps == "2:3"
    assert fh.RunSpec.from_dict(spec.to_dict()) == spec
    assert spec_from_args(build_parser().parse_args([])).checkpoints.report_to is None


def test_report_to_values():
    assert resolve_report_to("none") == () == resolve_report_to(("none",))
    assert resolve_report_to("jsonl") == ("jsonl",)
    assert resolve_report_to(None) == ("jsonl", "tensorboard")
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


def test_event_files_read_back_by_tensorboard_with_a_resumed_runs_purge(tmp_path, monkeypatch):
    """The event format (flaxheads.run.tfevents) against TensorBoard's own reader: records whose
    CRC-32C it checks, scalars of any step, and a resumed run's session start hiding the steps the
    interrupted run had logged from there on."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from train_helpers import event_scalars

    from flaxheads.run.tfevents import EventFile, _crc32c

    assert _crc32c(b"123456789") == 0xE3069283  # CRC-32C's published check value
    first = EventFile(tmp_path)
    for step in (1, 2, 3, 4):
        first.add_scalars(step, [("train/loss", 1.0 / step), ("train/lr_head", 0.5)])
    first.close()
    monkeypatch.setattr("time.time", lambda: 4102444800.0)  # the resumed run's file is the later one
    again = EventFile(tmp_path, purge_step=3)
    again.add_scalars(3, [("train/loss", 7.0)])
    again.add_scalars(2**40, [("validation/ndcg_10", -0.25)])  # int64 steps, negative values
    again.close()
    assert event_scalars(tmp_path) == {
        ("train/loss", 1, 1.0),
        ("train/loss", 2, 0.5),
        ("train/loss", 3, 7.0),
        ("train/lr_head", 1, 0.5),
        ("train/lr_head", 2, 0.5),
        ("validation/ndcg_10", 2**40, -0.25),
    }
    # a record whose bytes changed is dropped by the reader: the checksums are read, not ignored
    data = bytearray(again.path.read_bytes())
    data[-6] ^= 1
    again.path.write_bytes(bytes(data))
    assert len(list(RawEventFileLoader(str(again.path)).Load())) == 3


def test_a_disk_refusing_the_event_files_is_said_once(tmp_path, capsys):
    from flaxheads.run.reporters import Reporters

    (tmp_path / "tensorboard").write_text("a file where the folder goes")
    with fresh_logging():  # the warning goes through the flaxheads logger, and its handler prints it
        sinks = Reporters(tmp_path, ("jsonl", "tensorboard"))
        for step in (1, 2):
            sinks.write({"step": step, "loss": 0.5})
        sinks.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: could not write TensorBoard events in {tmp_path}")
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
