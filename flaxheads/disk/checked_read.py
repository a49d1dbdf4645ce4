"""Reads of a file flaxheads wrote, every byte checked against the file's block digests before it is
handed out (:class:`~flaxheads.disk.checksums.Blocks`, recorded in ``checksums.json``).

A read of ``[offset, offset + n)`` goes block by block. A block the read covers whole is read straight
into the caller's buffer and hashed there; while one block is hashed (on a helper thread: xxhash lets
go of the GIL) the next one is read, so on a machine with a spare core the check costs little more
than the read. A block the read covers in part (a tensor's first or last bytes, a header) is read
whole into a small cache, hashed, and the part copied out: the next tensor, which starts in that
block, copies from the cache without reading it again. A process that reads part of a file (a
sharded load) reads and checks the blocks of that part only. A file with no block digests is read
as it is.
"""
from __future__ import annotations

import collections
import concurrent.futures
import os
import threading

from flaxheads.disk.checksums import Blocks

_PREADV = hasattr(os, "preadv")
_CACHED = 2  # partly read blocks kept, verified (a tensor's last block is the next one's first)
_POOL: list[concurrent.futures.ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def _hasher() -> concurrent.futures.ThreadPoolExecutor:
    with _POOL_LOCK:
        if not _POOL or _POOL[0]._shutdown:  # noqa: SLF001 (a pool shut down at exit is not reused)
            _POOL[:] = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flaxheads-checksums")]
        return _POOL[0]


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
        self._cache: collections.OrderedDict[int, bytes] = collections.OrderedDict()

    def pread(self, n: int, offset: int) -> bytes:
        out = bytearray(n)
        got = self.read_into(memoryview(out), offset, partial=True)
        return bytes(out[:got])

    def read_into(self, dest: memoryview, offset: int, *, partial: bool = False) -> int:
        """Fill ``dest`` with the bytes at ``offset``; returns how many (``partial``: fewer at the end of
        the file; else a short read is :class:`EOFError`)."""
        dest = dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest
        if self.blocks is None:
            got = _pread_into(self.fd, dest, offset)
        else:
            got = self._checked(dest, offset)
        if got < len(dest) and not partial:
            raise EOFError(f"{len(dest)} bytes at {offset} run past the end of the file")
        return got

    def _checked(self, dest: memoryview, offset: int) -> int:
        b, end = self.blocks, min(offset + len(dest), self.blocks.size)
        whole = [k for k in range(offset // b.block, max(offset, end - 1) // b.block + 1)
                 if b.span(k)[0] >= offset and b.span(k)[1] <= end]
        pool = _hasher() if len(whole) > 1 else None
        pending: list[tuple[int, concurrent.futures.Future | memoryview]] = []
        pos = offset
        try:
            while pos < end:
                k = pos // b.block
                start, stop = b.span(k)
                if start >= offset and stop <= end:  # the whole block: read in place, hashed there
                    view = dest[start - offset:stop - offset]
                    if _pread_into(self.fd, view, start) < len(view):
                        raise b.mismatch(k)  # the file was cut while open
                    pending.append((k, pool.submit(b.check, k, view) if pool is not None else view))
                else:
                    data, take = self._block(k), min(stop, end) - pos
                    dest[pos - offset:pos - offset + take] = data[pos - start:pos - start + take]
                pos = stop
        finally:
            for k, job in pending:  # every block handed out is checked (and no job outlives the buffer)
                if isinstance(job, concurrent.futures.Future):
                    job.result()
                else:
                    b.check(k, job)
        return end - offset if end > offset else 0

    def _block(self, k: int) -> bytes:
        """Block ``k`` whole, checked (kept for the next read that starts in it)."""
        if k in self._cache:
            self._cache.move_to_end(k)
            return self._cache[k]
        start, stop = self.blocks.span(k)
        data = os.pread(self.fd, stop - start, start)
        self.blocks.check(k, data)
        self._cache[k] = data
        while len(self._cache) > _CACHED:
            self._cache.popitem(last=False)
        return data
