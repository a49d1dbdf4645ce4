"""What a folder is: the one answer, by the files it holds (:func:`folder_kind`).

Every reader asks here and switches on the answer: :func:`flaxheads.load` and ``flaxheads export``
(:mod:`flaxheads.formats`), :func:`flaxheads.interop.import_model` and the transformers importer,
and ``flaxheads checkpoints``. It sits in ``checkpoint/``, the lowest folder that knows a run folder,
so that ``interop/`` can ask it too; :mod:`flaxheads.formats` re-exports it."""

from __future__ import annotations

import enum
import json
import os

from flaxheads.backbones.weights import BIN, BIN_INDEX, SAFE, SAFE_INDEX
from flaxheads.checkpoint.io import is_checkpoint_folder
from flaxheads.checkpoint.meta import CHECKPOINTS_SUBDIR
from flaxheads.disk.files import MARKER


class FolderKind(str, enum.Enum):
    """What a folder holds. The value is the short name (``Loaded.kind``); :attr:`described` is
    the phrase messages use ("a head export")."""

    RUN = "run"  # a run folder, its checkpoints/ folder or one step's folder
    HEAD_EXPORT = "head export"  # head.safetensors + head_config.json, no backbone
    PEFT_ADAPTER = "PEFT adapter"  # adapter_config.json + adapter weights, on a base folder
    ONNX = "ONNX export"  # model.onnx + config.json, no weights flaxheads reads
    SENTENCE_TRANSFORMERS = "sentence-transformers"  # modules.json + the Transformer files
    TRANSFORMERS = "transformers"  # config.json + weights

    def __str__(self) -> str:
        return self.value

    @property
    def described(self) -> str:
        return _DESCRIBED[self]


_DESCRIBED = {
    FolderKind.RUN: "a run folder",
    FolderKind.HEAD_EXPORT: "a head export",
    FolderKind.PEFT_ADAPTER: "a PEFT adapter folder",
    FolderKind.ONNX: "an ONNX export",
    FolderKind.SENTENCE_TRANSFORMERS: "a sentence-transformers model folder",
    FolderKind.TRANSFORMERS: "a transformers model folder",
}

#: The kinds that hold a whole model (backbone included) another tool wrote or reads.
MODEL_FOLDERS = (FolderKind.PEFT_ADAPTER, FolderKind.ONNX, FolderKind.SENTENCE_TRANSFORMERS, FolderKind.TRANSFORMERS)

#: The file that tells each kind, in the order they are asked (after the run folder's own test).
_BY_FILE = (
    ("head_config.json", FolderKind.HEAD_EXPORT),
    ("adapter_config.json", FolderKind.PEFT_ADAPTER),
    ("model.onnx", FolderKind.ONNX),
    ("modules.json", FolderKind.SENTENCE_TRANSFORMERS),
    ("config.json", FolderKind.TRANSFORMERS),
)
_WEIGHTS = (SAFE, SAFE_INDEX, BIN, BIN_INDEX)


def folder_kind(path: str | os.PathLike) -> FolderKind | None:
    """What the folder ``path`` holds; None when it is not a folder or holds nothing flaxheads reads.

    A run comes first (``checkpoints/`` or step folders inside, the run's marker file, or a
    ``metrics.jsonl`` of a run that saved no checkpoint: its ``config.json`` is the run's, not a
    model's); then the first of
    ``head_config.json``, ``adapter_config.json``, ``model.onnx`` (with no weights beside it: a
    folder with both is a transformers folder), ``modules.json`` and ``config.json``."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    if is_checkpoint_folder(path) or os.path.isfile(os.path.join(path, "metrics.jsonl")) or _run_marker(path):
        return FolderKind.RUN
    for name, kind in _BY_FILE:
        if not os.path.isfile(os.path.join(path, name)):
            continue
        if kind is FolderKind.ONNX and any(os.path.isfile(os.path.join(path, w)) for w in _WEIGHTS):
            continue
        return kind
    return None


def _run_marker(path: str) -> bool:
    """The marker a run writes into its folder first (a run that logs nothing has no metrics.jsonl)."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f).get("kind") == "run"
    except (OSError, ValueError, AttributeError):
        return False


#: What each kind of folder holds, for the messages of a folder that cannot be loaded.
_HOLDS = "a run folder (checkpoints/), a checkpoint folder (<step>/meta), or a model folder (config.json and weights)"


def without_checkpoint(path: str | os.PathLike) -> str:
    """Why the run or checkpoint folder ``path`` has no checkpoint to load, in a sentence that
    names the folder, what it is and what it lacks."""
    path = os.path.abspath(os.fspath(path))
    run = os.path.dirname(path) if os.path.basename(path) == CHECKPOINTS_SUBDIR else path
    if not (_run_marker(run) or os.path.isfile(os.path.join(run, "config.json"))):
        names = sorted(os.listdir(path)) if os.path.isdir(path) else []
        if any(n.split(".")[0].isdigit() and "tmp" in n for n in names):  # Orbax's <step>.orbax-checkpoint-tmp-*
            return (
                f"{path} is a checkpoint folder with no finished step: no <step>/meta folders inside, only "
                "the temporary folder of a save that was cut off"
            )
        return f"{path} has no checkpoints: no <step>/meta folders inside ({_holds(names)}); expected {_HOLDS}"
    if os.path.isfile(os.path.join(run, "summary.json")):
        why = (
            "the run finished without saving one (earlier flaxheads releases saved nothing with "
            "checkpoint_every=0); train it again to keep its model"
        )
    else:
        why = (
            "it was interrupted before its first save, or is still training; rerun the same command "
            f"(or fh.train(fh.RunSpec.from_run({run!r}))) to train it"
        )
    return f"{run} is a run folder with no checkpoint ({CHECKPOINTS_SUBDIR}/<step> folders): {why}"


def not_loadable(path: str | os.PathLike) -> str:
    """The message for a folder :func:`folder_kind` finds nothing in: what it is and what it lacks."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return f"{path} does not exist; expected {_HOLDS}"
    if not os.path.isdir(path):
        return f"{path} is a file, not a folder; expected {_HOLDS}"
    held = _holds(sorted(os.listdir(path)))
    return (
        f"{path} is not a model, run or checkpoint folder: no config.json, {CHECKPOINTS_SUBDIR}/ or "
        f"<step>/meta ({held}); expected {_HOLDS}"
    )


def _holds(names: list[str]) -> str:
    return "it is empty" if not names else "it holds " + ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
