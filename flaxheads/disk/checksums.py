"""The one place flaxheads writes and checks file checksums.

Every folder flaxheads writes (an export, a checkpoint step) gets a ``checksums.json``: for each file
its size, its SHA-256 and the xxh3-64 digest of each :data:`BLOCK`-byte block (the last one shorter).
The manifest carries its own digest, so a damaged manifest is told apart from a damaged file.
Safetensors and Orbax's files carry no checksum of their own, so without it a flipped byte inside
tensor data loads silently.

Loading checks every byte it reads, by the blocks: a safetensors file as the reader reads it
(:mod:`flaxheads.disk.checked_read`: each block it reads is hashed before its bytes are handed out,
so a process reading part of a file checks the blocks of that part), any other file (configs,
tokenizers, a checkpoint's Orbax files) whole before it is read. A difference is one line naming the
file and the byte range. :func:`full` (``fh.load(..., verify=True)``, ``--verify``,
``FLAXHEADS_VERIFY=1``) also hashes every file whole with SHA-256. A manifest of the first format
(no blocks) is checked by its sampled SHA-256 as before. A folder without the file (written
elsewhere) loads as before; for those, :func:`scan_safetensors` checks each header's bounds and every
tensor for NaN / Inf."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import json
import mmap
import os
from collections.abc import Iterator

import xxhash

from flaxheads.errors import FlaxheadsError

MANIFEST = "checksums.json"
FORMAT = "flaxheads-checksums/2"
_FORMAT_V1 = "flaxheads-checksums/1"
#: What ``--verify`` does, for the commands that take it.
VERIFY_HELP = (
    "also hash every file flaxheads wrote that the command reads with SHA-256 and read every array (the "
    "default checks every byte it reads by its block checksums); folders written elsewhere: every tensor "
    "checked for NaN/Inf and the headers' bounds; anything damaged is one line, exit 1"
)
#: Block size of the per-block digests (bench/checked_load.py measured 1-16 MiB: see docs/performance.md).
BLOCK = 4 << 20
BLOCK_ALGORITHM = "xxh3_64"
#: Files the checked reader reads (and checks block by block as it reads); others are hashed before they are read.
STREAMED = (".safetensors",)
# the first format's sample (read for manifests written before the blocks)
WHOLE_LIMIT = 8 << 20
HEAD_BYTES = 1 << 20
SAMPLE_BLOCK = 1 << 16
SAMPLES = 32
_CHUNK = 8 << 20

_FULL: contextvars.ContextVar[bool] = contextvars.ContextVar("flaxheads_full_verify", default=False)
_CHECKED: dict[tuple, bool] = {}  # (path, size, mtime, how) already checked in this process


class ChecksumError(FlaxheadsError):
    """A file whose bytes differ from what flaxheads recorded when it wrote it (or that is
    missing from the folder it was written in). Not a mistake in the command: programs exit 1."""

    exit_code = 1


class DamagedWeightsError(ChecksumError):
    """A weights file with no recorded checksum whose header or values are impossible (offsets out of
    bounds, NaN or Inf)."""


class ChecksumFormatError(ChecksumError):
    """A ``checksums.json`` written by a newer flaxheads, in a format this version cannot check."""


def forget() -> None:
    """Forget which files this process has checked (the next load checks them again)."""
    _CHECKED.clear()


# ---- digests ------------------------------------------------------------------------------------
def block_digest(data) -> str:
    """The xxh3-64 digest (16 hex digits) of one block's bytes (any buffer)."""
    return xxhash.xxh3_64_hexdigest(data)


def _hash_file(path: str, sha: bool) -> tuple[str | None, list[str]]:
    """(SHA-256 or None, block digests) of ``path``, in one pass."""
    h, blocks = hashlib.sha256() if sha else None, []
    with open(path, "rb") as f:
        while chunk := f.read(BLOCK):
            blocks.append(block_digest(chunk))
            if h is not None:
                h.update(chunk)
    return (h.hexdigest() if h is not None else None), blocks or [block_digest(b"")]


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sample_offsets(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the first format's sampled regions: head, spread blocks, tail."""
    regions = [(0, min(size, HEAD_BYTES))]
    span = size - HEAD_BYTES - SAMPLE_BLOCK
    if span > 0:
        regions += [(HEAD_BYTES + span * i // SAMPLES, SAMPLE_BLOCK) for i in range(SAMPLES)]
    regions.append((max(0, size - SAMPLE_BLOCK), min(size, SAMPLE_BLOCK)))
    return regions


def _sample_sha256(path: str, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for offset, length in _sample_offsets(size):
            f.seek(offset)
            h.update(f.read(length))
    return h.hexdigest()


def file_record(path: str) -> dict:
    """``{"size", "sha256", "blocks"}`` of one file."""
    sha, blocks = _hash_file(path, sha=True)
    return {"size": os.path.getsize(path), "sha256": sha, "blocks": blocks}


def _self_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return block_digest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


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
    """Record the size, SHA-256 and block digests of every file under ``folder`` in ``folder/checksums.json``
    (written to a temporary name and renamed: a cut write leaves no half manifest)."""
    folder = os.fspath(folder)
    manifest = {
        "format": FORMAT,
        "algorithm": "sha256",
        "blocks": {"algorithm": BLOCK_ALGORITHM, "size": BLOCK},
        "files": {rel: file_record(os.path.join(folder, rel)) for rel in _files(folder)},
    }
    manifest["digest"] = _self_digest(manifest)
    tmp = os.path.join(folder, f".{MANIFEST}.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST))
    return manifest


# ---- reading the manifest -------------------------------------------------------------------------
def full_requested() -> bool:
    """Whether loads hash every file whole now (:func:`full`, or ``FLAXHEADS_VERIFY=1`` in the environment)."""
    return _FULL.get() or os.environ.get("FLAXHEADS_VERIFY", "") not in ("", "0")


@contextlib.contextmanager
def full(on: bool = True) -> Iterator[None]:
    """Within the block, every load also hashes whole files with SHA-256 (``on=False``: blocks only)."""
    token = _FULL.set(on or _FULL.get())
    try:
        yield
    finally:
        _FULL.reset(token)


def _newer(fmt) -> bool:
    try:
        return isinstance(fmt, str) and fmt.startswith("flaxheads-checksums/") and int(fmt.rsplit("/", 1)[1]) > 2
    except ValueError:
        return False


def _parse_manifest(path: str) -> dict:
    with open(path) as f:
        manifest = json.load(f)
    fmt = manifest.get("format")
    if _newer(fmt) or (
        fmt == FORMAT
        and manifest.get("blocks", {}).get("algorithm") != BLOCK_ALGORITHM
        and manifest.get("digest") == _self_digest(manifest)
    ):
        raise ChecksumFormatError(
            f"{path}: written by a newer flaxheads (format {fmt!r}, blocks "
            f"{manifest.get('blocks')}), which this version ({FORMAT}) cannot check; upgrade "
            "flaxheads to load this folder (or delete that file to load it unchecked)"
        )
    if fmt not in (FORMAT, _FORMAT_V1) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"expected format {FORMAT!r} with a 'files' object")
    if fmt == FORMAT:
        if manifest.get("digest") != _self_digest(manifest):
            raise ValueError("its contents differ from its own recorded digest")
        if not isinstance(manifest["blocks"].get("size"), int) or manifest["blocks"]["size"] <= 0:
            raise ValueError("no block size")
    return manifest


def read_manifest(folder: str | os.PathLike) -> dict | None:
    """The manifest of ``folder``, or None when it has none; :class:`ChecksumError` when unreadable."""
    path = os.path.join(os.fspath(folder), MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        return _parse_manifest(path)
    except ChecksumFormatError:
        raise
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise ChecksumError(
            f"{path}: the checksum manifest is damaged ({type(e).__name__}: {str(e)[:120]}), so "
            "the folder's files cannot be checked; write the folder again (or delete that file "
            "to load the folder unchecked)"
        ) from None


# ---- checking -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Blocks:
    """The block digests recorded for one file: what the checked reader compares each block with."""

    path: str
    manifest: str
    size: int
    block: int
    digests: tuple[str, ...]

    def span(self, k: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of block ``k``."""
        return k * self.block, min((k + 1) * self.block, self.size)

    def check(self, k: int, data) -> None:
        """:class:`ChecksumError` naming the byte range unless ``data`` are block ``k``'s recorded bytes."""
        if k >= len(self.digests) or block_digest(data) != self.digests[k]:
            raise self.mismatch(k)

    def mismatch(self, k: int) -> ChecksumError:
        a, b = self.span(k)
        return ChecksumError(
            f"{self.path}: bytes {a}..{b} differ from the checksums recorded in {self.manifest} "
            "when flaxheads wrote it: the file was changed or damaged since; restore it from a copy "
            "or write it again"
        )


def _cut(path: str, size: int, manifest: str, record: dict) -> ChecksumError:
    return ChecksumError(
        f"{path}: {size} bytes where {manifest} records {record.get('size')}: the file was cut or "
        "changed since flaxheads wrote it; restore it from a copy or write it again"
    )


def _blocks(folder: str, rel: str, manifest: dict) -> Blocks | None:
    record = manifest["files"][rel]
    if manifest.get("format") != FORMAT or not isinstance(record.get("blocks"), list):
        return None
    return Blocks(
        os.path.join(folder, rel),
        os.path.join(folder, MANIFEST),
        int(record.get("size", -1)),
        int(manifest["blocks"]["size"]),
        tuple(record["blocks"]),
    )


def _first_bad_block(blocks: Blocks) -> int | None:
    """The first block of a file whose bytes differ from the record (None: all match). A large file is
    hashed where the page cache holds it (mapped, not copied: half the time of reading it)."""
    with open(blocks.path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != blocks.size:
            raise _cut(blocks.path, size, blocks.manifest, {"size": blocks.size})
        if len(blocks.digests) != max(1, -(-size // blocks.block)):
            return min(len(blocks.digests), -(-size // blocks.block) - 1)
        if size <= blocks.block:
            return None if block_digest(f.read()) == blocks.digests[0] else 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                return next(
                    (
                        k
                        for k in range(len(blocks.digests))
                        if block_digest(view[slice(*blocks.span(k))]) != blocks.digests[k]
                    ),
                    None,
                )
            finally:
                view.release()


def _stat(path: str, manifest: str) -> os.stat_result:
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise ChecksumError(
            f"{path} is missing: {manifest} lists it as written there; restore it from a copy or write the folder again"
        ) from None


def check_file(
    folder: str,
    rel: str,
    record: dict,
    *,
    whole: bool | None = None,
    manifest: dict | None = None,
    streamed: bool = False,
) -> None:
    """Check one file of ``folder`` against its ``record``; :class:`ChecksumError` on a difference.
    ``streamed``: the file is read by the checked reader, which checks its blocks as it reads (here
    only its size, unless ``whole``)."""
    path = os.path.join(folder, rel)
    whole = full_requested() if whole is None else whole
    manifest_path = os.path.join(folder, MANIFEST)
    st = _stat(path, manifest_path)
    if st.st_size != record.get("size"):
        raise _cut(path, st.st_size, manifest_path, record)
    blocks = _blocks(folder, rel, manifest) if manifest is not None else None
    how = "sha256" if whole else ("blocks" if blocks is not None else "sample")
    if streamed and how == "blocks":
        return
    key = (path, st.st_size, st.st_mtime_ns, how)
    if _CHECKED.get(key):
        return
    if how == "sha256" or (how == "sample" and "sample_sha256" not in record):
        if _sha256_file(path) != record.get("sha256"):
            bad = _first_bad_block(blocks) if blocks is not None else None
            where = (
                f" (bytes {'..'.join(map(str, blocks.span(bad)))} differ)"
                if blocks is not None and bad is not None
                else ""
            )
            raise ChecksumError(
                f"{path}: its SHA-256 differs from the one recorded in {manifest_path} when flaxheads "
                f"wrote it{where}: the file was changed or damaged since; restore it from a copy or "
                "write it again"
            )
    elif blocks is not None:  # how == "blocks"
        bad = _first_bad_block(blocks)
        if bad is not None:
            raise blocks.mismatch(bad)
    elif _sample_sha256(path, st.st_size) != record["sample_sha256"]:
        raise ChecksumError(
            f"{path}: the SHA-256 of its sampled bytes differs from the one recorded in "
            f"{manifest_path} when flaxheads wrote it: the file was changed or damaged since; restore "
            "it from a copy or write it again"
        )
    _CHECKED[key] = True


def verify_folder(
    folder: str | os.PathLike, *, whole: bool | None = None, only: tuple[str, ...] | None = None
) -> int | None:
    """Check every file ``folder``'s manifest lists (``only``: those under these subfolders, and the
    files beside them); returns how many (None: no manifest there). ``whole``: hash whole files with
    SHA-256 too (default: :func:`full_requested`). Safetensors files recorded by blocks are checked
    here for their size only: the checked reader checks each block as it reads it."""
    folder = os.path.abspath(os.fspath(folder))
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    files = {
        rel: rec
        for rel, rec in manifest["files"].items()
        if only is None or "/" not in rel or rel.split("/", 1)[0] in only
    }
    for rel, record in files.items():
        check_file(folder, rel, record, whole=whole, manifest=manifest, streamed=rel.endswith(STREAMED))
    return len(files)


def _record_of(path: str) -> tuple[str, str, dict] | None:
    """(folder, relative path, manifest) of the manifest recording ``path``: its folder's or the
    folder above's (a sentence-transformers module folder); None when neither records it."""
    folder = os.path.dirname(path)
    for base in (folder, os.path.dirname(folder)):
        manifest = read_manifest(base)
        rel = os.path.relpath(path, base).replace(os.sep, "/")
        if manifest is not None and rel in manifest["files"]:
            return base, rel, manifest
    return None


def reader_blocks(path: str | os.PathLike) -> Blocks | None:
    """What the checked reader checks ``path`` against as it reads: its block digests (its size is
    checked here), or None when none are recorded (a first-format record is checked here by its
    sample; with :func:`full`, an unrecorded safetensors file is scanned). ``--verify`` also hashes it
    whole here."""
    path = os.path.abspath(os.fspath(path))
    found = _record_of(path)
    if found is None:
        _scan_if_full(path)
        return None
    base, rel, manifest = found
    check_file(base, rel, manifest["files"][rel], manifest=manifest, streamed=True)
    return _blocks(base, rel, manifest)


def verify_file(path: str | os.PathLike) -> bool:
    """Check one file whole against the manifest of its folder or of the folder above (a
    sentence-transformers module folder); False when neither records it. An unrecorded
    safetensors file is scanned (:func:`scan_safetensors`) when every byte is to be checked."""
    path = os.path.abspath(os.fspath(path))
    found = _record_of(path)
    if found is None:
        _scan_if_full(path)
        return False
    base, rel, manifest = found
    check_file(base, rel, manifest["files"][rel], manifest=manifest)
    return True


def _scan_if_full(path: str) -> None:
    if full_requested() and path.endswith(".safetensors"):
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns, "scanned")
        if not _CHECKED.get(key):
            from flaxheads.disk.scan import scan_safetensors  # the scan imports this module

            scan_safetensors(path)
            _CHECKED[key] = True


def verify_any(folder: str | os.PathLike) -> tuple[str, int]:
    """Check a whole folder, hashing every byte: by its manifest, else each safetensors file by its
    bounds and values (:func:`flaxheads.disk.scan.verify_any`)."""
    from flaxheads.disk.scan import verify_any as check_any  # the scan imports this module

    return check_any(folder)
