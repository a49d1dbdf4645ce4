"""Preflight: a command that would write where it cannot (a path inside a file, a read-only folder, a
disk without room for the checkpoints) says so in one line and exits 2 before it loads a model; the
checkpoint size it estimates from the weights' headers bounds what Orbax really writes. An export that fails
to write (a file size limit: EFBIG, as a full disk gives ENOSPC) exits 1 in one line, the previous export intact."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from flaxheads.cli.main import main
from flaxheads.disk import preflight

pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def bert(tiny_bert):
    return tiny_bert


def _fail(capfd, argv, monkeypatch=None):
    # a model loaded would mean the check came too late
    import flaxheads.cli.predict as P
    import flaxheads.formats as E
    import flaxheads.run.program as F

    if monkeypatch is not None:
        for mod, name in ((F, "build_model"), (P, "load_classifier"), (E, "import_model")):
            monkeypatch.setattr(mod, name, lambda *a, **k: pytest.fail("model loaded before the check"))
    code = main(argv)
    err = capfd.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _blocked(tmp_path, how):
    """A folder path the process cannot write: inside a plain file, or in a read-only folder."""
    plain = tmp_path / "plain.txt"
    plain.write_text("not a folder")
    if how == "under_file":
        return str(plain / "out"), "which is a file, not a folder"
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only (chmod) folder; the path-under-a-file case covers root")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    return str(ro / "out"), "permission denied"


@pytest.mark.parametrize("how", ["under_file", "read_only"])
def test_every_command_checks_where_it_writes_first(tmp_path, bert, capfd, monkeypatch, how):
    out, why = _blocked(tmp_path, how)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "".join(f"w{i} w{i + 1},c{i % 2}\n" for i in range(20)))
    cases = {
        "--output-dir": ["train", "--model", bert, "--data", str(data), "--output-dir", out, "--no-progress"],
        "--out": ["export", "--from", bert, "--format", "transformers", "--out", os.path.join(out, "x")],
        "--output": ["predict", bert, "--input", str(data), "--output", os.path.join(out, "p.csv")],
        "--output-dir ": ["evaluate", bert, "--input", str(data), "--output-dir", out],
    }
    for flag, argv in cases.items():
        line = _fail(capfd, argv, monkeypatch)
        assert flag.strip() in line and why in line, (argv, line)


def test_export_never_replaces_a_plain_file(tmp_path, bert, capfd):
    plain = tmp_path / "model.bin"
    plain.write_bytes(b"keep me")
    line = _fail(capfd, ["export", "--from", bert, "--format", "transformers", "--out", str(plain), "--overwrite"])
    assert "is a file" in line and plain.read_bytes() == b"keep me"


def test_train_needs_room_for_its_checkpoints(tmp_path, bert, capfd, monkeypatch):
    n = preflight.weight_elements(bert)
    need = preflight.checkpoints_bytes(n, trains_backbone=True, keep=3, keep_best=True)
    monkeypatch.setattr(preflight, "disk_free", lambda path: need - 1)
    base = ["train", "--model", bert, "--data", "x.csv", "--no-progress"]
    line = _fail(capfd, base + ["--output-dir", str(tmp_path / "run")], monkeypatch)
    assert "free on its disk" in line and "needs about" in line and "--output-dir" in line
    assert not (tmp_path / "run").exists()
    # a frozen backbone saves only the head: the same disk is enough (the run then fails on the data)
    line = _fail(capfd, base + ["--freeze-backbone", "--output-dir", str(tmp_path / "run")])
    assert "free on its disk" not in line


def test_checkpoint_estimate_bounds_what_orbax_writes(tmp_path, bert):
    """The per-checkpoint estimate is at least what a fine-tuning checkpoint takes on disk, and not far above."""
    from flaxheads import RunCheckpointer, from_pretrained
    from flaxheads.training.optim import OptimConfig, make_optimizer
    from flaxheads.training.steps import create_state

    model = from_pretrained(bert, num_labels=3)
    state = create_state(model.params, make_optimizer(OptimConfig()))
    with RunCheckpointer(tmp_path / "run", model) as ckr:
        ckr.save(1, state)
    actual = preflight.folder_bytes([str(tmp_path / "run" / "checkpoints" / "1")])
    n = preflight.weight_elements(bert)  # the HF folder: backbone, BERT pooler and a classifier like this head's
    assert n == sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(model.params))
    estimate = preflight.TRAIN_STATE_BYTES_PER_PARAM * n
    assert actual <= estimate + preflight.MARGIN_BYTES, (actual, estimate)
    assert estimate < 3 * actual, (actual, estimate)
    print(f"checkpoint {actual} bytes, estimate {estimate}")


@pytest.fixture
def file_size_limit():
    """Files of this process stop growing past the given bytes (writes fail with EFBIG, as a full
    disk fails them with ENOSPC) until the test ends."""
    import resource
    import signal

    old, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    yield lambda n: resource.setrlimit(resource.RLIMIT_FSIZE, (n, old[1]))
    resource.setrlimit(resource.RLIMIT_FSIZE, old)
    signal.signal(signal.SIGXFSZ, handler)


def test_an_export_that_cannot_be_written_keeps_the_previous_one(tmp_path, bert, capfd, file_size_limit):
    out = tmp_path / "export"
    argv = ["export", "--from", bert, "--format", "transformers", "--out", str(out), "--overwrite"]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capfd.readouterr()
    file_size_limit(20_000)  # the tiny model's weights are larger
    code = main(argv)
    err = capfd.readouterr().err
    assert code == 1, err
    assert err.strip().splitlines() == [
        f"error: could not write the export {out}: File too large; the existing "
        f"{out} is unchanged; free some space or fix the disk and export again"
    ]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert os.listdir(tmp_path) == ["export"]  # no temporary folder left beside it


def test_overwrite_replaces_only_what_flaxheads_wrote(tmp_path, bert, capfd):
    out = tmp_path / "export"
    argv = ["export", "--from", bert, "--format", "transformers", "--out", str(out), "--overwrite"]
    assert main(argv) == 0 and (out / ".flaxheads").is_file()
    assert main(argv) == 0  # its own export: replaced
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    line = _fail(capfd, argv[:-2] + [str(mine), "--overwrite"])
    assert "flaxheads did not write" in line and (mine / "thesis.tex").read_text() == "years of work"
    import flaxheads as fh  # the library refuses the same folder

    with pytest.raises(fh.FlaxheadsError, match="did not write"):
        fh.interop.export_head(fh.interop.import_model(bert), mine, overwrite=True)
    assert os.listdir(mine) == ["thesis.tex"]
    # a run writes config.json and more into --output-dir: not among someone's files either
    line = _fail(capfd, ["train", "--model", bert, "--data", "x.csv", "--output-dir", str(mine), "--no-progress"])
    assert "--output-dir" in line and "not a flaxheads run" in line


def test_a_refused_table_write_is_one_line(tmp_path, bert, capfd, monkeypatch):
    """A table, log or plot the disk refuses, anywhere in a command: one line, exit 1."""
    import errno

    import flaxheads.cli.predict as P

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(P, "write_rows", full)
    data = tmp_path / "in.csv"
    data.write_text("text\n" + "".join(f"w{i} w{i + 1} w{i + 2}\n" for i in range(4)))
    code = main(["predict", bert, "--input", str(data), "--output", str(tmp_path / "p.csv")])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 1 and err == [
        f"error: could not write {tmp_path / 'p.csv'}: No space left on device; free some "
        "space or fix the disk and rerun"
    ], err
