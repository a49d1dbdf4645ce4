"""Disk faults as clusters meet them, on real file systems: a size-limited tmpfs (ENOSPC), a read-only
mount (EROFS) and, where the kernel's tmpfs takes quotas, a quota (EDQUOT). Each mount needs root and
mount permission; elsewhere the test skips and says why. Also the run folder's loose ends: a read-only
``checkpoints/`` inside a writable run folder, and resuming with another ``--model``, are one line and
exit 2 before any model loads. (A disk that stops taking checkpoints during training is
tests/test_faults.py's case, with a file size limit.)"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import pytest

import flaxheads as fh
from flaxheads.cli.main import main
from flaxheads.disk import preflight

pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def bert(tiny_bert):
    return tiny_bert


@contextlib.contextmanager
def tmpfs(path, options: str):
    """A tmpfs mounted at ``path`` with ``options`` (size=, ro, quota...) for the block; skips where
    mounting is not permitted (not root, or a container without CAP_SYS_ADMIN)."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a size-limited or read-only tmpfs needs root")
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"mount -t tmpfs -o {options} is not permitted here: {got.stderr.strip()[:120]}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


def _one_error(capfd, argv, code: int, monkeypatch=None) -> str:
    if monkeypatch is not None:  # a model loaded would mean the check came too late
        import flaxheads.run.program as F

        monkeypatch.setattr(F, "build_model", lambda *a, **k: pytest.fail("model loaded before the check"))
    capfd.readouterr()
    got = main([str(a) for a in argv])
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert got == code and len(lines) == 1 and lines[0].startswith("error: "), (got, err)
    return lines[0]


def _data(tmp_path) -> str:
    from train_helpers import WORDS

    p = tmp_path / "d.csv"
    p.write_text("text,label\n" + "".join(f"{WORDS[i % 9]} {WORDS[(i * 5) % 11]},c{i % 2}\n" for i in range(24)))
    return str(p)


def _train(bert, data, out, *extra):
    return [
        "train",
        "--model",
        bert,
        "--data",
        data,
        "--output-dir",
        out,
        "--max-length",
        "16",
        "--bucket-step",
        "16",
        "--batch-size",
        "4",
        "--max-steps",
        "2",
        "--no-progress",
        *extra,
    ]


def test_a_read_only_checkpoints_folder_is_refused_before_the_model_loads(bert, tmp_path, capfd, monkeypatch):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    (run / ".flaxheads").write_text('{"kind": "run"}')
    if os.geteuid() == 0:  # root writes through permission bits: a read-only mount is what stops it
        with tmpfs(ckpts, "ro,size=1m"):
            line = _one_error(capfd, _train(bert, _data(tmp_path), run), 2, monkeypatch)
    else:
        ckpts.chmod(0o555)
        line = _one_error(capfd, _train(bert, _data(tmp_path), run), 2, monkeypatch)
    assert "checkpoints folder" in line and ("read-only" in line or "permission denied" in line), line


def test_resuming_with_another_model_is_one_line_before_it_loads(bert, tmp_path, capfd, monkeypatch):
    run = tmp_path / "run"
    model = fh.from_pretrained(bert, num_labels=3)
    with fh.RunCheckpointer(run, model, extra_meta={"run": {"model": bert}}) as ckr:
        ckr.save(2, {"step": 2, "params": model.params, "opt_state": {}})
    (run / ".flaxheads").write_text('{"kind": "run"}')
    other = shutil.copytree(bert, tmp_path / "other")
    line = _one_error(capfd, _train(str(other), _data(tmp_path), run), 2, monkeypatch)
    assert f"trained from --model {bert}" in line and "new --output-dir" in line, line


def test_an_export_to_a_full_disk_keeps_the_previous_export(bert, tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(preflight, "disk_free", lambda path: 1 << 40)  # let the writes themselves meet the limit
    with tmpfs(tmp_path / "small", "size=96k") as disk:
        out = os.path.join(disk, "export")
        assert main(["export", "--from", bert, "--format", "head", "--out", out]) == 0
        before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
        line = _one_error(capfd, ["export", "--from", bert, "--format", "transformers", "--out", out, "--overwrite"], 1)
        assert "No space left on device" in line and "is unchanged" in line, line
        assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == before
        assert os.listdir(disk) == ["export"]  # no temporary folder left
        fh.load(out, backbone=bert, verify=True)  # and it still matches its checksums


def test_a_disk_that_turns_read_only_during_an_export(bert, tmp_path, capfd, monkeypatch):
    import flaxheads.formats as E

    with tmpfs(tmp_path / "disk", "size=64m") as disk:
        out = os.path.join(disk, "export")
        check = E._check_paths

        def then_read_only(*a, **k):  # after the preflight, as a storage fault or an admin would
            check(*a, **k)
            remount(disk, "ro")

        monkeypatch.setattr(E, "_check_paths", then_read_only)
        line = _one_error(capfd, ["export", "--from", bert, "--format", "transformers", "--out", out], 1)
        assert "Read-only file system" in line and "nothing was written" in line, line
        remount(disk, "rw")
        assert os.listdir(disk) == []


def test_an_export_over_quota_ends_in_one_line(bert, tmp_path):
    # root is exempt from quotas (CAP_SYS_RESOURCE): the export runs without that capability
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to drop CAP_SYS_RESOURCE")
    with tmpfs(tmp_path / "disk", "size=64m,usrquota,usrquota_block_hardlimit=96k") as disk:
        out = os.path.join(disk, "export")
        from cli_helpers import REPO

        env = {**os.environ, "PYTHONPATH": REPO}  # 64 MB free to statvfs: the preflight passes, the quota binds
        got = subprocess.run(
            [
                "setpriv",
                "--inh-caps=-sys_resource",
                "--bounding-set=-sys_resource",
                sys.executable,
                "-m",
                "flaxheads",
                "export",
                "--from",
                bert,
                "--format",
                "transformers",
                "--out",
                out,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        lines = got.stderr.strip().splitlines()
        assert got.returncode == 1 and len(lines) == 1 and "Disk quota exceeded" in lines[0], got.stderr
        assert os.listdir(disk) == []
