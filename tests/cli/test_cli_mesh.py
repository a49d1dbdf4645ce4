"""`flaxheads train --mesh`: a run on a data x fsdp x tensor mesh (the 4 CPU devices of the
conftest) is the one-device run; it prints each device's memory at the start; a run
checkpointed on one mesh resumes on another; bad mesh flags are one-line errors."""

import json
import shutil

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli, train_args, write_csv

pytestmark = pytest.mark.full

STEPS = [
    "--max-steps",
    "4",
    "--batch-size",
    "4",
    "--eval-batch-size",
    "4",
    "--log-every",
    "1",
    "--lr",
    "1e-3",
    "--head-lr",
    "1e-2",
    "--checkpoint-every",
    "2",
    "--keep",
    "5",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("mesh_data") / "d.csv", 30, seed=5)


def _losses(run) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def _logits(run) -> np.ndarray:
    return np.load(run / "predictions.npz")["test_logits"]


@pytest.mark.slow
def test_mesh_run_is_the_single_device_run_and_resumes_on_another_mesh(bert_folder, data, tmp_path, capsys):
    single, mesh = tmp_path / "single", tmp_path / "mesh"
    assert run_cli(capsys, *train_args(bert_folder, data, single, *STEPS))[0] == 0
    code, out, err = run_cli(capsys, *train_args(bert_folder, data, mesh, *STEPS, "--mesh", "fsdp=2,tensor=2"))
    assert code == 0, err
    assert "memory plan per device (" in out and "data=1, fsdp=2, tensor=2, batch" in out and ", peak " in out
    cfg = json.loads((mesh / "config.json").read_text())
    assert cfg["devices"]["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2} and cfg["devices"]["width"] == 2
    np.testing.assert_allclose(_losses(mesh), _losses(single), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_logits(mesh), _logits(single), atol=1e-5)

    # as if interrupted after step 2: resume that checkpoint on a data=2,fsdp=2 mesh
    resumed = tmp_path / "resumed"
    shutil.copytree(mesh, resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    code, out, err = run_cli(capsys, *train_args(bert_folder, data, resumed, *STEPS, "--mesh", "data=2,fsdp=2"))
    assert code == 0, err
    assert "resuming from step 2" in out
    np.testing.assert_allclose(_losses(resumed), _losses(single), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_logits(resumed), _logits(single), atol=1e-5)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--mesh", "data=2,model=2"], "unknown axis 'model'"),
        (["--mesh", "fsdp=3"], "4 devices do not split into groups of 3"),
        (["--mesh", "fsdp=2", "--parallel", "pmap"], "cannot be combined with --parallel pmap"),
        (["--mesh", "fsdp=2", "--cache-features"], "--mesh"),
    ],
)
def test_bad_mesh_flags(bert_folder, data, tmp_path, capsys, flags, needle):
    code, _, err = run_cli(capsys, *train_args(bert_folder, data, tmp_path / "run", "--max-steps", "1", *flags))
    assert_one_line_error(code, err, needle)
