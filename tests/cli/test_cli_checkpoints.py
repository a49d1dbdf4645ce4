"""`flaxheads checkpoints`: a truncated array file passes the plain listing (which reads, and checks
the checksums of, the JSON items only) and fails verification, which reads every array and hashes
every file; a folder that is not a run is named in one line (exit 2), and `--verify` checks its files."""

import json
import os

import pytest
from cli_helpers import run_cli

import flaxheads as fh

pytestmark = pytest.mark.full


def _data_files(folder) -> list[str]:
    """Orbax's array data files (``.../d/<hash>``) under ``folder``."""
    return [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names if os.path.basename(d) == "d"]


# tensorstore may report the failed read once more from a closed event loop: noise, not a result
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_verify_finds_a_truncated_array(bert_folder, tmp_path, capsys):
    model = fh.from_pretrained(bert_folder, pooler="mean", head="linear", num_labels=2)
    with fh.RunCheckpointer(tmp_path, model, keep=None) as ckr:
        for step in (1, 2):
            ckr.save(step, {"step": step, "params": model.params, "opt_state": {}})
    files = _data_files(tmp_path / "checkpoints" / "2" / "head")
    assert files
    for f in files:
        with open(f, "r+b") as fp:
            fp.truncate(os.path.getsize(f) // 2)

    code, out, _ = run_cli(capsys, "checkpoints", tmp_path, "--json")
    assert code == 0 and [r["status"] for r in json.loads(out)] == ["ok", "ok"]
    code, out, _ = run_cli(capsys, "checkpoints", tmp_path, "--json", "--verify")
    rows = json.loads(out)
    assert code == 1
    assert rows[0]["status"] == "ok" and rows[1]["status"].startswith("corrupt"), rows
    code, out, _ = run_cli(capsys, "checkpoints", tmp_path, "--verify")
    assert code == 1 and "corrupt" in out.splitlines()[-1]


def test_a_folder_that_is_not_a_run_is_named_and_verify_checks_its_files(bert_folder, tmp_path, capsys):
    model = fh.from_pretrained(bert_folder, pooler="mean", head="linear", num_labels=2)
    head = fh.export(model, tmp_path / "head", "head")
    code, out, err = run_cli(capsys, "checkpoints", head)
    assert code == 2 and out == "" and err.count("\n") == 1 and "is a head export, not a run" in err, err
    code, _, err = run_cli(capsys, "checkpoints", bert_folder)
    assert code == 2 and "is a transformers model folder, not a run" in err, err
    code, out, _ = run_cli(capsys, "checkpoints", head, "--verify")
    assert code == 0 and "files match the SHA-256" in out, out
    code, out, _ = run_cli(capsys, "checkpoints", bert_folder, "--verify")
    assert code == 0 and "every tensor finite" in out, out
    with open(os.path.join(head, "head.safetensors"), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")
    code, out, err = run_cli(capsys, "checkpoints", head, "--verify")
    assert code == 1 and out == "" and err.count("\n") == 1 and "head.safetensors: its SHA-256 differs" in err, err
