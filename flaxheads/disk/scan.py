"""Folders flaxheads did not write carry no checksums: their safetensors files are checked for what
cannot be (a header out of bounds, overlapping tensors, NaN or Inf values) when every byte is to be
checked (``--verify``, ``verify=True``)."""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from flaxheads.disk.checksums import DamagedWeightsError, verify_folder

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "BF16": None,
}  # others (float8 kinds) are one byte, not checked for NaN


def _damaged(path: str, what: str) -> DamagedWeightsError:
    return DamagedWeightsError(f"{path}: {what}; the file is damaged: download or write it again")


def scan_safetensors(path: str | os.PathLike) -> int:
    """Check a safetensors file that carries no checksum: the header parses, every tensor's byte
    range lies inside the data, matches its shape and dtype, and no two overlap; every float tensor
    is finite. Returns the tensor count; :class:`DamagedWeightsError` on the first problem."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise _damaged(path, f"{size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise _damaged(path, f"its header claims {n} bytes, past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise _damaged(path, f"its header is not JSON ({e})") from None
        data = size - 8 - n
        spans = []
        for name, t in header.items():
            if name == "__metadata__":
                continue
            start, end = t["data_offsets"]
            item = 2 if t["dtype"] == "BF16" else np.dtype(_DTYPES.get(t["dtype"], np.uint8)).itemsize
            if not 0 <= start <= end <= data:
                raise _damaged(path, f"tensor {name!r} lies at bytes {start}..{end}, outside the {data} bytes of data")
            if end - start != int(np.prod(t["shape"], dtype=np.int64)) * item:
                raise _damaged(path, f"tensor {name!r} has {end - start} bytes for shape {t['shape']} {t['dtype']}")
            spans.append((start, end, name))
            dt = _DTYPES.get(t["dtype"], "skip")
            if t["dtype"] == "BF16" or (dt not in (None, "skip") and np.issubdtype(dt, np.floating)):
                f.seek(8 + n + start)
                buf = f.read(end - start)
                if t["dtype"] == "BF16":
                    values = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
                else:
                    values = np.frombuffer(buf, dt)
                bad = int(np.size(values) - np.count_nonzero(np.isfinite(values)))
                if bad:
                    raise _damaged(path, f"tensor {name!r} holds {bad} NaN or Inf values")
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise _damaged(path, f"tensors {a!r} and {b!r} overlap")
    return len(spans)


def verify_any(folder: str | os.PathLike) -> tuple[str, int]:
    """Check a whole folder, hashing every byte: by its manifest, else each safetensors file by
    :func:`scan_safetensors`. Returns ("checksums" | "scanned", files checked)."""
    folder = os.fspath(folder)
    n = verify_folder(folder, whole=True)
    if n is not None:
        return "checksums", n
    files = [
        os.path.join(root, name)
        for root, _, names in os.walk(folder)
        for name in sorted(names)
        if name.endswith(".safetensors")
    ]
    for p in files:
        scan_safetensors(p)
    return "scanned", len(files)
