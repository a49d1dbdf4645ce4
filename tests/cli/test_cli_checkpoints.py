"""`flaxheads checkpoints --verify`: a truncated array file passes the plain listing (which reads
the JSON items only) and fails verification, which reads every array."""
import json
import os

import pytest

import flaxheads as fh
from cli_helpers import bert_folder, run_cli  # noqa: F401

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
