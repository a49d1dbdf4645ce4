"""Bad input to `flaxheads train`: each is refused with exit code 2 and one `error:` line (no
traceback) that says what is wrong, before any training starts."""

import json

import pytest
from cli_helpers import assert_one_line_error, error_lines, run_cli, run_process, train_args, write_csv, write_jsonl

pytestmark = pytest.mark.full


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--batch-size", "-4", "expected a positive integer, got '-4'"),
        ("--batch-size", "0", "--batch-size"),
        ("--eval-batch-size", "0", "--eval-batch-size"),
        ("--epochs", "0", "expected a number > 0"),
        ("--epochs", "nan", "--epochs"),
        ("--max-steps", "0", "--max-steps"),
        ("--lr", "-0.001", "--lr: expected a number > 0, got '-0.001'"),
        ("--lr=-1e-3", None, "--lr: expected a number > 0, got '-1e-3'"),
        ("--lr", "fast", "--lr: expected a number > 0, got 'fast'"),
        ("--lr", "0", "--lr"),
        ("--head-lr", "inf", "--head-lr"),
        ("--max-length", "0", "--max-length"),
        ("--limit", "-1", "--limit"),
        ("--bucket-step", "0", "--bucket-step"),
        ("--accumulation-steps", "0", "--accumulation-steps"),
        ("--label-smoothing", "1", "--label-smoothing: expected a number >= 0 and < 1"),
        ("--label-smoothing", "-0.1", "--label-smoothing"),
        ("--warmup-ratio", "1.5", "--warmup-ratio"),
        ("--weight-decay", "-0.01", "--weight-decay"),
        ("--max-grad-norm", "-1", "--max-grad-norm"),
        ("--threshold", "1", "--threshold"),
        ("--split", "0.5,0.5", "--split: expected three comma-separated fractions"),
        ("--split", "0.8,0.3,0.1", "must sum to 1"),
        ("--split", "0,0.5,0.5", "train fraction > 0"),
        ("--split", "a,b,c", "--split"),
        ("--head-hidden", "64,0", "--head-hidden"),
        ("--keep", "0", "--keep"),
        ("--seed", "-1", "--seed"),
        ("--sweep", "-2", "--sweep"),
        ("--eval-every", "0", "--eval-every"),
        ("--log-every", "0", "--log-every"),
        ("--num-processes", "0", "--num-processes"),
        ("--head", "transformer", "--head: invalid choice: 'transformer'"),
        ("--pooler", "bogus", "--pooler 'bogus': unknown pooler 'bogus'"),
        ("--pooler", "mean,nope", "unknown pooler 'nope'"),
        ("--parallel", "gpu", "--parallel: invalid choice"),
        ("--problem-type", "ranking", "--problem-type: invalid choice"),
        ("--precision", "float16", "--precision: invalid choice: 'float16'"),
    ],
)
def test_bad_flag_value(flag, value, needle, capsys, tmp_path):
    given = [flag] if value is None else [flag, value]
    code, _, err = run_cli(capsys, "train", "--data", "nowhere.csv", "--output-dir", tmp_path / "r", *given)
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--head", "linear", "--head-hidden", "64"], "--head-hidden sets the widths of an MLP head"),
        (["--no-resume", "--resume-step", "3"], "--no-resume and --resume-step contradict"),
        (["--validation-file", "v.csv"], "--validation-file/--test-file need --train-file"),
        (["--sweep", "2", "--parallel", "pmap"], "--cache-features/--sweep run on one device"),
        (["--num-processes", "2", "--process-id", "0"], "need --coordinator-address"),
        (["--coordinator-address", "127.0.0.1:1234", "--num-processes", "2"], "needs --num-processes and --process-id"),
        (
            ["--coordinator-address", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
            "--process-id 2 is not below --num-processes 2",
        ),
        (
            [
                "--coordinator-address",
                "127.0.0.1:1234",
                "--num-processes",
                "2",
                "--process-id",
                "0",
                "--parallel",
                "pmap",
            ],
            "use --parallel mesh",
        ),
        (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
        (["--bf16", "--precision", "float32"], "--bf16 means --precision bfloat16; it contradicts --precision float32"),
    ],
)
def test_conflicting_flags(argv, needle, capsys, tmp_path):
    code, _, err = run_cli(capsys, "train", "--data", "nowhere.csv", "--output-dir", tmp_path / "r", *argv)
    assert_one_line_error(code, err, needle)


def test_bad_precision_from_the_environment(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FLAXHEADS_PRECISION", "fp8")
    code, _, err = run_cli(capsys, "train", "--data", "nowhere.csv", "--output-dir", tmp_path / "r")
    assert_one_line_error(
        code, err, "$FLAXHEADS_PRECISION='fp8' is not a precision: expected one of auto, float32, bfloat16"
    )


def test_negative_batch_size_fails_fast_in_a_process(tmp_path):
    """It used to hang; the process now exits 2 with one line on stderr and nothing else."""
    out = run_process("train", "--batch-size", "-4", "--output-dir", tmp_path / "r", timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        "error: argument --batch-size: expected a positive integer, got '-4' (see `flaxheads train --help`)"
    ]


def test_unsplittable_xla_flags_fail_in_one_line(tmp_path):
    out = run_process("train", "--output-dir", tmp_path / "r", env={"XLA_FLAGS": "--xla_dump_to='/tmp/x"}, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        'error: XLA_FLAGS="--xla_dump_to=\'/tmp/x" cannot be split into flags '
        "(No closing quotation): expected space-separated --name=value flags; "
        "fix its quoting"
    ]


def test_no_subcommand_and_unknown_subcommand(capsys):
    code, _, err = run_cli(capsys)
    assert_one_line_error(code, err, "COMMAND")
    code, _, err = run_cli(capsys, "fly")
    assert_one_line_error(code, err, "invalid choice: 'fly'")


def test_missing_model_folder(tmp_path, capsys):
    data = write_csv(tmp_path / "d.csv", 12)
    code, _, err = run_cli(capsys, *train_args(str(tmp_path / "nope"), data, tmp_path / "r"))
    assert_one_line_error(code, err, "--model", "is not a folder")


def test_mixed_label_kinds_in_json_lines(bert_folder, tmp_path, capsys):
    """Lists (multi-label) and single names in one column used to train a single-label model with
    "['x']" as a class name."""
    data = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"text": "stock market", "label": ["business"]},
            {"text": "goal match", "label": ["sport"]},
            {"text": "vote party", "label": "politics"},
            {"text": "bank share", "label": ["business", "politics"]},
        ],
    )
    code, _, err = run_cli(capsys, *train_args(bert_folder, data, tmp_path / "r"))
    assert_one_line_error(
        code,
        err,
        "mixed.jsonl: column 'label' mixes label kinds",
        "row 1 has a list (['business'])",
        "row 3 has text ('politics')",
    )


def test_csv_that_is_not_utf8(bert_folder, tmp_path, capsys):
    data = tmp_path / "latin1.csv"
    data.write_bytes("text,label\nstock market,business\ncaf\u00e9 vote party,politics\n".encode("latin-1"))
    code, _, err = run_cli(capsys, *train_args(bert_folder, data, tmp_path / "r"))
    assert_one_line_error(
        code,
        err,
        "latin1.csv is not UTF-8",
        "byte 0xe9 at line 3, column 4",
        "iconv -f WINDOWS-1252 -t UTF-8 latin1.csv > latin1.utf8.csv",
    )


def test_csv_with_an_unterminated_quote(bert_folder, tmp_path, capsys):
    data = tmp_path / "quote.csv"
    data.write_text('text,label\nstock market,business\n"goal match,sport\nvote party,politics\nbank,business\n')
    code, _, err = run_cli(capsys, *train_args(bert_folder, data, tmp_path / "r"))
    assert_one_line_error(code, err, "quote.csv: line 3: unterminated quote")


def test_empty_split_is_refused(bert_folder, tmp_path, capsys):
    """5 examples split 0.8,0.1,0.1 leave no validation or test example: refused, not run without them."""
    data = write_csv(tmp_path / "d.csv", 5)
    code, _, err = run_cli(capsys, *train_args(bert_folder, data, tmp_path / "r"))
    assert_one_line_error(code, err, "leaves the validation and test split empty", "--split 0.9,0.1,0")


def test_validation_needed_but_absent(bert_folder, tmp_path, capsys):
    data = write_csv(tmp_path / "d.csv", 30)
    code, _, err = run_cli(
        capsys,
        *train_args(bert_folder, data, tmp_path / "r", "--split", "0.9,0,0.1", "--keep-best-by", "validation/accuracy"),
    )
    assert_one_line_error(code, err, "--keep-best-by validation/accuracy needs a validation split")


def test_counts_line_says_0_for_a_split_left_out(bert_folder, tmp_path, capsys):
    data = write_csv(tmp_path / "d.csv", 30)
    code, out, _ = run_cli(
        capsys,
        *train_args(
            bert_folder,
            data,
            tmp_path / "r",
            "--split",
            "0.9,0.1,0",
            "--max-steps",
            "1",
            "--freeze-backbone",
            "--checkpoint-every",
            "0",
        ),
    )
    assert code == 0
    assert "27 train / 3 validation / 0 test examples" in out


def test_max_length_beyond_the_model_positions_warns_and_uses_them(bert_folder, tmp_path, capsys):
    """Decision: a run asking for more tokens than the model has positions is not refused (the
    texts are truncated to what the model takes either way); it says so on one warning line."""
    data = write_csv(tmp_path / "d.csv", 30)
    out = tmp_path / "r"
    code, _, err = run_cli(
        capsys,
        "train",
        "--model",
        bert_folder,
        "--data",
        data,
        "--output-dir",
        out,
        "--max-length",
        "4096",
        "--max-steps",
        "1",
        "--freeze-backbone",
        "--no-progress",
        "--checkpoint-every",
        "0",
    )
    assert code == 0
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning: --max-length")]
    assert warnings == [
        f"warning: --max-length 4096 is more than the 64 positions of {bert_folder}; using --max-length 64"
    ]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_length"] == 64 and cfg["buckets"][-1] == 64
    assert not error_lines(err)
