"""Checksums: every folder flaxheads writes (exports, checkpoint steps) records each file's SHA-256 and
the digests of its blocks, and a bit flipped anywhere afterwards is found on the default load (never a
silent load), named by its byte range; a folder written elsewhere is checked with --verify for
impossible headers and NaN / Inf."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess

import jax
import numpy as np
import pytest

import flaxheads as fh
from flaxheads.checkpoint.meta import CorruptCheckpointError
from flaxheads.disk import checksums, scan


@pytest.fixture(scope="module")
def model(tiny_bert):
    return fh.from_pretrained(tiny_bert, pooler="mean", head="linear", num_labels=3)


def _flip(path: str, at: float | int = 0.5) -> None:
    """Flip one bit of ``path`` at a fraction of its size (or a byte offset)."""
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        pos = int(size * at) if isinstance(at, float) else at
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))


def _tensor_offset(path: str, name: str | None = None) -> int:
    """A byte inside the data of a tensor of a safetensors file (the largest, or ``name``)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    name = name or max(header, key=lambda k: np.subtract(*header[k]["data_offsets"][::-1]))
    start, end = header[name]["data_offsets"]
    return 8 + n + (start + end) // 2


def test_manifest_matches_coreutils_sha256sum(model, tmp_path):
    out = fh.export(model, tmp_path / "exp", "transformers")
    manifest = json.load(open(os.path.join(out, checksums.MANIFEST)))
    files = sorted(manifest["files"])
    assert "model.safetensors" in files and "config.json" in files
    if shutil.which("sha256sum") is None:
        pytest.skip("coreutils sha256sum is not installed")
    got = subprocess.run(["sha256sum", *files], cwd=out, capture_output=True, text=True, check=True).stdout
    ref = {line.split()[1]: line.split()[0] for line in got.splitlines()}
    assert {f: manifest["files"][f]["sha256"] for f in files} == ref
    assert all(manifest["files"][f]["size"] == os.path.getsize(os.path.join(out, f)) for f in files)


@pytest.mark.parametrize(
    "fmt,weights",
    [
        ("transformers", "model.safetensors"),
        ("head", "head.safetensors"),
        ("sentence-transformers", "model.safetensors"),
    ],
)
def test_a_flipped_byte_in_tensor_data_fails_the_load(model, tiny_bert, tmp_path, fmt, weights):
    out = fh.export(model, tmp_path / fmt, fmt, **({"tokenizer_from": tiny_bert} if fmt != "head" else {}))
    load = (lambda: fh.load(out, backbone=tiny_bert)) if fmt == "head" else (lambda: fh.load(out))
    load()  # intact: loads
    path = os.path.join(out, weights)
    _flip(path, _tensor_offset(path))
    with pytest.raises(checksums.ChecksumError, match=weights) as e:
        load()
    assert e.value.exit_code == 1 and "restore it" in str(e.value)


def test_a_config_edited_after_writing_fails_the_load(model, tmp_path):
    out = fh.export(model, tmp_path / "exp", "transformers")
    cfg = os.path.join(out, "config.json")
    with open(cfg, "a") as f:
        f.write(" ")
    with pytest.raises(checksums.ChecksumError, match="config.json"):
        fh.load(out)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks small enough that a tiny model's weights file has dozens of them."""
    monkeypatch.setattr(checksums, "BLOCK", 4096)
    checksums.forget()


def _range_of(err: str) -> tuple[int, int]:
    """The byte range a mismatch names ("bytes A..B differ")."""
    a, b = re.search(r"bytes (\d+)\.\.(\d+) differ", err).groups()
    return int(a), int(b)


@pytest.mark.parametrize("at", [20, 0.37, 0.61, 0.83, -3])  # the header, tensor data, the last bytes
def test_a_flipped_bit_anywhere_fails_the_default_load_naming_the_byte_range(model, tmp_path, small_blocks, at):
    out = fh.export(model, tmp_path / "exp", "transformers")
    path = os.path.join(out, "model.safetensors")
    record = json.load(open(os.path.join(out, checksums.MANIFEST)))["files"]["model.safetensors"]
    assert len(record["blocks"]) == -(-record["size"] // 4096) > 10
    pos = at if isinstance(at, float) else (at % record["size"])
    pos = int(record["size"] * pos) if isinstance(pos, float) else pos
    _flip(path, pos)
    with pytest.raises(checksums.ChecksumError, match="model.safetensors: bytes") as e:
        fh.load(out)
    a, b = _range_of(str(e.value))
    assert a <= pos < b and b - a <= 4096 and "\n" not in str(e.value)
    _flip(path, pos)  # whole again: loads
    fh.load(out)


def test_commands_refuse_a_flipped_bit_in_one_line_and_write_nothing(model, tiny_bert, tmp_path, small_blocks, capsys):
    from flaxheads.cli.main import main

    out = fh.export(model, tmp_path / "exp", "transformers", tokenizer_from=tiny_bert)
    path = os.path.join(out, "model.safetensors")
    _flip(path, 0.55)
    texts = tmp_path / "texts.txt"
    texts.write_text("sport news\nmarkets fell\n")
    for command in (
        lambda to: ["predict", out, "--input", str(texts), "--output", str(tmp_path / f"{to}.jsonl")],
        lambda to: ["export", "--from", out, "--format", "head", "--out", str(tmp_path / to)],
    ):
        for extra in ([], ["--verify"]):
            capsys.readouterr()
            assert main([*command("o"), *extra]) == 1
            assert not os.path.exists(tmp_path / "o") and not os.path.exists(tmp_path / "o.jsonl")
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and re.search(r"model.safetensors: .*bytes \d+\.\.\d+ differ", err[0]), err


def test_verify_hashes_whole_files_with_sha256_and_names_the_range(model, tmp_path, small_blocks):
    out = fh.export(model, tmp_path / "exp", "transformers")
    fh.load(out, verify=True)
    _flip(os.path.join(out, "config.json"), 0.5)  # same size: the bytes themselves differ
    for verify in (False, True):
        with pytest.raises(
            checksums.ChecksumError, match=r"config.json: (its SHA-256 differs.*)?bytes 0\.\.\d+ differ"
        ):
            fh.load(out, verify=verify)


def test_verify_scans_the_tensors_of_a_folder_written_elsewhere(model, tiny_bert, tmp_path):
    from safetensors.numpy import load_file, save_file

    out = fh.export(model, tmp_path / "exp", "transformers", tokenizer_from=tiny_bert)
    os.remove(os.path.join(out, checksums.MANIFEST))  # as if another tool wrote the folder
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    name = next(k for k, v in tensors.items() if v.dtype == np.float32 and v.ndim == 2)
    tensors[name][0, 0] = np.inf
    save_file(tensors, path, metadata={"format": "pt"})
    fh.load(out)  # no record to check, and the fast path does not read every tensor
    with pytest.raises(checksums.DamagedWeightsError, match=f"{name}.*NaN or Inf"):
        fh.load(out, verify=True)


def _orbax_data(step_dir: str, item: str) -> list[str]:
    return [
        os.path.join(d, f)
        for d, _, names in os.walk(os.path.join(step_dir, item))
        for f in names
        if os.path.basename(d) == "d"
    ]


def test_a_flipped_byte_in_a_checkpoint_fails_its_load_and_names_the_earlier_step(model, tmp_path):
    with fh.RunCheckpointer(tmp_path, model, keep=None) as ckr:
        for step in (1, 2):
            ckr.save(step, {"step": step, "params": model.params, "opt_state": {}})
    step2 = tmp_path / "checkpoints" / "2"
    manifest = json.load(open(step2 / checksums.MANIFEST))["files"]
    data = _orbax_data(str(step2), "backbone")
    assert data and all(os.path.relpath(p, step2) in manifest for p in data)
    before = fh.load(tmp_path).params
    big = max(data, key=os.path.getsize)
    _flip(big, 0.6)
    with pytest.raises(CorruptCheckpointError, match=r"step 2 is damaged.*step=1") as e:
        fh.load(tmp_path)
    assert isinstance(e.value, checksums.ChecksumError) and os.path.basename(big) in str(e.value)
    one = fh.load(tmp_path, step=1).params  # the earlier step still loads, equal to what was saved
    for a, b in zip(jax.tree.leaves(one["head"]), jax.tree.leaves(before["head"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _safetensors(path, tensors: dict) -> str:
    from safetensors.numpy import save_file

    save_file(tensors, path)
    return path


def test_scan_of_a_folder_without_checksums(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    ok = _safetensors(str(tmp_path / "ok.safetensors"), {"a": w, "b": np.ones(2, np.int64)})
    assert scan.scan_safetensors(ok) == 2
    nan = w.copy()
    nan[1, 2] = np.nan
    bad = _safetensors(str(tmp_path / "nan.safetensors"), {"a": nan})
    with pytest.raises(checksums.DamagedWeightsError, match="'a' holds 1 NaN or Inf"):
        scan.scan_safetensors(bad)
    cut = str(tmp_path / "cut.safetensors")
    with open(ok, "rb") as f:
        raw = f.read()
    with open(cut, "wb") as f:
        f.write(raw[:-8])
    with pytest.raises(checksums.DamagedWeightsError, match="outside"):
        scan.scan_safetensors(cut)
    os.remove(bad)
    os.remove(cut)
    assert checksums.verify_any(tmp_path) == ("scanned", 1)
