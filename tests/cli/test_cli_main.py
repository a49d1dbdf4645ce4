"""The `flaxheads` command itself: its subcommands, the console script, and the error policy
(a user's mistake: one `error:` line and exit 2; a bug: its traceback)."""

from importlib import metadata

import pytest
from cli_helpers import assert_one_line_error, run_cli, run_process

import flaxheads.cli.checkpoints as checkpoints_cli
from flaxheads.cli.main import build_parser, main, one_line
from flaxheads.errors import FlaxheadsError, UsageError

pytestmark = pytest.mark.full


def test_subcommands_are_argparse_subparsers():
    parser = build_parser()
    args = parser.parse_args(["train", "--batch-size", "8", "--model", "m"])
    assert args.command == "train" and args.batch_size == 8 and args.func.__name__ == "run_command"
    args = parser.parse_args(["export", "--from", "a", "--format", "head", "--out", "b"])
    assert args.command == "export" and args.func.__name__ == "run_export"
    args = parser.parse_args(["checkpoints", "runs/x", "--verify"])
    assert args.command == "checkpoints" and args.verify


def test_help_lists_every_subcommand():
    out = run_process("--help", timeout=300)
    assert out.returncode == 0
    for name in ("train", "export", "checkpoints"):
        assert name in out.stdout


def test_console_script_is_the_guarded_entry():
    # the entry installs the import guard, then imports the command's libraries (test_signal_phases.py)
    scripts = [e for e in metadata.entry_points(group="console_scripts") if e.name == "flaxheads"]
    if not scripts:
        pytest.skip("flaxheads is not installed in this environment (run from the source tree)")
    assert scripts[0].value == "flaxheads.cli:entry"


def test_usage_error_is_a_flaxheads_error():
    assert issubclass(UsageError, FlaxheadsError) and issubclass(FlaxheadsError, ValueError)


def test_a_multi_line_message_prints_as_one_line():
    assert (
        one_line(FlaxheadsError("incompatible head config:\n  head.type: 'linear' vs 'mlp'\n  num_labels: 3 vs 2"))
        == "incompatible head config: head.type: 'linear' vs 'mlp'; num_labels: 3 vs 2"
    )


def test_user_error_in_a_subcommand_is_one_line(monkeypatch, capsys, tmp_path):
    def fail(*a, **k):
        raise FlaxheadsError("first line\nsecond line")

    monkeypatch.setattr(checkpoints_cli, "list_checkpoints", fail)
    code, _, err = run_cli(capsys, "checkpoints", tmp_path)
    assert assert_one_line_error(code, err) == "error: first line; second line"


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path):
    def bug(*a, **k):
        raise RuntimeError("internal")

    monkeypatch.setattr(checkpoints_cli, "list_checkpoints", bug)
    with pytest.raises(RuntimeError, match="internal"):
        main(["checkpoints", str(tmp_path)])


def test_bad_step_flag(capsys, tmp_path):
    code, _, err = run_cli(capsys, "checkpoints", tmp_path, "--meta", "--step", "last")
    assert_one_line_error(code, err, "--step: expected a step number, 'latest' or 'best', got 'last'")
