"""Orbax checkpoints: the head stored on its own, resumable training runs, heads moved across backbones.

Layout: one directory per step (``<root>/<step>/``), one Orbax item per piece::

    head/       the head params {"pooler": ..., "head": ...}          (always, unless it has no params)
    backbone/   the backbone params                                   (only when the backbone was trained)
    opt_state/  the optimiser state                                   (training checkpoints)
    extra/      any other array fields of the train state (rng, ...)  (training checkpoints, when present)
    step/       JSON: {"step": k, "metrics": {...}}
    meta/       JSON: library version, pooler/head config, problem type, labels, hidden width,
                backbone type and name/path, dtype, per-leaf shapes and their hash

A frozen backbone is not copied: ``meta`` names it (``backbone_name_or_path``). Restoring a
head reads ``meta`` and ``head`` only, never ``backbone``. Saves are Orbax's: asynchronous
and atomic (written to a temporary folder and renamed when complete), so a killed save never
becomes the latest step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import warnings
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .. import config as _config
from ..nn.heads import SequenceHead
from ..model import LoadReport, SequenceModel, _same_structure
from ..presets import POOL_MASKS, preset_for

FORMAT = "flaxheads-checkpoint/1"
HEAD, BACKBONE, OPT_STATE, EXTRA, STEP, META = "head", "backbone", "opt_state", "extra", "step", "meta"
ARRAY_ITEMS = (HEAD, BACKBONE, OPT_STATE, EXTRA)
JSON_ITEMS = (STEP, META)
CHECKPOINTS_SUBDIR = "checkpoints"


class CheckpointError(ValueError):
    """Base class of the checkpoint errors below."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint step whose files are missing, truncated or unreadable."""


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint written for a different head config / parameter shapes than the target."""


class HeadMismatchError(CheckpointError):
    """A saved head cannot be attached to this backbone (width, pad/eos token, ...)."""


@dataclasses.dataclass
class HeadCheckpoint:
    """A head restored from a checkpoint: module, params (the ``head`` subtree) and ``meta``."""

    head: SequenceHead
    params: dict
    meta: dict
    step: int
    path: str

    @property
    def id2label(self) -> dict[int, str] | None:
        return _int_keys(self.meta.get("id2label"))


# ---- meta ------------------------------------------------------------------------------

def _version() -> str:
    from .. import __version__

    return __version__


def _leaves_with_paths(tree) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [("/".join(_key_str(k) for k in path), leaf) for path, leaf in flat]


def _key_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def head_shapes(head_params) -> dict[str, list]:
    """``{"pooler/dense/kernel": [[32, 32], "float32"], ...}`` for a head params tree."""
    return {p: [list(np.shape(x)), jnp.dtype(x.dtype).name] for p, x in _leaves_with_paths(head_params)}


def head_shapes_hash(head_params) -> str:
    """Hash of the head's parameter paths and shapes (not dtypes, not values)."""
    items = sorted((p, list(np.shape(x))) for p, x in _leaves_with_paths(head_params))
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def expected_head_shapes(head: SequenceHead, hidden_size: int) -> dict:
    """The params tree (as ShapeDtypeStructs) that ``head`` has on hidden states of width ``hidden_size``."""
    return jax.eval_shape(lambda: head.init(jax.random.PRNGKey(0), jnp.zeros((1, 1, hidden_size), jnp.float32),
                                            jnp.ones((1, 1), jnp.int32))).get("params", {})


def _dtype_name(x) -> str | None:
    try:
        return jnp.dtype(x).name
    except TypeError:
        return None


def make_meta(model: SequenceModel, head_params, *, backbone_saved: bool = False,
              extra: Mapping[str, Any] | None = None) -> dict:
    """The JSON ``meta`` item for ``model`` with ``head_params``."""
    dtypes = sorted({jnp.dtype(x.dtype).name for _, x in _leaves_with_paths(head_params)})
    meta = {
        "format": FORMAT,
        "library": "flaxheads",
        "library_version": _version(),
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
    }
    if extra:
        clash = set(extra) & set(meta)
        if clash:
            raise ValueError(f"extra_meta keys {sorted(clash)} would overwrite flaxheads' own meta keys")
        meta.update(extra)
    json.dumps(meta)  # fail now, not inside the async writer, on non-JSON values
    return meta


def _int_keys(d):
    return None if d is None else {int(k): v for k, v in d.items()}


# ---- orbax plumbing -----------------------------------------------------------------------

def _ocp():
    import orbax.checkpoint as ocp

    return ocp


def _handlers() -> dict:
    ocp = _ocp()
    h = {k: ocp.StandardCheckpointHandler() for k in ARRAY_ITEMS}
    h.update({k: ocp.JsonCheckpointHandler() for k in JSON_ITEMS})
    return h


def _manager(root: str, *, read_only: bool = False, async_save: bool = True, preservation=None, best_fn=None,
             best_mode: str = "max"):
    ocp = _ocp()
    opts = dict(create=not read_only, read_only=read_only, enable_async_checkpointing=async_save,
                cleanup_tmp_directories=not read_only, best_fn=best_fn, best_mode=best_mode)
    if read_only:
        opts["save_interval_steps"] = 0
    if preservation is not None:
        opts["preservation_policy"] = preservation
    with _quiet():  # orbax warns that a read-only manager is read-only
        return ocp.CheckpointManager(os.path.abspath(root), options=ocp.CheckpointManagerOptions(**opts),
                                     item_handlers=_handlers())


@contextlib.contextmanager
def _quiet():
    """Silence orbax's absl warnings that are expected here (read-only managers, saves between
    evaluations that carry no metrics) and its Python warnings."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        absl.setLevel(level)


def _abstract(tree, sharding=None):
    """ShapeDtypeStructs for ``tree``; each leaf on ``sharding``, or on its own sharding when None."""
    def one(x):
        s = sharding
        if s is None:
            s = getattr(x, "sharding", None)
        if s is None:
            s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)

    return jax.tree.map(one, tree)


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(tree):
    """Typed PRNG keys (``jax.random.key``) are stored as their raw ``key_data``."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _abstract_state(tree, sharding=None):
    """Like :func:`_abstract`, with typed keys described by their ``key_data``."""
    return _abstract(jax.tree.map(lambda x: jax.eval_shape(jax.random.key_data, x) if _is_key(x) else x, tree),
                     sharding)


def _data_to_keys(restored, target):
    return jax.tree.map(lambda r, t: jax.random.wrap_key_data(r, impl=jax.random.key_impl(t)) if _is_key(t) else r,
                        restored, target)


def backbone_checksum(backbone_params) -> float:
    """Sum of |w| over every backbone weight (float64 on the host): tells a frozen backbone
    loaded again from its folder apart from another one with the same shapes."""
    return float(sum(np.abs(np.asarray(jax.device_get(x), np.float64)).sum()
                     for x in jax.tree.leaves(backbone_params) if hasattr(x, "dtype")))


def _is_empty(tree) -> bool:
    return len(jax.tree.leaves(tree)) == 0


def resolve_root(directory: str | os.PathLike) -> tuple[str, int | None]:
    """(checkpoint root, step) for a run folder, a checkpoint root, or one step's folder."""
    d = os.path.abspath(os.fspath(directory))
    if os.path.isdir(os.path.join(d, META)) and os.path.basename(d).isdigit():
        return os.path.dirname(d), int(os.path.basename(d))
    sub = os.path.join(d, CHECKPOINTS_SUBDIR)
    if os.path.isdir(sub):
        return sub, None
    return d, None


def _pick_step(mgr, root: str, step) -> int:
    steps = sorted(mgr.all_steps())
    if not steps:
        raise FileNotFoundError(f"no checkpoints in {root} (expected step folders such as {root}/0/meta)")
    if step is None or step == "latest":
        return steps[-1]
    if step == "best":
        best = _best_step(mgr, root, steps)
        if best is None:
            raise ValueError(f"{root}: no checkpoint was saved with a best_metric to pick the best one by")
        return best
    if int(step) not in steps:
        raise FileNotFoundError(f"{root}: no checkpoint for step {step}; available steps: {steps}")
    return int(step)


def _best_step(mgr, root: str, steps: list[int]) -> int | None:
    """The best step by the ``best_metric``/``mode`` recorded in each step's ``step`` item."""
    scored, mode = [], "max"
    for s in steps:
        try:
            info = _read_json(mgr, root, s, STEP)
        except CorruptCheckpointError:
            continue
        name, m = info.get("best_metric"), info.get("metrics") or {}
        if name and name in m:
            scored.append((float(m[name]), s))
            mode = info.get("mode", "max")
    return _pick_best(scored, mode)


def _pick_best(scored: list[tuple[float, int]], mode: str) -> int | None:
    """Best (value, step) by ``mode``; ties go to the latest step (as Orbax's ``best_step``)."""
    if not scored:
        return None
    if mode == "max":
        return max(scored)[1]
    return min(scored, key=lambda vs: (vs[0], -vs[1]))[1]


def _corrupt(root: str, step: int, item: str, steps: list[int], err: BaseException) -> CorruptCheckpointError:
    others = sorted(s for s in steps if s != step)
    earlier = [s for s in others if s < step]
    pick = earlier[-1] if earlier else (others[-1] if others else None)
    hint = (f" Other steps in this folder: {others}; restore one with step={pick} "
            f"(train: --resume-step {pick}), or delete {os.path.join(root, str(step))}."
            if others else " There is no other step in this folder.")
    return CorruptCheckpointError(
        f"checkpoint step {step} at {os.path.join(root, str(step))} is corrupt: its '{item}' item could not be "
        f"read ({type(err).__name__}: {str(err).strip()[:300]}). Its files are missing, truncated or damaged."
        + hint)


def _read_json(mgr, root: str, step: int, item: str) -> dict:
    ocp = _ocp()
    path = os.path.join(root, str(step), item)
    if not os.path.isdir(path):
        raise _corrupt(root, step, item, mgr.all_steps(), FileNotFoundError(f"{path} does not exist"))
    try:
        out = mgr.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item]
    except Exception as e:  # orbax/json raise many types for damaged files
        raise _corrupt(root, step, item, mgr.all_steps(), e) from e
    if not isinstance(out, dict):
        raise _corrupt(root, step, item, mgr.all_steps(), ValueError(f"expected a JSON object, got {out!r}"))
    return out


def _restore_arrays(mgr, root: str, step: int, items: dict) -> dict:
    """Restore {item: abstract tree}; empty trees are returned as given (never written)."""
    ocp = _ocp()
    want = {k: v for k, v in items.items() if not _is_empty(v)}
    for k in want:
        if not os.path.isdir(os.path.join(root, str(step), k)):
            raise _corrupt(root, step, k, mgr.all_steps(), FileNotFoundError(
                f"{os.path.join(root, str(step), k)} does not exist"))
    out = {k: v for k, v in items.items() if _is_empty(v)}
    if want:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = mgr.restore(step, args=ocp.args.Composite(
                    **{k: ocp.args.StandardRestore(v) for k, v in want.items()}))
        except CheckpointError:
            raise
        except Exception as e:
            raise _corrupt(root, step, "/".join(want), mgr.all_steps(), e) from e
        out.update({k: got[k] for k in want})
    return out


def _check_meta_format(meta: dict, where: str) -> None:
    if meta.get("format") != FORMAT:
        raise IncompatibleCheckpointError(
            f"{where}: meta format is {meta.get('format')!r}, this flaxheads {_version()} reads {FORMAT!r}. "
            "Load it with the flaxheads version that wrote it (meta.library_version="
            f"{meta.get('library_version')!r}).")


def _build_head(meta: dict, where: str) -> SequenceHead:
    try:
        head = _config.from_dict(meta["head_config"])
    except (KeyError, ValueError, TypeError) as e:
        raise IncompatibleCheckpointError(
            f"{where}: cannot build the head from its saved config ({e}). It was written by flaxheads "
            f"{meta.get('library_version')!r}; this is {_version()}.") from e
    if not isinstance(head, SequenceHead):
        raise IncompatibleCheckpointError(f"{where}: head_config is a {type(head).__name__}, not a SequenceHead")
    return head


def _shape_diff(want: dict, got: dict) -> str:
    lines = []
    for p in sorted(set(want) | set(got)):
        a, b = want.get(p), got.get(p)
        if a is None or b is None or list(a[0]) != list(b[0]):
            lines.append(f"{p}: checkpoint {None if b is None else b[0]} vs target {None if a is None else a[0]}")
    return "; ".join(lines[:8]) + (" ..." if len(lines) > 8 else "")


def _config_diff(a, b, prefix="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _config_diff(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if a == b else [f"{prefix}: checkpoint {a!r} vs target {b!r}"]


# ---- public head API ---------------------------------------------------------------------

def _head_params_of(model: SequenceModel, params) -> dict:
    if params is None:
        return model.params["head"]
    if isinstance(params, Mapping) and set(params) == {"backbone", "head"}:
        return params["head"]
    return params


def save_head(directory: str | os.PathLike, model: SequenceModel, params=None, *, step: int = 0,
              extra_meta: Mapping[str, Any] | None = None) -> str:
    """Save the head of ``model`` (``params``: full params, the head subtree, or None for
    ``model.params``) as step ``step`` under ``directory``; returns the step's folder.

    Writes the ``head`` and ``meta`` items only: the backbone is referenced by
    ``meta.backbone_name_or_path``. Blocks until the files are complete."""
    head_params = _head_params_of(model, params)
    _check_params_fit(model.head, model.hidden_size, head_params, "save_head")
    meta = make_meta(model, head_params, backbone_saved=False, extra=extra_meta)
    ocp = _ocp()
    root = os.path.abspath(os.fspath(directory))
    mgr = _manager(root, async_save=False)
    try:
        if step in mgr.all_steps():
            raise FileExistsError(f"{root} already has a checkpoint for step {step}; pass another step= "
                                  "or a new directory")
        items = {META: ocp.args.JsonSave(meta), STEP: ocp.args.JsonSave({"step": int(step), "metrics": None})}
        if not _is_empty(head_params):
            items[HEAD] = ocp.args.StandardSave(head_params)
        mgr.save(int(step), args=ocp.args.Composite(**items), force=True)
        mgr.wait_until_finished()
    finally:
        mgr.close()
    return os.path.join(root, str(int(step)))


def _check_params_fit(head: SequenceHead, hidden_size: int, head_params, where: str) -> None:
    want = head_shapes(expected_head_shapes(head, hidden_size))
    got = head_shapes(head_params)
    if {p: v[0] for p, v in want.items()} != {p: v[0] for p, v in got.items()}:
        raise IncompatibleCheckpointError(
            f"{where}: the head params do not fit the head config on hidden width {hidden_size}: "
            f"{_shape_diff(want, got)}")


@contextlib.contextmanager
def _open_step(directory: str | os.PathLike, step: int | str | None):
    """``(manager, root, step)`` of a checkpoint opened read-only; ``step`` defaults to the one
    named by ``directory`` (a step folder) else the latest."""
    root, s = resolve_root(directory)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"checkpoint folder {root} does not exist")
    mgr = _manager(root, read_only=True)
    try:
        yield mgr, root, _pick_step(mgr, root, s if step is None and s is not None else step)
    finally:
        mgr.close()


def read_meta(directory: str | os.PathLike, step: int | str | None = None) -> tuple[dict, int, str]:
    """(meta, step, root) of a checkpoint; reads nothing but the ``meta`` item."""
    with _open_step(directory, step) as (mgr, root, step):
        return _read_json(mgr, root, step, META), step, root


def load_head(directory: str | os.PathLike, step: int | str | None = None, *,
              sharding: jax.sharding.Sharding | None = None) -> HeadCheckpoint:
    """Restore a head (module + params + meta) without reading the backbone item.

    ``directory``: a run folder, a checkpoint root or one step's folder; ``step``: an int,
    ``None``/``"latest"`` or ``"best"``. Params land on ``sharding`` (default: the first
    device). Raises :class:`IncompatibleCheckpointError` when the saved config does not
    produce the saved shapes, :class:`CorruptCheckpointError` for damaged files."""
    with _open_step(directory, step) as (mgr, root, step):
        where = os.path.join(root, str(step))
        meta = _read_json(mgr, root, step, META)
        _check_meta_format(meta, where)
        head = _build_head(meta, where)
        want = expected_head_shapes(head, int(meta["hidden_size"]))
        saved = meta.get("head_shapes", {})
        if head_shapes_hash(want) != meta.get("head_shapes_hash"):
            raise IncompatibleCheckpointError(
                f"{where}: the saved head config builds parameters of other shapes than the saved ones "
                f"({_shape_diff(head_shapes(want), saved)}). The checkpoint was written by flaxheads "
                f"{meta.get('library_version')!r} (this is {_version()}); load it with that version.")
        # restore in the dtypes that were saved (float32 or bfloat16), shapes from the config
        target = jax.tree_util.tree_map_with_path(
            lambda p, x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(saved.get(
                "/".join(_key_str(k) for k in p), [None, x.dtype.name])[1])), want)
        dev = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        params = _restore_arrays(mgr, root, step, {HEAD: _abstract(target, dev)})[HEAD]
        return HeadCheckpoint(head=head, params=params, meta=meta, step=step, path=where)


def attach_head(model: SequenceModel, ckpt: HeadCheckpoint, *, pool_mask: str | None = None) -> SequenceModel:
    """``model`` with the checkpoint's head, head params, labels and problem type.

    The backbone must have the hidden width the head was trained on, and whatever its
    pooling mask needs (``non_pad_token``: a ``pad_token_id``; ``eos_token``: an
    ``eos_token_id``). ``pool_mask`` overrides the saved one (e.g. ``"attention_mask"``)."""
    meta = ckpt.meta
    src = f"head checkpoint {ckpt.path} (trained on {meta.get('backbone_model_type')} " \
          f"{meta.get('backbone_name_or_path')!r})"
    tgt = f"backbone {model.model_type} {model.name_or_path!r}"
    if int(meta["hidden_size"]) != model.hidden_size:
        raise HeadMismatchError(
            f"hidden width mismatch: {src} expects hidden_size={meta['hidden_size']}, {tgt} has "
            f"hidden_size={model.hidden_size}. A head moves only between backbones of the same width; pick a "
            f"backbone with hidden_size={meta['hidden_size']} or train a new head on this one.")
    mask = pool_mask or meta.get("pool_mask", "attention_mask")
    if mask not in POOL_MASKS:
        raise ValueError(f"pool_mask must be one of {POOL_MASKS}, got {mask!r}")
    if mask == "non_pad_token" and model.pad_token_id is None:
        raise HeadMismatchError(
            f"pad_token_id mismatch: {src} pools the last non-pad token (GPT-2's rule, pool_mask="
            f"'non_pad_token', saved pad_token_id={meta.get('pad_token_id')}), but {tgt} has no pad_token_id "
            "(config.pad_token_id is None). Set config.pad_token_id on the backbone (e.g. to its eos_token_id) "
            "and save it, or attach with pool_mask='attention_mask' to pool the last attended token instead.")
    if mask == "eos_token" and model.eos_token_id is None:
        raise HeadMismatchError(
            f"eos_token_id mismatch: {src} pools the last <eos> token (BART's rule, pool_mask='eos_token'), but "
            f"{tgt} has no eos_token_id. Set config.eos_token_id, or attach with pool_mask='attention_mask'.")
    _check_params_fit(ckpt.head, model.hidden_size, ckpt.params, f"attach_head({ckpt.path})")
    arch, names = None, ()
    preset = preset_for(model.backbone.config, int(meta["num_labels"]))
    if (preset is not None and mask == preset.pool_mask and _same_structure(ckpt.head.pooler, preset.pooler)
            and _same_structure(ckpt.head.head, preset.head)):
        arch, names = preset.arch, preset.hf_names
    report = LoadReport(pretrained=[(p, f"{ckpt.path}/{HEAD}") for p in _module_names(ckpt.params)], new=[])
    return dataclasses.replace(
        model, head=ckpt.head, num_labels=int(meta["num_labels"]), problem_type=meta["problem_type"],
        params={"backbone": model.params["backbone"], "head": ckpt.params}, id2label=ckpt.id2label,
        pool_mask=mask, arch=arch, hf_names=names, report=report)


def _module_names(tree, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        if isinstance(v, Mapping) and v and all(not isinstance(x, Mapping) for x in v.values()):
            out.append(f"{prefix}{k}")
        elif isinstance(v, Mapping):
            out += _module_names(v, f"{prefix}{k}/")
    return out


def load_backbone_params(directory: str | os.PathLike, step: int | str | None = None, *, target,
                         sharding: jax.sharding.Sharding | None = None):
    """The ``backbone`` item of a checkpoint that saved it, in the structure/dtypes of ``target``
    (e.g. ``from_pretrained(meta["backbone_name_or_path"]).params["backbone"]``). Raises
    ``FileNotFoundError`` when the backbone was frozen (not saved: load it from its folder)."""
    with _open_step(directory, step) as (mgr, root, step):
        meta = _read_json(mgr, root, step, META)
        if not meta.get("backbone_saved"):
            raise FileNotFoundError(
                f"{os.path.join(root, str(step))} does not contain the backbone (it was frozen); load it from "
                f"{meta.get('backbone_name_or_path')!r}")
        dev = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return _restore_arrays(mgr, root, step, {BACKBONE: _abstract(target, dev)})[BACKBONE]


# ---- training runs -----------------------------------------------------------------------

def _metric_getter(name: str):
    def get(metrics) -> float:
        # a step saved without this metric ranks last
        v = (metrics or {}).get(name)
        return float("nan") if v is None else float(v)

    return get


def _state_fields(state) -> dict[str, Any]:
    """Array-carrying fields of a train state: a mapping, a (flax.struct) dataclass or a namedtuple."""
    if isinstance(state, Mapping):
        return dict(state)
    if dataclasses.is_dataclass(state):
        return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
                if f.metadata.get("pytree_node", True)}
    if hasattr(state, "_asdict"):
        return dict(state._asdict())
    raise TypeError(f"train state must be a mapping, dataclass or namedtuple with step/params/opt_state; "
                    f"got {type(state).__name__}")


def _replace_fields(state, values: dict):
    if isinstance(state, Mapping):
        return {**state, **values}
    if dataclasses.is_dataclass(state):
        if hasattr(state, "replace"):
            return state.replace(**values)
        return dataclasses.replace(state, **values)
    return state._replace(**values)


class RunCheckpointer:
    """Checkpoints of one training run under ``<run_dir>/checkpoints``.

    ``state`` is any train state with ``step``, ``params`` (``{"backbone", "head"}``) and
    ``opt_state`` (a mapping, dataclass or namedtuple); other array fields (rng keys, ...)
    go to the ``extra`` item. ``save_backbone=False`` (a frozen backbone) stores only the
    head; the backbone is then taken from the target state on restore.

    Retention: the ``keep`` most recent steps, plus the ``keep_best`` best by
    ``metrics[best_metric]`` (``mode`` "max" or "min") when ``best_metric`` is set."""

    def __init__(self, run_dir: str | os.PathLike, model: SequenceModel | None = None, *, keep: int | None = 3,
                 best_metric: str | None = None, mode: str = "max", keep_best: int = 1,
                 save_backbone: bool = True, async_save: bool = True, read_only: bool = False,
                 extra_meta: Mapping[str, Any] | None = None):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 (or None for all), got {keep}")
        ocp = _ocp()
        self.run_dir = os.path.abspath(os.fspath(run_dir))
        self.root = os.path.join(self.run_dir, CHECKPOINTS_SUBDIR)
        self.model, self.best_metric, self.mode = model, best_metric, mode
        self.save_backbone = save_backbone
        self.extra_meta = dict(extra_meta or {})
        self._checksum: float | None = None
        cm = ocp.checkpoint_managers
        policies = [cm.LatestN(n=keep)]
        best_fn = None
        if best_metric is not None:
            best_fn = _metric_getter(best_metric)
            policies.append(cm.BestN(get_metric_fn=best_fn, reverse=(mode == "min"), n=keep_best,
                                     keep_checkpoints_without_metrics=False))
        if read_only and not os.path.isdir(self.root):
            raise FileNotFoundError(f"no checkpoints folder {self.root}")
        self._mgr = _manager(self.root, read_only=read_only, async_save=async_save,
                             preservation=cm.AnyPreservationPolicy(policies), best_fn=best_fn, best_mode=mode)

    # context manager: always wait for the last async save
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()

    def wait_until_finished(self) -> None:
        self._mgr.wait_until_finished()

    def all_steps(self) -> list[int]:
        """Finished steps (a save still in progress is not listed until its folder is in place)."""
        return sorted(s for s in self._mgr.all_steps() if os.path.isdir(os.path.join(self.root, str(s))))

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The best finished step by ``best_metric`` (waits for a save in progress)."""
        if not self.best_metric:
            return None
        self._mgr.wait_until_finished()
        return self._mgr.best_step()

    def save(self, step: int, state, metrics: Mapping[str, float] | None = None, *, force: bool = True) -> bool:
        """Start an asynchronous, atomic save of ``state`` as ``step``; returns at once after the
        arrays are copied. The previous save is waited for first (Orbax)."""
        ocp = _ocp()
        fields = _state_fields(state)
        params, opt_state = fields.pop("params"), fields.pop("opt_state")
        fields.pop("step", None)
        metrics = None if metrics is None else {k: float(v) for k, v in metrics.items()}
        if self.best_metric is not None and metrics is not None and self.best_metric not in metrics:
            raise KeyError(f"best_metric {self.best_metric!r} is not among the metrics {sorted(metrics)}")
        if self.model is None:
            raise ValueError("RunCheckpointer needs model= to write the checkpoint's meta")
        extra = dict(self.extra_meta)
        if not self.save_backbone:
            if self._checksum is None:  # frozen: the same for every step of the run
                self._checksum = backbone_checksum(params["backbone"])
            extra["backbone_checksum"] = self._checksum
        meta = make_meta(self.model, params["head"], backbone_saved=self.save_backbone, extra=extra)
        fields = _keys_to_data(fields)
        info = {"step": int(step), "metrics": metrics, "best_metric": self.best_metric, "mode": self.mode}
        items = {META: ocp.args.JsonSave(meta), STEP: ocp.args.JsonSave(info)}
        for name, tree in ((HEAD, params["head"]), (OPT_STATE, opt_state), (EXTRA, fields),
                           (BACKBONE, params["backbone"] if self.save_backbone else {})):
            if not _is_empty(tree):
                items[name] = ocp.args.StandardSave(tree)
        with _quiet():
            return self._mgr.save(int(step), args=ocp.args.Composite(**items), metrics=metrics, force=force)

    def read_meta(self, step: int | None = None) -> dict:
        self._mgr.wait_until_finished()  # a step still being written is not readable yet
        step = _pick_step(self._mgr, self.root, step)
        return _read_json(self._mgr, self.root, step, META)

    def restore(self, step: int | str | None = None, *, target_state, sharding: jax.sharding.Sharding | None = None):
        """The state saved at ``step`` (default: latest; or ``"best"``), in the structure of
        ``target_state``. Arrays go to ``sharding`` when given (a mesh ``NamedSharding`` or one
        device), else to each target leaf's own sharding. A frozen backbone (not saved) is
        taken from ``target_state``."""
        self._mgr.wait_until_finished()  # a step still being written is not readable yet
        step = _pick_step(self._mgr, self.root, step)
        where = os.path.join(self.root, str(step))
        meta = _read_json(self._mgr, self.root, step, META)
        _check_meta_format(meta, where)
        fields = _state_fields(target_state)
        params, opt_state = fields.pop("params"), fields.pop("opt_state")
        fields.pop("step", None)
        if head_shapes_hash(params["head"]) != meta.get("head_shapes_hash"):
            diff = _config_diff(meta.get("head_config"), _config.to_dict(self.model.head)) if self.model else []
            raise IncompatibleCheckpointError(
                f"{where} was written by an incompatible head config: "
                f"{'; '.join(diff) if diff else 'same config'}; parameter shapes: "
                f"{_shape_diff(head_shapes(params['head']), meta.get('head_shapes', {}))}. "
                f"Resume with the head config in the checkpoint's meta, or start a new run folder "
                f"(train: --no-resume).")
        if self.model is not None:
            for key, have in (("hidden_size", self.model.hidden_size),
                              ("backbone_model_type", self.model.model_type)):
                if meta.get(key) != have:
                    raise IncompatibleCheckpointError(
                        f"{where}: checkpoint {key}={meta.get(key)!r} but this run's backbone has {have!r}; "
                        "resume with the backbone the run was started with, or start a new run folder.")
        saved_sum = meta.get("backbone_checksum")
        if not meta.get("backbone_saved") and saved_sum is not None:
            have = backbone_checksum(params["backbone"])
            if not np.isclose(have, saved_sum, rtol=1e-6, atol=0.0):
                raise IncompatibleCheckpointError(
                    f"{where}: the run's frozen backbone was not saved, and the backbone given now differs from the "
                    f"one it was trained with (weight checksum {have!r} vs {saved_sum!r}; saved from "
                    f"{meta.get('backbone_name_or_path')!r}). Load that backbone folder, or start a new run.")
        items = {HEAD: _abstract(params["head"], sharding), OPT_STATE: _abstract(opt_state, sharding),
                 EXTRA: _abstract_state(fields, sharding)}
        if meta.get("backbone_saved"):
            items[BACKBONE] = _abstract(params["backbone"], sharding)
        got = _restore_arrays(self._mgr, self.root, step, items)
        step_info = _read_json(self._mgr, self.root, step, STEP)
        backbone = got.get(BACKBONE)
        if backbone is None:
            backbone = params["backbone"] if sharding is None else jax.device_put(params["backbone"], sharding)
        values = {"params": {"backbone": backbone, "head": got[HEAD]}, "opt_state": got[OPT_STATE],
                  **_data_to_keys(got[EXTRA], fields)}
        if "step" in _state_fields(target_state):
            old = _state_fields(target_state)["step"]
            if hasattr(old, "dtype"):
                where_to = sharding or getattr(old, "sharding", None)
                values["step"] = jnp.asarray(step_info["step"], dtype=old.dtype)
                if where_to is not None:
                    values["step"] = jax.device_put(values["step"], where_to)
            else:
                values["step"] = int(step_info["step"])
        return _replace_fields(target_state, values)


# ---- listing -------------------------------------------------------------------------------

def _dir_size(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


def _verify_step(mgr, root: str, step: int) -> None:
    """Read every array of every item of ``step`` (onto the first device); raises
    :class:`CorruptCheckpointError` on the first unreadable item."""
    d = os.path.join(root, str(step))
    try:
        md = mgr.item_metadata(step)
        with open(os.path.join(d, "_CHECKPOINT_METADATA")) as f:
            written = set(json.load(f).get("item_handlers") or {})  # every item the save wrote
    except Exception as e:
        raise _corrupt(root, step, "metadata", mgr.all_steps(), e) from e
    items = [x for x in ARRAY_ITEMS if x in written or os.path.isdir(os.path.join(d, x))]
    for item in items:
        if not os.path.isdir(os.path.join(d, item)):
            raise _corrupt(root, step, item, mgr.all_steps(), FileNotFoundError(f"{os.path.join(d, item)} is missing"))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for item in items:
        try:
            tree = md[item].tree
            target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=dev), tree)
        except Exception as e:
            raise _corrupt(root, step, item, mgr.all_steps(), e) from e
        _restore_arrays(mgr, root, step, {item: target})
    for item in JSON_ITEMS:
        _read_json(mgr, root, step, item)


def verify_checkpoint(directory: str | os.PathLike, step: int | str | None = None) -> int:
    """Read every file of a checkpoint step; returns the step, or raises
    :class:`CorruptCheckpointError` naming the damaged item and the earlier steps."""
    with _open_step(directory, step) as (mgr, root, step):
        _verify_step(mgr, root, step)
        return step


def list_checkpoints(directory: str | os.PathLike, *, verify: bool = False) -> list[dict]:
    """One dict per step folder of a run: step, items, metrics, size, latest/best flags,
    and ``status`` ("ok", or what is wrong); unfinished saves show as ``"incomplete"``.
    The JSON items are always read; ``verify=True`` reads every array too."""
    root, _ = resolve_root(directory)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"checkpoint folder {root} does not exist")
    mgr = _manager(root, read_only=True)
    try:
        steps = sorted(mgr.all_steps())
        rows, best_by = [], None
        for s in steps:
            d = os.path.join(root, str(s))
            items = sorted(x for x in os.listdir(d) if os.path.isdir(os.path.join(d, x)) and x in
                           ARRAY_ITEMS + JSON_ITEMS)
            row = {"step": s, "path": d, "items": items, "bytes": _dir_size(d), "latest": s == steps[-1],
                   "metrics": None, "best": False, "status": "ok"}
            try:
                info = _read_json(mgr, root, s, STEP)
                row["metrics"] = info.get("metrics")
                if info.get("best_metric"):
                    best_by = (info["best_metric"], info.get("mode", "max"))
                _read_json(mgr, root, s, META)
                if verify:
                    _verify_step(mgr, root, s)
            except CheckpointError as e:
                row["status"] = f"corrupt: {str(e)[:120]}"
            rows.append(row)
        if best_by is not None:
            name, mode = best_by
            best = _pick_best([(float(r["metrics"][name]), r["step"]) for r in rows
                               if r["metrics"] and name in r["metrics"]], mode)
            for r in rows:
                r["best"] = r["step"] == best
        for name in sorted(os.listdir(root)):
            if ".orbax-checkpoint-tmp" in name:
                rows.append({"step": None, "path": os.path.join(root, name), "items": [], "bytes":
                             _dir_size(os.path.join(root, name)), "latest": False, "best": False,
                             "metrics": None, "status": "incomplete (unfinished save; ignored)"})
        return rows
    finally:
        mgr.close()


def format_meta(meta: dict) -> str:
    """A readable multi-line summary of a head checkpoint's meta."""
    hc = meta.get("head_config", {})
    lines = [
        f"flaxheads {meta.get('library_version')} checkpoint ({meta.get('format')}), written {meta.get('created')}",
        f"backbone:     {meta.get('backbone_model_type')} {meta.get('backbone_name_or_path')!r} "
        f"(hidden_size={meta.get('hidden_size')}, dtype={meta.get('dtype')}, "
        f"{'saved in this checkpoint' if meta.get('backbone_saved') else 'referenced, not saved'})",
        f"pooler:       {_one_line(hc.get('pooler'))}",
        f"head:         {_one_line(hc.get('head'))}",
        f"pool mask:    {meta.get('pool_mask')} (pad_token_id={meta.get('pad_token_id')}, "
        f"eos_token_id={meta.get('eos_token_id')})",
        f"HF preset:    {meta.get('arch') or '-'}",
        f"problem:      {meta.get('problem_type')}, num_labels={meta.get('num_labels')}",
    ]
    labels = meta.get("id2label")
    if labels:
        lines.append("labels:       " + ", ".join(f"{k}={v}" for k, v in sorted(labels.items(), key=lambda kv: int(kv[0]))))
    shapes = meta.get("head_shapes", {})
    n = sum(int(np.prod(s)) for s, _ in shapes.values())
    lines.append(f"head params:  {n:,} in {len(shapes)} arrays, dtype {meta.get('param_dtype')}, "
                 f"shapes hash {meta.get('head_shapes_hash')}")
    for p, (s, dt) in sorted(shapes.items()):
        lines.append(f"  {p:<32} {str(tuple(s)):<14} {dt}")
    known = {"format", "library", "library_version", "created", "head_config", "problem_type", "num_labels",
             "id2label", "hidden_size", "backbone_model_type", "backbone_name_or_path", "backbone_saved", "dtype",
             "param_dtype", "pool_mask", "pad_token_id", "eos_token_id", "arch", "hf_names", "head_shapes",
             "head_shapes_hash", "jax_version"}
    for k in sorted(set(meta) - known):
        v = meta[k]
        if isinstance(v, dict):  # e.g. the train program's run settings
            lines.append(f"{k}:")
            for sub, val in v.items():
                text = (", ".join(f"{a}={json.dumps(b)}" for a, b in val.items()) if isinstance(val, dict)
                        else json.dumps(val))
                lines.append(f"  {sub + ':':<14}{text}")
        else:
            lines.append(f"{k + ':':<13} {json.dumps(v)}")
    return "\n".join(lines)


def _one_line(cfg) -> str:
    if not isinstance(cfg, dict):
        return str(cfg)
    kind = cfg.get("type", "?")
    rest = ", ".join(f"{k}={_one_line(v) if isinstance(v, dict) else v}" for k, v in cfg.items() if k != "type")
    return f"{kind}({rest})"


def format_listing(rows: list[dict]) -> str:
    if not rows:
        return "no checkpoints"
    out = [f"{'step':>8}  {'items':<40} {'size':>10}  {'metrics':<28} flags"]
    for r in rows:
        flags = ",".join(f for f, on in (("latest", r["latest"]), ("best", r["best"])) if on)
        if r["status"] != "ok":
            flags = (flags + " " if flags else "") + r["status"]
        m = ", ".join(f"{k}={v:.4g}" for k, v in (r["metrics"] or {}).items())
        step = "-" if r["step"] is None else str(r["step"])
        out.append(f"{step:>8}  {','.join(r['items']):<40} {_human(r['bytes']):>10}  {m:<28} {flags}")
    return "\n".join(out)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ---- glue for flaxheads.train.fit ------------------------------------------------------------

def flat_metrics(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """``{"validation": {"accuracy": 0.9, ...}}`` -> ``{"validation/accuracy": 0.9, ...}`` (scalars only)."""
    return {f"{split}/{k}": float(v) for split, r in results.items() for k, v in r.items()
            if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)}


class FitCheckpointing:
    """``on_step_end`` / ``on_eval`` hooks for :func:`flaxheads.train.fit` that save through a
    :class:`RunCheckpointer`: at every evaluation (with its metrics, for keep-best), every
    ``every`` steps (None: evaluations only; 0: never) and at the last step.

    ``host_state`` turns the placed state into a saveable one (``parallel.get_state`` under
    pmap, whose state has a leading device axis); None saves it as placed (single device or
    mesh-replicated arrays, copied asynchronously)."""

    def __init__(self, ckr: RunCheckpointer, *, every: int | None, eval_every: int, total: int, has_evals: bool,
                 host_state=None):
        self.ckr, self.every, self.eval_every, self.total = ckr, every, eval_every, total
        self.has_evals, self.host_state = has_evals, host_state
        self.saved: list[int] = []

    def _evaluated(self, step: int) -> bool:  # mirrors fit(): each eval_every steps, and the last step
        return self.has_evals and (step % self.eval_every == 0 or step == self.total)

    def _due(self, step: int) -> bool:
        if self.every == 0:
            return False
        return step == self.total or bool(self.every and step % self.every == 0) or self._evaluated(step)

    def _save(self, state, step: int, metrics=None) -> None:
        if step in self.ckr.all_steps():  # resumed at the very step it was saved (e.g. the last one)
            return
        self.ckr.save(step, state if self.host_state is None else self.host_state(state), metrics=metrics)
        self.saved.append(step)

    def on_step_end(self, state, step: int, metrics=None) -> None:
        if self._due(step) and not self._evaluated(step):
            self._save(state, step)

    def on_eval(self, state, step: int, results) -> None:
        if self._due(step):
            m = flat_metrics(results)
            if self.ckr.best_metric is not None and self.ckr.best_metric not in m:
                raise KeyError(f"best metric {self.ckr.best_metric!r} is not among the evaluation metrics "
                               f"{sorted(m)}")
            self._save(state, step, m)


def changed_settings(saved: Mapping[str, Any] | None, current: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Keys whose values differ between a checkpoint's recorded run settings and the current ones."""
    out = []
    saved = saved or {}
    for k in sorted(set(saved) | set(current)):
        a, b = saved.get(k), current.get(k)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += changed_settings(a, b, f"{prefix}{k}.")
        elif json.dumps(a, default=str, sort_keys=True) != json.dumps(b, default=str, sort_keys=True):
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out
