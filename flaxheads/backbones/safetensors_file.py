"""A small safetensors reader that reads boxes of tensors with ``os.pread`` into fresh numpy buffers.

The format: 8 bytes (little-endian ``u64``) giving the header's length ``N``, a JSON header of ``N``
bytes, ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data, offsets counted from byte ``8 + N``, every tensor row-major and little-endian.

``safetensors.safe_open`` memory-maps the file: the pages a read touches count in the process's
resident memory for as long as the file is open, and a column slice of a row-major tensor touches
every page of it. Here a box (a slice per axis) is read as its contiguous runs: one read when only
the leading axis is cut, one per row segment otherwise, into a buffer that belongs to the caller and
is freed with it; nothing is mapped. The bytes of tensor data read by this process are counted
(:func:`bytes_read`), so a loader's reads can be checked.

A file flaxheads wrote is read through :class:`~flaxheads.disk.checked_read.CheckedFile`: every
byte handed out, the header's included, was checked against the file's block digests first (a read
of part of a tensor reads and checks the blocks that part lies in). :meth:`SafetensorsFile.read_all`
is the eager read: the whole file in one pass into one buffer, each tensor a view of it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from flaxheads.backbones.weights import WeightsError
from flaxheads.disk.checked_read import CheckedFile
from flaxheads.disk.checksums import reader_blocks

#: safetensors dtype names -> numpy dtypes (little-endian, as stored)
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype(np.bool_),
    "C64": np.dtype("<c8"),
}
#: a header larger than this is not a safetensors header (the format's own reader refuses 100 MB)
MAX_HEADER = 100 << 20
_READ = [0]  # tensor bytes read by this process (a list: mutable without a global statement)


def bytes_read() -> int:
    """Bytes of tensor data this process has read through :class:`SafetensorsFile` so far."""
    return _READ[0]


def damaged(path: str, what: str) -> WeightsError:
    """The one error of an unreadable file: it names the file and what is wrong with it."""
    return WeightsError(
        f"{path}: {what}; the file is truncated or corrupt, as a download that stopped part-way "
        "leaves it: download the model again (or re-save it with save_pretrained)"
    )


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: its dtype, shape and the absolute byte offset of its data."""

    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _box(box: Sequence[slice] | None, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` per axis of a box of unit-step slices (missing trailing axes are whole)."""
    box = tuple(box or ()) + (slice(None),) * (len(shape) - len(box or ()))
    if len(box) != len(shape):
        raise ValueError(f"a box of {len(box)} slices for a tensor of shape {shape}")
    out = []
    for s, n in zip(box, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"boxes are read with unit steps, not {s}")
        out.append((start, max(start, stop)))
    return tuple(out)


class SafetensorsFile:
    """One safetensors file, its header parsed and bounds-checked on open; :meth:`read` reads a box of
    a tensor. Use as a context manager (or :meth:`close`): the open descriptor is its only resource.
    ``check``: read a file flaxheads wrote through its block digests (its size is checked on open)."""

    def __init__(self, path: str | os.PathLike, *, check: bool = True):
        self.path = os.fspath(path)
        self._fd = -1
        blocks = reader_blocks(self.path) if check else None  # before the open: a missing file says so
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._file = CheckedFile(self._fd, blocks)
        try:
            self.tensors, self.metadata = self._header()
        except BaseException:
            self.close()  # and forget the number: __del__ runs on this half-made object too, and by then the
            raise  # number may be another file's

    def _header(self) -> tuple[dict[str, TensorInfo], dict]:
        size = os.fstat(self._fd).st_size
        raw = self._file.pread(8, 0)
        if len(raw) < 8:
            raise damaged(self.path, f"{size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise damaged(self.path, f"its header claims {n} bytes, past the end of the file ({size} bytes)")
        if n > MAX_HEADER:
            raise damaged(self.path, f"its header claims {n} bytes, more than a safetensors header holds")
        try:
            header = json.loads(self._file.pread(n, 8))
            if not isinstance(header, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise damaged(self.path, f"its header is not JSON ({str(e)[:120]})") from None
        data, available = 8 + n, size - 8 - n
        tensors = {}
        for name, t in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (begin, end) = DTYPES[t["dtype"]], tuple(int(d) for d in t["shape"]), t["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise damaged(
                    self.path,
                    f"tensor {name!r} has no readable dtype, shape and data_offsets in the header ({str(t)[:120]})",
                ) from None
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= available):
                raise damaged(
                    self.path, f"tensor {name!r} lies at bytes {begin}..{end}, outside the {available} bytes of data"
                )
            info = TensorInfo(dtype, shape, data + begin)
            if min(shape, default=0) < 0 or end - begin != info.nbytes:
                raise damaged(
                    self.path, f"tensor {name!r} has {end - begin} bytes for shape {list(shape)} {t['dtype']}"
                )
            tensors[name] = info
        meta = header.get("__metadata__") or {}
        return tensors, meta if isinstance(meta, dict) else {}

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):
            pass

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self, name: str, box: Sequence[slice] | None = None) -> np.ndarray:
        """The part ``box`` (a unit-step slice per leading axis; default the whole tensor) of tensor
        ``name``, in its stored dtype, as a fresh array. Each contiguous run of the box in the file is
        one read, straight into the array's memory."""
        if name not in self.tensors:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        info = self.tensors[name]
        spans = _box(box, info.shape)
        lens = tuple(b - a for a, b in spans)
        out = np.empty(lens, info.dtype)
        if out.size == 0:
            return out
        # axes after the last cut one are whole, so each run covers the cut axis' span and all of them
        cut = [a for a, (span, n) in enumerate(zip(lens, info.shape)) if span != n]
        k = cut[-1] if cut else 0
        strides = [math.prod(info.shape[a + 1 :]) for a in range(len(info.shape))]  # in elements
        run = math.prod(lens[k:]) * info.dtype.itemsize
        first = info.offset + sum(spans[a][0] * strides[a] for a in range(k, len(spans))) * info.dtype.itemsize
        starts = np.zeros((), np.int64) + first
        for a in range(k):  # every combination of the outer axes' indices, in row-major order
            steps = np.arange(spans[a][0], spans[a][1], dtype=np.int64) * strides[a] * info.dtype.itemsize
            starts = starts[..., None] + steps
        dest = memoryview(out.reshape(-1).view(np.uint8))
        for j, at in enumerate(starts.reshape(-1).tolist()):
            self._read_into(dest[j * run : (j + 1) * run], at, name)
        _READ[0] += out.nbytes
        return out

    def read_all(self) -> dict[str, np.ndarray]:
        """Every tensor, in its stored dtype: the data read in one pass into one buffer, each tensor a view
        of it (a copy where its offset does not suit its dtype's alignment)."""
        if not self.tensors:
            return {}
        start = min(t.offset for t in self.tensors.values())
        stop = max(t.offset + t.nbytes for t in self.tensors.values())
        buf = np.empty(stop - start, np.uint8)
        self._read_into(memoryview(buf), start, "(all)")
        out = {}
        for name, t in self.tensors.items():
            raw = buf[t.offset - start : t.offset - start + t.nbytes]
            if (t.offset - start) % t.dtype.itemsize:
                raw = raw.copy()
            out[name] = raw.view(t.dtype).reshape(t.shape)
        _READ[0] += int(buf.nbytes)
        return out

    def _read_into(self, dest: memoryview, offset: int, name: str) -> None:
        try:
            self._file.read_into(dest, offset)
        except EOFError:
            raise damaged(self.path, f"tensor {name!r} ends past the end of the file") from None
