"""The checked reader: any read of any range gives the file's bytes, every one of them checked, whether
the page cache holds the file or not; a read that touches a damaged block is refused naming that
block's byte range, one that does not touch it is not (a process reading its own part of a file checks
the blocks of that part)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from flaxheads.disk import checksums
from flaxheads.disk.checked_read import CheckedFile


@pytest.fixture(params=["cached", "from the disk"])
def file(tmp_path, monkeypatch, request):
    """A file of 10 blocks and a part; read as the page cache holds it, or as a file it does not hold (read
    in large reads by a helper thread, each block hashed as it comes in; 2500-byte reads here)."""
    import flaxheads.disk.checked_read as checked_read

    monkeypatch.setattr(checksums, "BLOCK", 1000)
    if request.param == "from the disk":
        monkeypatch.setattr(CheckedFile, "_nowait", lambda self, piece, at: 0)
        monkeypatch.setattr(checked_read, "COLD_READ", 2500)
    data = np.random.default_rng(0).integers(0, 256, 10_500, dtype=np.uint8).tobytes()  # 10 blocks and a part
    (tmp_path / "x.safetensors").write_bytes(data)
    checksums.write_manifest(tmp_path)
    return str(tmp_path / "x.safetensors"), data


def _reader(path):
    fd = os.open(path, os.O_RDONLY)
    return CheckedFile(fd, checksums.reader_blocks(path)), fd


def _ranges(seed: int, n: int = 300):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a = int(rng.integers(0, 10_500))
        out.append((a, int(rng.integers(0, min(3_500, 10_500 - a) + 1))))
    pos = 0  # and sequential reads, as a loader reads tensor after tensor
    for size in rng.integers(1, 2_500, 12):
        out.append((pos, int(min(size, 10_500 - pos))))
        pos += out[-1][1]
    return out


def test_any_read_gives_the_files_bytes(file):
    path, data = file
    reader, fd = _reader(path)
    try:
        for a, n in _ranges(1):
            buf = bytearray(n)
            assert reader.read_into(memoryview(buf), a) == n
            assert bytes(buf) == data[a : a + n], (a, n)
        assert reader.pread(100, 10_450) == data[10_450:]  # short at the end of the file
        with pytest.raises(EOFError):
            reader.read_into(memoryview(bytearray(100)), 10_450)
    finally:
        os.close(fd)


def test_only_reads_that_touch_a_damaged_block_are_refused(file):
    path, data = file
    with open(path, "r+b") as f:
        f.seek(4_321)
        f.write(bytes([data[4_321] ^ 1]))
    reader, fd = _reader(path)
    try:
        for a, n in _ranges(2):
            buf = bytearray(n)
            if a < 5_000 and a + n > 4_000:  # touches block 4, bytes 4000..5000
                with pytest.raises(checksums.ChecksumError) as e:
                    reader.read_into(memoryview(buf), a)
                assert re.search(r"x\.safetensors: bytes 4000\.\.5000 differ", str(e.value)), str(e.value)
            else:
                reader.read_into(memoryview(buf), a)
                assert bytes(buf) == data[a : a + n]
    finally:
        os.close(fd)


def test_a_file_cut_after_its_size_was_checked_is_refused(file):
    path, _ = file
    reader, fd = _reader(path)
    try:
        os.truncate(path, 7_000)
        with pytest.raises(checksums.ChecksumError, match="bytes 7000..8000"):
            reader.read_into(memoryview(bytearray(2_000)), 6_500)
    finally:
        os.close(fd)
