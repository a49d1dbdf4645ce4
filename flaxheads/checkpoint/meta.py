"""The checkpoint format: item names, the JSON ``meta`` item, head shapes and their hash, the
checks that compare a saved meta with a target, and the checkpoint errors.

``meta`` holds the library version, pooler/head config, problem type, labels, hidden width,
backbone type and name/path, dtype, and the head's per-leaf shapes with their hash.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from flaxheads import config as _config
from flaxheads._version import __version__
from flaxheads.disk.checksums import ChecksumError
from flaxheads.errors import FlaxheadsError, WriteFailedError
from flaxheads.heads import linen
from flaxheads.heads.heads import SequenceHead
from flaxheads.model.base_dtype import base_dtype_of
from flaxheads.model.lora import adapters_diff, adapters_meta
from flaxheads.model.quantize import quantization_of
from flaxheads.model.sequence import SequenceModel

FORMAT = "flaxheads-checkpoint/1"
HEAD, BACKBONE, OPT_STATE, EXTRA, STEP, META = "head", "backbone", "opt_state", "extra", "step", "meta"
LORA = "lora"  # LoRA adapters (flaxheads.model.lora), only for models that have them
ARRAY_ITEMS = (HEAD, BACKBONE, OPT_STATE, EXTRA, LORA)
JSON_ITEMS = (STEP, META)
CHECKPOINTS_SUBDIR = "checkpoints"
# the keys make_meta writes; anything else in a meta came from extra_meta
OWN_KEYS = frozenset(
    {
        "format",
        "library",
        "library_version",
        "created",
        "head_config",
        "problem_type",
        "num_labels",
        "id2label",
        "hidden_size",
        "backbone_model_type",
        "backbone_name_or_path",
        "backbone_saved",
        "dtype",
        "param_dtype",
        "pool_mask",
        "pad_token_id",
        "eos_token_id",
        "arch",
        "hf_names",
        "head_shapes",
        "head_shapes_hash",
        "jax_version",
        "lora",
        "base_dtype",
        "quantize",
    }
)


class CheckpointError(FlaxheadsError):
    """Base class of the checkpoint errors below (a ``ValueError``)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint step whose files are missing, truncated or unreadable."""


class DamagedCheckpointError(CorruptCheckpointError, ChecksumError):
    """A checkpoint step whose files differ from the checksums recorded when it was saved (exit 1)."""


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint written for a different head config / parameter shapes than the target."""


class HeadMismatchError(CheckpointError):
    """A saved head cannot be attached to this backbone (width, pad/eos token, ...)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint folder, step or backbone that is not there (also a ``FileNotFoundError``)."""


class CheckpointWriteError(CheckpointError, WriteFailedError):
    """A checkpoint save that failed (disk full, read-only, quota); the previous step is kept."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A step that is already saved and would be overwritten (also a ``FileExistsError``)."""


# ---- head shapes ---------------------------------------------------------------------------


def key_str(k) -> str:
    """One key of a ``jax.tree_util`` path as text (dict key, attribute name or index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(path) -> str:
    """A ``jax.tree_util`` key path as ``"pooler/dense/kernel"``."""
    return "/".join(key_str(k) for k in path)


def _leaves_with_paths(tree) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(path_str(path), leaf) for path, leaf in flat]


def head_shapes(head_params) -> dict[str, list]:
    """``{"pooler/dense/kernel": [[32, 32], "float32"], ...}`` for a head params tree."""
    return {p: [list(np.shape(x)), jnp.dtype(x.dtype).name] for p, x in _leaves_with_paths(head_params)}


def head_shapes_hash(head_params) -> str:
    """Hash of the head's parameter paths and shapes (not dtypes, not values)."""
    items = sorted((p, list(np.shape(x))) for p, x in _leaves_with_paths(head_params))
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def expected_head_shapes(head: SequenceHead, hidden_size: int) -> dict:
    """The params tree (as ShapeDtypeStructs) that ``head`` has on hidden states of width ``hidden_size``."""
    return jax.eval_shape(lambda: linen.init_head(head, hidden_size))


def backbone_checksum(backbone_params) -> float:
    """Sum of |w| over every backbone weight (float64 on the host): tells a frozen backbone
    loaded again from its folder apart from another one with the same shapes."""
    return float(
        sum(
            np.abs(np.asarray(_host(x), np.float64)).sum()
            for x in jax.tree.leaves(backbone_params)
            if hasattr(x, "dtype")
        )
    )


def _host(x):
    # params sharded over several hosts are gathered (every process saves, so every process is here)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return multihost_utils.process_allgather(x, tiled=True)
    return jax.device_get(x)


# ---- the meta item -------------------------------------------------------------------------


def _dtype_name(x) -> str | None:
    try:
        return jnp.dtype(x).name
    except TypeError:
        return None


def functional(model):
    """``model``, or the functional model of an NNX one (:meth:`~flaxheads.nnx.model.NNXSequenceModel.to_functional`):
    what a checkpoint records."""
    return model.to_functional() if hasattr(model, "to_functional") else model


def make_meta(
    model: SequenceModel, head_params, *, backbone_saved: bool = False, extra: Mapping[str, Any] | None = None
) -> dict:
    """The JSON ``meta`` item for ``model`` (an NNX model: its functional form) with ``head_params``."""
    model = functional(model)
    dtypes = sorted({jnp.dtype(x.dtype).name for _, x in _leaves_with_paths(head_params)})
    meta = {
        "format": FORMAT,
        "library": "flaxheads",
        "library_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "head_config": _config.to_dict(model.head),
        "problem_type": model.problem_type,
        "num_labels": int(model.num_labels),
        "id2label": None if model.id2label is None else {str(k): v for k, v in model.id2label.items()},
        "hidden_size": int(model.hidden_size),
        "backbone_model_type": model.model_type,
        "backbone_name_or_path": model.name_or_path,
        "backbone_saved": bool(backbone_saved),
        "dtype": _dtype_name(getattr(model.backbone, "dtype", jnp.float32)),
        "param_dtype": dtypes[0] if len(dtypes) == 1 else (dtypes or None),
        "pool_mask": model.pool_mask,
        "pad_token_id": model.pad_token_id,
        "eos_token_id": model.eos_token_id,
        "arch": model.arch,
        "hf_names": [list(x) for x in model.hf_names],
        "head_shapes": head_shapes(head_params),
        "head_shapes_hash": head_shapes_hash(head_params),
        "jax_version": jax.__version__,
        "lora": adapters_meta(model),
        "base_dtype": base_dtype_of(model.params["backbone"]),  # a frozen base is loaded again in it
        "quantize": quantization_of(model.params["backbone"]),  # and quantised again (the codes are not saved)
    }
    if extra:
        clash = set(extra) & OWN_KEYS
        if clash:
            raise CheckpointError(
                f"extra_meta keys {sorted(clash)} would overwrite flaxheads' own meta keys; "
                "rename them (the own keys are the ones make_meta writes)"
            )
        meta.update(extra)
    json.dumps(meta)  # fail now, not inside the async writer, on non-JSON values
    return meta


def int_keys(d: Mapping | None) -> dict | None:
    """``{"0": "a"}`` (JSON) -> ``{0: "a"}``."""
    return None if d is None else {int(k): v for k, v in d.items()}


# ---- checks of a saved meta against a target ------------------------------------------------


def check_format(meta: dict, where: str) -> None:
    if meta.get("format") != FORMAT:
        raise IncompatibleCheckpointError(
            f"{where}: meta format is {meta.get('format')!r}, this flaxheads {__version__} reads {FORMAT!r}. "
            "Load it with the flaxheads version that wrote it (meta.library_version="
            f"{meta.get('library_version')!r})."
        )


def build_head(meta: dict, where: str) -> SequenceHead:
    """The head module described by ``meta["head_config"]``."""
    try:
        head = _config.from_dict(meta["head_config"])
    except (KeyError, ValueError, TypeError) as e:
        raise IncompatibleCheckpointError(
            f"{where}: cannot build the head from its saved config ({e}). It was written by flaxheads "
            f"{meta.get('library_version')!r}; this is {__version__}."
        ) from e
    if not isinstance(head, SequenceHead):
        raise IncompatibleCheckpointError(
            f"{where}: head_config is a {type(head).__name__}, not a SequenceHead; "
            "this folder does not hold a flaxheads head checkpoint"
        )
    return head


def shape_diff(want: dict, got: dict) -> str:
    """The paths whose shapes differ between two :func:`head_shapes` dicts (at most 8)."""
    lines = []
    for p in sorted(set(want) | set(got)):
        a, b = want.get(p), got.get(p)
        if a is None or b is None or list(a[0]) != list(b[0]):
            lines.append(f"{p}: checkpoint {None if b is None else b[0]} vs target {None if a is None else a[0]}")
    return "; ".join(lines[:8]) + (" ..." if len(lines) > 8 else "")


def config_diff(a, b, prefix: str = "") -> list[str]:
    """``["head.type: checkpoint 'linear' vs target 'mlp'", ...]`` between two config dicts."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += config_diff(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if a == b else [f"{prefix}: checkpoint {a!r} vs target {b!r}"]


def check_params_fit(head: SequenceHead, hidden_size: int, head_params, where: str) -> None:
    """``head_params`` have the shapes ``head`` builds on width ``hidden_size``."""
    want = head_shapes(expected_head_shapes(head, hidden_size))
    got = head_shapes(head_params)
    if {p: v[0] for p, v in want.items()} != {p: v[0] for p, v in got.items()}:
        raise IncompatibleCheckpointError(
            f"{where}: the head params do not fit the head config on hidden width {hidden_size}: "
            f"{shape_diff(want, got)}"
        )


def check_saved_shapes(meta: dict, want: dict, where: str) -> None:
    """The head config in ``meta`` builds ``want``, the shapes it was saved with."""
    if head_shapes_hash(want) != meta.get("head_shapes_hash"):
        raise IncompatibleCheckpointError(
            f"{where}: the saved head config builds parameters of other shapes than the saved ones "
            f"({shape_diff(head_shapes(want), meta.get('head_shapes', {}))}). The checkpoint was written by "
            f"flaxheads {meta.get('library_version')!r} (this is {__version__}); load it with that version."
        )


def check_resumable(meta: dict, where: str, params: Mapping, model: SequenceModel | None) -> None:
    """A run's checkpoint ``meta`` fits the target ``params`` ({"backbone", "head"}) and ``model``:
    same head shapes, same backbone width and type, and (frozen runs) the same backbone weights."""
    model = functional(model)
    if head_shapes_hash(params["head"]) != meta.get("head_shapes_hash"):
        diff = config_diff(meta.get("head_config"), _config.to_dict(model.head)) if model else []
        raise IncompatibleCheckpointError(
            f"{where} was written by an incompatible head config: "
            f"{'; '.join(diff) if diff else 'same config'}; parameter shapes: "
            f"{shape_diff(head_shapes(params['head']), meta.get('head_shapes', {}))}. "
            f"Resume with the head config in the checkpoint's meta, or start a new run folder "
            f"(train: --no-resume)."
        )
    if model is not None:
        for key, have in (("hidden_size", model.hidden_size), ("backbone_model_type", model.model_type)):
            if meta.get(key) != have:
                raise IncompatibleCheckpointError(
                    f"{where}: checkpoint {key}={meta.get(key)!r} but this run's backbone has {have!r}; "
                    "resume with the backbone the run was started with, or start a new run folder."
                )
    if model is not None or meta.get("lora") is not None:
        check_adapters(meta, adapters_meta(model) if model is not None else None, where)
    saved_sum = meta.get("backbone_checksum")
    if not meta.get("backbone_saved") and saved_sum is not None:
        have_sum = backbone_checksum(params["backbone"])
        if not np.isclose(have_sum, saved_sum, rtol=1e-6, atol=0.0):
            raise IncompatibleCheckpointError(
                f"{where}: the run's frozen backbone was not saved, and the backbone given now differs from the "
                f"one it was trained with (weight checksum {have_sum!r} vs {saved_sum!r}; saved from "
                f"{meta.get('backbone_name_or_path')!r}). Load that backbone folder, or start a new run."
            )


def check_adapters(meta: dict, have: dict | None, where: str) -> None:
    """The LoRA adapters ``meta`` records are those of the target (``have``: its
    :func:`~flaxheads.model.lora.adapters_meta`): same config, same modules and kernel shapes."""
    diff = adapters_diff(meta.get("lora"), have)
    if diff:
        raise IncompatibleCheckpointError(
            f"{where}: the checkpoint's LoRA adapters do not fit the target model: {'; '.join(diff[:6])}"
            f"{' ...' if len(diff) > 6 else ''}. Use the adapter settings (--lora-*) and backbone the run was "
            "started with, or start a new run folder."
        )
