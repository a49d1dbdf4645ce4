"""Reads of a file flaxheads wrote, every byte checked against the file's block digests before it is
handed out (:class:`~flaxheads.disk.checksums.Blocks`, recorded in ``checksums.json``).

A read of ``[offset, offset + n)`` goes block by block. A block the read covers whole is read straight
into the caller's buffer in :data:`PIECE`-byte pieces, each hashed right after it is read, while the
CPU's cache still holds it (xxh3 hashes cached bytes several times faster than the kernel copies them
from the page cache, so the check adds a few percent to the read). A block the read covers in part (a
tensor's first or last bytes, a header) is read whole into one of two reused buffers, hashed, and the
part copied out: the next tensor, which starts in that block, copies from it without reading it again.
A process that reads part of a file (a sharded load) reads and checks the blocks of that part only. A
file with no block digests is read as it is.

(A helper thread hashing one block while the next is read was measured too: on a machine whose cores
are all busy it cost more than hashing inline, bench/checked_load.py.)
"""
from __future__ import annotations

import os

import numpy as np
import xxhash

from flaxheads.disk.checksums import Blocks

_PREADV = hasattr(os, "preadv")
#: Bytes read then hashed at a time: small enough to stay in the CPU's cache between the two.
PIECE = 256 << 10
_KEPT = 2  # partly read blocks kept, checked (a tensor's last block is the next one's first)


def _pread_into(fd: int, dest: memoryview, offset: int) -> int:
    """Read ``len(dest)`` bytes at ``offset`` into ``dest``; the bytes read (fewer only at the end of the file)."""
    done = 0
    while done < len(dest):  # a read may return less (signals, the kernel's ~2 GiB cap per call)
        if _PREADV:
            got = os.preadv(fd, [dest[done:]], offset + done)
        else:  # no preadv (some platforms): a copy through bytes
            chunk = os.pread(fd, len(dest) - done, offset + done)
            dest[done:done + len(chunk)] = chunk
            got = len(chunk)
        if got == 0:
            break
        done += got
    return done


class CheckedFile:
    """Checked reads of the open descriptor ``fd`` of ``blocks.path`` (``blocks`` None: plain reads).
    :meth:`read_into` and :meth:`pread` raise :class:`~flaxheads.disk.checksums.ChecksumError` naming the
    first block whose bytes differ from the record, and :class:`EOFError` for a read past the end."""

    def __init__(self, fd: int, blocks: Blocks | None):
        self.fd, self.blocks = fd, blocks
        self._kept: list[tuple[int, np.ndarray, int]] = []  # (block, buffer, its bytes), the latest last

    def pread(self, n: int, offset: int) -> bytes:
        out = bytearray(n)
        got = self.read_into(memoryview(out), offset, partial=True)
        return bytes(out[:got])

    def read_into(self, dest: memoryview, offset: int, *, partial: bool = False) -> int:
        """Fill ``dest`` with the bytes at ``offset``; returns how many (``partial``: fewer at the end of
        the file; else a short read is :class:`EOFError`)."""
        dest = dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest
        got = _pread_into(self.fd, dest, offset) if self.blocks is None else self._checked(dest, offset)
        if got < len(dest) and not partial:
            raise EOFError(f"{len(dest)} bytes at {offset} run past the end of the file")
        return got

    def _checked(self, dest: memoryview, offset: int) -> int:
        b, end = self.blocks, min(offset + len(dest), self.blocks.size)
        pos = offset
        while pos < end:
            k = pos // b.block
            start, stop = b.span(k)
            if start >= offset and stop <= end:  # the whole block: read in place, hashed there
                if self._read_hashed(dest[start - offset:stop - offset], start, k) != b.digests[k]:
                    raise b.mismatch(k)
            else:
                data, take = self._block(k), min(stop, end) - pos
                dest[pos - offset:pos - offset + take] = data[pos - start:pos - start + take]
            pos = stop
        return max(0, end - offset)

    def _read_hashed(self, view: memoryview, start: int, k: int) -> str:
        """Read ``view`` from ``start`` piece by piece, each hashed while the cache holds it; the digest."""
        h = xxhash.xxh3_64()
        for at in range(0, len(view), PIECE):
            piece = view[at:at + PIECE]
            if _pread_into(self.fd, piece, start + at) < len(piece):
                raise self.blocks.mismatch(k)  # the file was cut while open
            h.update(piece)
        return h.hexdigest()

    def _block(self, k: int) -> memoryview:
        """Block ``k`` whole, checked (kept for the next read that starts in it)."""
        for i, (j, buf, n) in enumerate(self._kept):
            if j == k:
                self._kept.append(self._kept.pop(i))
                return memoryview(buf)[:n]
        start, stop = self.blocks.span(k)
        # the least recently used block's buffer, reused (no new pages to fault in)
        buf = self._kept.pop(0)[1] if len(self._kept) >= _KEPT else np.empty(self.blocks.block, np.uint8)
        data = memoryview(buf)[:stop - start]
        if self._read_hashed(data, start, k) != self.blocks.digests[k]:
            raise self.blocks.mismatch(k)
        self._kept.append((k, buf, stop - start))
        return data
