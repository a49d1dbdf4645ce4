"""flaxheads' own small files: the marker of a folder it wrote, JSON, and the modes new files get."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np

from flaxheads._version import __version__

#: The file that marks a folder as written by flaxheads (an export or a run folder): ``--overwrite``
#: replaces only folders that have it, never one of the user's own.
MARKER = ".flaxheads"


def write_marker(folder: str | os.PathLike, kind: str) -> None:
    """Mark ``folder`` as a flaxheads ``kind`` ("export", "run")."""
    write_json(os.path.join(os.fspath(folder), MARKER), {"kind": kind, "flaxheads_version": __version__})


def has_marker(folder: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(folder), MARKER))


def umask_mode(directory: bool = False) -> int:
    """The mode the process's umask gives a new folder (``0o777 & ~umask``) or file (``0o666``):
    what ``mkdir`` / ``open`` would create, where ``tempfile`` creates 0700 / 0600."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def jsonable(x):
    """``x`` with numpy scalars as Python numbers and mapping keys as strings."""
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(jsonable(obj), f, indent=2, sort_keys=False)
        f.write("\n")
