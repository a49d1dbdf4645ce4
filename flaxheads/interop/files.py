"""What every format flaxheads reads and writes shares: atomic output folders, JSON and
safetensors files, tokenizer files, Flax <-> PyTorch parameter names, and the errors."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from flaxheads.disk.checksums import write_manifest
from flaxheads.disk.files import MARKER, has_marker, umask_mode, write_marker
from flaxheads.errors import FlaxheadsError, WriteFailedError, os_error_cause
from flaxheads.runtime import phases

#: Files a tokenizer may consist of (a fast ``tokenizer.json``, its configs, or slow-tokenizer vocabularies).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)
#: Keys of a backbone ``config.json`` that describe where and how it was saved, not the model.
_SAVE_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")


class ExportError(FlaxheadsError):
    """The model cannot be written in the requested format (the message says which format can)."""


class ModelImportError(FlaxheadsError):
    """A folder flaxheads cannot import (the message says what was wrong and what is expected)."""


class ExportWriteError(ExportError, WriteFailedError):
    """Writing an export failed on the way (disk full, read-only, quota); any earlier export at the
    same path is left as it was."""


class ImportNotFoundError(ModelImportError, FileNotFoundError):
    """A folder or file to import that is not there (a :class:`ModelImportError`, and still a ``FileNotFoundError``)."""


class OutputExistsError(ExportError, FileExistsError):
    """An output path that is taken (an :class:`ExportError`, and still a ``FileExistsError``)."""


# ---- writing ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary folder beside ``out``; rename it to ``out`` only if the block succeeds,
    so an error never leaves a half-written ``out`` (or a replaced old one) behind."""
    out = os.path.abspath(os.fspath(out))
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputExistsError(
            f"output folder {out!r} is a file, not a folder: choose a new folder (a file is "
            "never replaced, --overwrite or not)"
        )
    if os.path.exists(out) and os.listdir(out) and not overwrite:
        raise OutputExistsError(
            f"output folder {out!r} already exists and is not empty; pass overwrite=True "
            "(--overwrite) to replace it, or choose a new folder"
        )
    if os.path.exists(out) and os.listdir(out) and not has_marker(out):
        raise OutputExistsError(
            f"output folder {out!r} holds files flaxheads did not write (it has no {MARKER} "
            "marker), so it is not replaced, --overwrite or not: choose a new folder, or empty "
            "this one yourself"
        )
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
        with phases.temporary(tmp), phases.phase(f"exporting to {out}"):
            yield tmp
            write_marker(tmp, "export")
            _umask_modes(tmp)
            write_manifest(tmp)  # last: it records every file above
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = os_error_cause(e) if isinstance(e, Exception) and not isinstance(e, FlaxheadsError) else None
        if cause is not None:
            kept = f"the existing {out} is unchanged" if os.path.exists(out) else f"nothing was written to {out}"
            raise ExportWriteError(
                f"could not write the export {out}: {cause}; {kept}; free some space or fix the disk and export again"
            ) from e
        raise
    old = None
    with phases.temporary(tmp), phases.committing():  # a signal waits for both renames, or comes before them
        if os.path.exists(out):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=parent)
            os.rmdir(old)
            os.rename(out, old)
        os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)


def _umask_modes(folder: str) -> None:
    """``folder`` and everything in it with the modes the umask gives new files: ``mkdtemp`` makes
    the folder 0700 and safetensors writes its files 0600, which would keep an export from every
    other user (a server's account, a colleague)."""
    os.chmod(folder, umask_mode(directory=True))
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), umask_mode(directory=True))
        for name in files:
            os.chmod(os.path.join(root, name), umask_mode())


def read_json(path: str) -> Any:
    """The JSON in ``path``; :class:`ModelImportError` when it is not readable JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ImportNotFoundError(f"{path} does not exist") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelImportError(f"{path}: not readable JSON ({e})") from None


def save_safetensors(tensors: Mapping[str, np.ndarray], path: str) -> None:
    """float32 tensors in a safetensors file PyTorch loaders accept (``format: pt``)."""
    from safetensors.numpy import save_file

    save_file(
        {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in tensors.items()},
        path,
        metadata={"format": "pt"},
    )


def transformers_version() -> str | None:
    """The installed transformers' version, or None (written into configs only when known)."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def backbone_config_dict(config) -> dict:
    """A backbone's ``config.json`` as written by an export: float32 weights, this transformers' version."""
    cfg = config.to_dict()
    for k in _SAVE_KEYS:
        cfg.pop(k, None)
    if transformers_version():
        cfg["transformers_version"] = transformers_version()
    cfg["torch_dtype"] = "float32"
    return cfg


def copy_tokenizer(src: str | os.PathLike | None, dst: str) -> list[str]:
    """Copy the tokenizer files of folder ``src`` into ``dst``; the names copied (none when ``src`` is unset)."""
    if not src or not os.path.isdir(src):
        return []
    copied = []
    for name in TOKENIZER_FILES:
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(dst, name))
            copied.append(name)
    return copied


# ---- params <-> PyTorch names ---------------------------------------------------------------------
def np_tree(tree):
    """``tree`` on the host as float32 numpy arrays: quantised kernels dequantised and adapted ones
    (a QLoRA base's) merged, so a merged export of a quantised model is a plain float32 model."""
    import jax

    from flaxheads.layers.quantized import dequantize_tree

    return jax.tree.map(lambda x: np.asarray(jax.device_get(x), dtype=np.float32), dequantize_tree(tree))


def flatten(tree: Mapping, prefix: tuple = ()) -> dict[tuple, Any]:
    """Nested mappings -> ``{path tuple: leaf}``."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def flax_to_pytorch_names(params: Mapping, prefix: str = "") -> dict[str, np.ndarray]:
    """Flax params -> PyTorch state dict by Hugging Face's naming rule: ``kernel`` -> ``weight``
    transposed to [out, in], ``scale``/``embedding`` -> ``weight``, path parts joined with dots."""
    out = {}
    for key, v in flatten(params).items():
        v = np.asarray(v)
        *path, leaf = key
        if leaf == "kernel":
            v = np.transpose(v, (3, 2, 0, 1)) if v.ndim == 4 else v.T
            leaf = "weight"
        elif leaf in ("scale", "embedding"):
            leaf = "weight"
        name = ".".join([prefix] * bool(prefix) + [str(p) for p in path] + [leaf])
        out[name] = np.ascontiguousarray(v)
    return out


def pytorch_to_flax_leaf(state: Mapping[str, np.ndarray], module: str, leaf: str) -> np.ndarray:
    """The inverse of :func:`flax_to_pytorch_names` for one leaf of module ``module``."""
    if leaf == "kernel":
        v = state[f"{module}.weight"]
        return np.transpose(v, (2, 3, 1, 0)) if v.ndim == 4 else v.T
    if leaf in ("scale", "embedding"):
        return state[f"{module}.weight"]
    return state[f"{module}.{leaf}" if module else leaf]
