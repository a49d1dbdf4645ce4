"""The one place flaxheads writes and checks file checksums.

Every folder flaxheads writes (an export, a checkpoint step) gets a ``checksums.json``: for each
file its size, its SHA-256 and, for a file larger than :data:`WHOLE_LIMIT`, the SHA-256 of a
sample (its first MiB, :data:`SAMPLES` blocks spread over it and its last block). Safetensors and
Orbax's files carry no checksum of their own, so without it a flipped byte inside tensor data loads
silently.

Loading checks what it reads: the size always, the whole hash of small files and the sample hash of
large ones (the fast path: a load of a 400 MB model reads about 2 MB more); :func:`full` (``fh.load(...,
verify=True)``, ``flaxheads checkpoints PATH --verify``, ``FLAXHEADS_VERIFY=1``) hashes every byte.
A folder without the file (written elsewhere, or by an older flaxheads) loads as before; for those,
:func:`scan_safetensors` checks each header's bounds and every tensor for NaN / Inf."""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import struct
from typing import Iterator

import numpy as np

from flaxheads.errors import FlaxheadsError

MANIFEST = "checksums.json"
FORMAT = "flaxheads-checksums/1"
#: What ``--verify`` does, for the commands that take it.
VERIFY_HELP = ("read every array and hash every byte of every file flaxheads wrote that the command reads (default: "
               "sizes, small files whole, samples of large ones); folders written elsewhere: every tensor checked for "
               "NaN/Inf and the headers' bounds; anything damaged is one line, exit 1")
#: Files up to this size are hashed whole on every load (a head, configs, a tokenizer).
WHOLE_LIMIT = 8 << 20
HEAD_BYTES = 1 << 20  # a safetensors header (names, shapes, offsets) lies in its first bytes
BLOCK = 1 << 16
SAMPLES = 32
_CHUNK = 8 << 20

_FULL: contextvars.ContextVar[bool] = contextvars.ContextVar("flaxheads_full_verify", default=False)
_CHECKED: dict[tuple, bool] = {}  # (path, size, mtime, full) already checked in this process


class ChecksumError(FlaxheadsError):
    """A file whose bytes differ from what flaxheads recorded when it wrote it (or that is
    missing from the folder it was written in). Not a mistake in the command: programs exit 1."""

    exit_code = 1


class DamagedWeightsError(ChecksumError):
    """A weights file with no recorded checksum whose header or values are impossible (offsets out of
    bounds, NaN or Inf)."""


# ---- digests ------------------------------------------------------------------------------------
def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sample_offsets(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the sampled regions of a file of ``size`` bytes: head, spread blocks, tail."""
    regions = [(0, min(size, HEAD_BYTES))]
    span = size - HEAD_BYTES - BLOCK
    if span > 0:
        regions += [(HEAD_BYTES + span * i // SAMPLES, BLOCK) for i in range(SAMPLES)]
    regions.append((max(0, size - BLOCK), min(size, BLOCK)))
    return regions


def _sample_sha256(path: str, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for offset, length in _sample_offsets(size):
            f.seek(offset)
            h.update(f.read(length))
    return h.hexdigest()


def file_record(path: str) -> dict:
    """``{"size", "sha256"[, "sample_sha256"]}`` of one file."""
    size = os.path.getsize(path)
    rec = {"size": size, "sha256": _sha256_file(path)}
    if size > WHOLE_LIMIT:
        rec["sample_sha256"] = _sample_sha256(path, size)
    return rec


# ---- writing ------------------------------------------------------------------------------------
def _files(folder: str) -> Iterator[str]:
    """Relative paths (``/``-separated) of every regular file under ``folder``, but the manifest."""
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if rel != MANIFEST and not os.path.islink(os.path.join(root, name)):
                yield rel


def write_manifest(folder: str | os.PathLike) -> dict:
    """Record the size and SHA-256 of every file under ``folder`` in ``folder/checksums.json``
    (written to a temporary name and renamed: a cut write leaves no half manifest)."""
    folder = os.fspath(folder)
    manifest = {"format": FORMAT, "algorithm": "sha256", "whole_limit": WHOLE_LIMIT,
                "files": {rel: file_record(os.path.join(folder, rel)) for rel in _files(folder)}}
    tmp = os.path.join(folder, f".{MANIFEST}.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST))
    return manifest


# ---- checking -----------------------------------------------------------------------------------
def full_requested() -> bool:
    """Whether loads hash every byte now (:func:`full`, or ``FLAXHEADS_VERIFY=1`` in the environment)."""
    return _FULL.get() or os.environ.get("FLAXHEADS_VERIFY", "") not in ("", "0")


@contextlib.contextmanager
def full(on: bool = True) -> Iterator[None]:
    """Within the block, every load hashes whole files (``on=False``: the fast path)."""
    token = _FULL.set(on or _FULL.get())
    try:
        yield
    finally:
        _FULL.reset(token)


def read_manifest(folder: str | os.PathLike) -> dict | None:
    """The manifest of ``folder``, or None when it has none; :class:`ChecksumError` when unreadable."""
    path = os.path.join(os.fspath(folder), MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"expected format {FORMAT!r} with a 'files' object")
    except (OSError, ValueError, AttributeError) as e:
        raise ChecksumError(f"{path}: the checksum manifest is damaged ({type(e).__name__}: {str(e)[:120]}), so "
                            "the folder's files cannot be checked; write the folder again (or delete that file "
                            "to load the folder unchecked)") from None
    return manifest


def _mismatch(path: str, manifest: str, what: str) -> ChecksumError:
    return ChecksumError(f"{path}: {what} differs from the one recorded in {manifest} when flaxheads wrote it: the "
                         "file was changed or damaged since; restore it from a copy or write it again")


def check_file(folder: str, rel: str, record: dict, *, whole: bool | None = None) -> None:
    """Check one file of ``folder`` against its ``record``; :class:`ChecksumError` on a difference."""
    path = os.path.join(folder, rel)
    whole = full_requested() if whole is None else whole
    manifest = os.path.join(folder, MANIFEST)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ChecksumError(f"{path} is missing: {manifest} lists it as written there; restore it from a copy or "
                            "write the folder again") from None
    key = (path, st.st_size, st.st_mtime_ns, whole or st.st_size <= WHOLE_LIMIT)
    if _CHECKED.get(key):
        return
    if st.st_size != record.get("size"):
        raise ChecksumError(f"{path}: {st.st_size} bytes where {manifest} records {record.get('size')}: the file "
                            "was cut or changed since flaxheads wrote it; restore it from a copy or write it again")
    if whole or "sample_sha256" not in record:
        if _sha256_file(path) != record.get("sha256"):
            raise _mismatch(path, manifest, "its SHA-256")
    elif _sample_sha256(path, st.st_size) != record["sample_sha256"]:
        raise _mismatch(path, manifest, "the SHA-256 of its sampled bytes")
    _CHECKED[key] = True


def verify_folder(folder: str | os.PathLike, *, whole: bool | None = None,
                  only: tuple[str, ...] | None = None) -> int | None:
    """Check every file ``folder``'s manifest lists (``only``: those under these subfolders, and the
    files beside them); returns how many (None: no manifest there). ``whole``: hash whole files
    (default: :func:`full_requested`)."""
    folder = os.path.abspath(os.fspath(folder))
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    files = {rel: rec for rel, rec in manifest["files"].items()
             if only is None or "/" not in rel or rel.split("/", 1)[0] in only}
    for rel, record in files.items():
        check_file(folder, rel, record, whole=whole)
    return len(files)


def verify_file(path: str | os.PathLike) -> bool:
    """Check one file against the manifest of its folder or of the folder above (a
    sentence-transformers module folder); False when neither records it. An unrecorded
    safetensors file is scanned (:func:`scan_safetensors`) when every byte is to be checked."""
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path)
    for base in (folder, os.path.dirname(folder)):
        manifest = read_manifest(base)
        rel = os.path.relpath(path, base).replace(os.sep, "/")
        if manifest is not None and rel in manifest["files"]:
            check_file(base, rel, manifest["files"][rel])
            return True
    if full_requested() and path.endswith(".safetensors"):
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns, "scanned")
        if not _CHECKED.get(key):
            scan_safetensors(path)
            _CHECKED[key] = True
    return False


# ---- folders without a manifest: header bounds and finite values --------------------------------
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
           "BOOL": np.bool_, "BF16": None}  # others (float8 kinds) are one byte, not checked for NaN


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
    files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in sorted(names)
             if name.endswith(".safetensors")]
    for p in files:
        scan_safetensors(p)
    return "scanned", len(files)
