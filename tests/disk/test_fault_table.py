"""The fault table's damaged files (docs/design.md "Checksums, signals in every phase, and the fault
table"): a bit flipped at the start, middle or end of each kind of file flaxheads writes (a head file,
an export's weights, a sharded export read eagerly and onto a mesh, a checkpoint's params, its optimizer
state on resume), a truncated file, a damaged ``checksums.json`` and one from a newer format are each
refused in one line, on the default path of the library and of the commands (``predict``, ``export``,
``serve``, ``train``'s resume), and the failed load changes no file.

The files are written with 4 KiB blocks, so that a tiny model's files have many and the byte range
an error names can be told apart from the whole file."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import jax
import optax
import pytest
from train_helpers import WORDS

import flaxheads as fh
from flaxheads.checkpoint.meta import CorruptCheckpointError, DamagedCheckpointError
from flaxheads.disk import checksums
from flaxheads.interop.files import atomic_dir

BLOCK = 4096
WHERE = {"start": 3, "middle": 0.5, "end": -1}


@pytest.fixture(scope="module")
def small_blocks():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checksums, "BLOCK", BLOCK)
        yield


@pytest.fixture(scope="module")
def model(tiny_bert, small_blocks):
    return fh.from_pretrained(tiny_bert, num_labels=3)  # the HF preset: its export is a bert folder, mesh included


def flip(path: str, at: float | int) -> None:
    """Flip one bit of ``path`` at a fraction of its size (or a byte offset)."""
    with open(path, "r+b") as f:
        pos = int(os.fstat(f.fileno()).st_size * at) if isinstance(at, float) else at
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``flaxheads ARGV`` in this process: (exit code, stdout, stderr)."""
    from flaxheads.cli.main import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _shard(src: str, out: str) -> str:
    """``src`` (a transformers export) re-written by flaxheads' atomic folder as two safetensors shards
    and their index, as a large export is."""
    from safetensors.numpy import load_file, save_file

    state = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(state)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    with atomic_dir(out) as tmp:
        for name in os.listdir(src):
            if name not in ("model.safetensors", checksums.MANIFEST, ".flaxheads"):
                shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
        for file, keys in parts.items():
            save_file({k: state[k] for k in keys}, os.path.join(tmp, file), metadata={"format": "pt"})
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {k: file for file, keys in parts.items() for k in keys}}, f)
    return out


@pytest.fixture(scope="module")
def written(model, tiny_bert, tmp_path_factory):
    """Pristine folders of every kind, copied by each test before it damages one."""
    root = tmp_path_factory.mktemp("written")
    exp = fh.export(model, root / "export", "transformers", tokenizer_from=tiny_bert)
    head = fh.export(model, root / "head", "head")
    sharded = _shard(exp, str(root / "sharded"))
    opt = optax.adam(1e-3)
    state = {"step": 2, "params": model.params, "opt_state": opt.init(model.params)}
    with fh.RunCheckpointer(root / "run", model, keep=None) as ckr:
        for step in (1, 2):
            ckr.save(step, {**state, "step": step})
    return {"export": exp, "head": head, "sharded": sharded, "run": str(root / "run"), "opt": opt}


def _copy(written, kind, tmp_path) -> str:
    return shutil.copytree(written[kind], tmp_path / kind, symlinks=True)


def _snapshot(folder) -> dict[str, str]:
    return {
        os.path.relpath(os.path.join(d, f), folder): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
        for d, _, names in os.walk(folder)
        for f in names
    }


def _orbax_file(step_dir: str, item: str) -> str:
    """The largest data file of a checkpoint item."""
    files = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(step_dir, item)) for f in names]
    return max(files, key=os.path.getsize)


def _offset(path: str, where: str) -> int:
    at, size = WHERE[where], os.path.getsize(path)
    return int(size * at) if isinstance(at, float) else at % size


def _refused(call, path: str, pos: int | None, error=checksums.ChecksumError) -> str:
    with pytest.raises(error) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and os.path.basename(path) in msg, msg
    if pos is not None:
        a, b = map(int, re.search(r"bytes (\d+)\.\.(\d+) differ", msg).groups())
        assert a <= pos < b and b - a <= BLOCK, msg
    return msg


def _loads(kind: str, folder: str, written, tiny_bert):
    """The default-path load of ``folder`` (a copy of ``written[kind]``)."""
    if kind == "head":
        return lambda: fh.load(folder, backbone=tiny_bert)
    if kind == "sharded onto a mesh":
        return lambda: fh.from_pretrained(folder, mesh="fsdp=4")
    if kind == "optimizer state":

        def resume():
            model = fh.load(folder)
            target = {"step": 0, "params": model.params, "opt_state": written["opt"].init(model.params)}
            return fh.RunCheckpointer(folder, model, read_only=True).restore(target_state=target)

        return resume
    return lambda: fh.load(folder)


@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize(
    "kind", ["head", "export", "sharded", "sharded onto a mesh", "checkpoint params", "optimizer state"]
)
def test_a_flipped_bit_is_refused_in_one_line_and_nothing_whole_changes(written, tiny_bert, tmp_path, kind, where):
    source = {"sharded onto a mesh": "sharded", "checkpoint params": "run", "optimizer state": "run"}.get(kind, kind)
    if kind == "sharded onto a mesh" and jax.device_count() < 4:
        pytest.skip("needs 4 (fake CPU) devices")
    folder = _copy(written, source, tmp_path)
    load = _loads(kind, str(folder), written, tiny_bert)
    if source == "run":
        path = _orbax_file(
            os.path.join(folder, "checkpoints", "2"), "backbone" if kind == "checkpoint params" else "opt_state"
        )
        error = DamagedCheckpointError
    else:
        name = {"head": "head.safetensors", "export": "model.safetensors"}.get(
            source, "model-00002-of-00002.safetensors"
        )
        path, error = os.path.join(folder, name), checksums.ChecksumError
    load()  # whole: loads
    pos = _offset(path, where)
    flip(path, pos)
    before = _snapshot(folder)
    msg = _refused(load, path, pos, error)
    if source == "run":
        assert "step 2 is damaged" in msg and "step=1" in msg, msg  # and names the step to restore instead
    assert _snapshot(folder) == before


@pytest.mark.parametrize("kind", ["export", "checkpoint params"])
def test_a_truncated_file_is_refused_in_one_line(written, tmp_path, kind):
    folder = _copy(written, "export" if kind == "export" else "run", tmp_path)
    path = (
        os.path.join(folder, "model.safetensors")
        if kind == "export"
        else _orbax_file(os.path.join(folder, "checkpoints", "2"), "backbone")
    )
    size = os.path.getsize(path)
    os.truncate(path, size - 100)
    msg = _refused(
        lambda: fh.load(str(folder)),
        path,
        None,
        checksums.ChecksumError if kind == "export" else CorruptCheckpointError,
    )
    assert f"{size - 100} bytes where" in msg and f"records {size}" in msg, msg


def _manifest(folder) -> str:
    return os.path.join(folder, checksums.MANIFEST)


@pytest.mark.parametrize("how", ["a digest", "the JSON"])
def test_a_damaged_checksums_file_is_named_not_the_files_it_records(written, tmp_path, how):
    folder = _copy(written, "export", tmp_path)
    text = open(_manifest(folder)).read()
    if how == "a digest":  # still JSON: its own digest tells
        i = text.index('"blocks": [') + len('"blocks": [') + 3
        text = text[:i] + ("0" if text[i] != "0" else "1") + text[i + 1 :]
    else:
        text = text.replace('"files"', '"files', 1)
    open(_manifest(folder), "w").write(text)
    msg = _refused(lambda: fh.load(str(folder)), _manifest(folder), None)
    assert "checksum manifest is damaged" in msg and "model.safetensors" not in msg, msg


def test_a_checksums_file_from_a_newer_format_asks_for_a_newer_flaxheads(written, tmp_path):
    folder = _copy(written, "export", tmp_path)
    manifest = json.load(open(_manifest(folder)))
    manifest["format"] = "flaxheads-checksums/3"
    manifest["digest"] = checksums._self_digest(manifest)
    json.dump(manifest, open(_manifest(folder), "w"))
    msg = _refused(lambda: fh.load(str(folder)), _manifest(folder), None, checksums.ChecksumFormatError)
    assert "newer flaxheads" in msg and "upgrade" in msg, msg


def test_serve_refuses_a_damaged_export_in_one_line(written, tmp_path, capsys):
    folder = _copy(written, "export", tmp_path)
    flip(os.path.join(folder, "model.safetensors"), 0.7)
    code, out, err = run_cli(capsys, "serve", folder, "--port", "0")
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "model.safetensors: bytes" in lines[0], err


def test_train_resume_refuses_damaged_optimizer_state_in_one_line(tiny_bert, tmp_path, capsys, small_blocks):
    data = tmp_path / "d.csv"  # two classes, each with its own words
    data.write_text("text,label\n" + "".join(f"{WORDS[i % 8]} {WORDS[(i + 3) % 8]},{'ab'[i % 2]}\n" for i in range(16)))
    out = tmp_path / "run"
    args = [
        "train",
        "--model",
        tiny_bert,
        "--data",
        data,
        "--output-dir",
        out,
        "--max-length",
        "16",
        "--bucket-step",
        "16",
        "--no-progress",
        "--max-steps",
        "2",
        "--batch-size",
        "4",
        "--checkpoint-every",
        "1",
        "--keep",
        "2",
        "--split",
        "0.75,0.25,0",
    ]
    code, _, err = run_cli(capsys, *args)
    assert code == 0, err
    ckpts = out / "checkpoints"
    flip(_orbax_file(str(ckpts / "2"), "opt_state"), 0.5)
    before = _snapshot(ckpts)
    code, _, err = run_cli(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "step 2 is damaged" in lines[0] and "bytes" in lines[0], err
    assert "--resume-step 1" in lines[0], lines[0]
    assert _snapshot(ckpts) == before
