"""Reads of a file flaxheads wrote, every byte checked against the file's block digests before it is
handed out (:class:`~flaxheads.disk.checksums.Blocks`, recorded in ``checksums.json``).

A read of ``[offset, offset + n)`` goes block by block. Where the page cache holds the file, each block
is read in :data:`PIECE`-byte pieces (``RWF_NOWAIT``: from the page cache alone), each piece hashed
right after it is read, while the CPU's cache still holds it (xxh3 hashes cached bytes several times
faster than the kernel copies them from the page cache, so the check adds a few percent to the read).
From the first piece the page cache does not hold whole, a helper thread reads the read's next whole
blocks in :data:`COLD_READ`-byte reads (a disk serves large reads fastest: 256 KiB pieces, even with
the kernel reading ahead of them, read a cold 2 GB file at two thirds of the speed) while this thread
hashes each block as soon as it is in; the helper waits on the disk, not on a core. The bytes
the read wants go straight into the caller's buffer; those of a block it wants in part (a tensor's
first or last block, a header) that it does not want go into one of two reused buffers, hashed with
the rest, and are kept: the next tensor, which starts in that block, copies them from there without
reading them again. A process that reads part of a file (a sharded load) reads and checks the blocks
of that part only. A file with no block digests is read as it is.

(Measured and dropped, bench/checked_load.py: hashing on a helper thread while the next block is read
from the page cache cost more than hashing inline on a machine whose cores are busy; asking the
kernel to read a whole 2 GB range ahead, ``WILLNEED``, read the range before the first piece could
be hashed.)
"""

from __future__ import annotations

import os
import threading
from functools import partial

import numpy as np
import xxhash

from flaxheads.disk.checksums import Blocks, block_digest

_PREADV = hasattr(os, "preadv")
#: Bytes read then hashed at a time: small enough to stay in the CPU's cache between the two.
PIECE = 256 << 10
_KEPT = 2  # partly read blocks kept, checked (a tensor's last block is the next one's first)
#: Bytes a read from the disk asks for at a time when the page cache does not hold the file.
COLD_READ = 16 << 20
_NOWAIT = hasattr(os, "RWF_NOWAIT") and hasattr(os, "preadv")


def _pread_into(fd: int, dest: memoryview, offset: int) -> int:
    """Read ``len(dest)`` bytes at ``offset`` into ``dest``; the bytes read (fewer only at the end of the file)."""
    done = 0
    while done < len(dest):  # a read may return less (signals, the kernel's ~2 GiB cap per call)
        if _PREADV:
            got = os.preadv(fd, [dest[done:]], offset + done)
        else:  # no preadv (some platforms): a copy through bytes
            chunk = os.pread(fd, len(dest) - done, offset + done)
            dest[done : done + len(chunk)] = chunk
            got = len(chunk)
        if got == 0:
            break
        done += got
    return done


class _ColdRead:
    """What the reading thread of :meth:`CheckedFile._read_cold` has done, shared under its condition."""

    def __init__(self) -> None:
        self.done = 0
        self.finished = False
        self.stop = False
        self.error: BaseException | None = None


def _arrived(state: _ColdRead, upto: int) -> bool:
    return state.done >= upto or state.finished


class CheckedFile:
    """Checked reads of the open descriptor ``fd`` of ``blocks.path`` (``blocks`` None: plain reads).
    :meth:`read_into` and :meth:`pread` raise :class:`~flaxheads.disk.checksums.ChecksumError` naming the
    first block whose bytes differ from the record, and :class:`EOFError` for a read past the end."""

    def __init__(self, fd: int, blocks: Blocks | None):
        self.fd, self.blocks = fd, blocks
        self._cold = False  # within a read: the page cache did not hold a piece of it
        self._kept: list[tuple[int, np.ndarray, tuple]] = []  # (block, buffer, its checked ranges), latest last

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

    def _record(self) -> Blocks:
        assert self.blocks is not None, "a checked read needs the file's block records"
        return self.blocks

    def _checked(self, dest: memoryview, offset: int) -> int:
        b = self._record()
        end = min(offset + len(dest), b.size)
        self._cold = False
        pos = offset
        while pos < end:
            k = pos // b.block
            start, stop = b.span(k)
            a, z = max(start, offset), min(stop, end)  # the part of block k this read wants
            kept = self._kept_part(k, a, z)
            if kept is not None:
                dest[a - offset : z - offset] = kept
            elif a == start and z == stop and self._cold:
                # the page cache did not hold the last piece read: the whole blocks from here, in large reads
                last = (end // b.block) * b.block if end < b.size else end
                self._read_cold(dest[start - offset : last - offset], start, k)
                stop = last
            else:
                self._read_block(k, dest[a - offset : z - offset], a, z)
            pos = stop
        return max(0, end - offset)

    def _nowait(self, piece: memoryview, at: int) -> int:
        """Bytes of ``piece`` read at ``at`` from the page cache alone (``RWF_NOWAIT``: what it holds, no wait)."""
        if not _NOWAIT:
            return 0
        try:
            return os.preadv(self.fd, [piece], at, os.RWF_NOWAIT)
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: a file system without it
            return 0

    def _read_cold(self, view: memoryview, at: int, k0: int) -> None:
        """Whole blocks from ``k0`` that the page cache does not hold: a helper thread reads them in
        :data:`COLD_READ`-byte reads (the disk serves large reads fastest) while this one hashes each block
        as soon as it is in; the thread waits on the disk, not on a core."""
        b, n = self._record(), len(view)
        state = _ColdRead()
        cond = threading.Condition()

        def reader() -> None:
            pos = 0
            try:
                while pos < n and not state.stop:
                    want = min(COLD_READ, n - pos)
                    got = _pread_into(self.fd, view[pos : pos + want], at + pos)
                    pos += got
                    with cond:
                        state.done = pos
                        cond.notify()
                    if got < want:
                        break
            except BaseException as e:  # noqa: BLE001 (handed to the reading thread)
                state.error = e
            finally:
                with cond:
                    state.finished = True
                    cond.notify()

        thread = threading.Thread(target=reader, name="flaxheads-checked-read", daemon=True)
        thread.start()
        try:
            for k in range(k0, k0 + -(-n // b.block)):
                start, stop = b.span(k)
                with cond:
                    cond.wait_for(partial(_arrived, state, stop - at))
                if state.error is not None:
                    raise state.error
                if state.done < stop - at or block_digest(view[start - at : stop - at]) != b.digests[k]:
                    raise b.mismatch(k)  # differs, or the file was cut while open
        finally:
            state.stop = True
            thread.join()

    def _read_block(self, k: int, part: memoryview, a: int, z: int) -> None:
        """Read block ``k``: its bytes ``[a, z)`` into ``part`` (the caller's buffer), the others into a reused
        buffer, hashed in order; :class:`ChecksumError` unless they are the recorded ones. The other bytes are
        kept for the next read that wants them (a tensor's last block is the next one's first)."""
        blocks = self._record()
        start, stop = blocks.span(k)
        h = xxhash.xxh3_64()
        buf = None
        if a > start or z < stop:  # the least recently used buffer, reused (no new pages to fault in)
            buf = self._kept.pop(0)[1] if len(self._kept) >= _KEPT else np.empty(blocks.block, np.uint8)
        view = memoryview(buf) if buf is not None else None
        for lo, hi, into in ((start, a, view), (a, z, None), (z, stop, view)):
            if hi > lo:
                self._hash_read(h, into[lo - start : hi - start] if into is not None else part, lo, k)
        if h.hexdigest() != blocks.digests[k]:
            raise blocks.mismatch(k)
        if buf is not None:
            self._kept.append((k, buf, ((start, a), (z, stop))))

    def _hash_read(self, h, view: memoryview, at: int, k: int) -> None:
        """Read ``view`` from ``at`` piece by piece into ``h``, each piece hashed while the cache holds it.
        A piece the page cache does not hold whole marks the read cold (its next whole blocks: large reads)."""
        for i in range(0, len(view), PIECE):
            piece = view[i : i + PIECE]
            got = 0 if self._cold else self._nowait(piece, at + i)
            if got < len(piece):
                self._cold = _NOWAIT
                if _pread_into(self.fd, piece[got:], at + i + got) < len(piece) - got:
                    raise self._record().mismatch(k)  # the file was cut while open
            h.update(piece)

    def _kept_part(self, k: int, a: int, z: int) -> memoryview | None:
        """Bytes ``[a, z)`` of block ``k`` when a checked read kept them, else None."""
        start = k * self._record().block
        for i, (j, buf, ranges) in enumerate(self._kept):
            if j == k and any(lo <= a and z <= hi for lo, hi in ranges):
                self._kept.append(self._kept.pop(i))
                return memoryview(buf)[a - start : z - start]
        return None
