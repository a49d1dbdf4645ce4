"""The Orbax plumbing: managers, abstract trees, saving and restoring items, picking a step,
and the corrupt-step report. Nothing here knows what a head or a model is."""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import errno
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from flaxheads.checkpoint.meta import (
    ARRAY_ITEMS,
    CHECKPOINTS_SUBDIR,
    JSON_ITEMS,
    META,
    STEP,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    DamagedCheckpointError,
)
from flaxheads.disk import checksums
from flaxheads.errors import os_error_cause
from flaxheads.layers.quantized import is_quantized


def _handlers() -> dict:
    h = {k: ocp.StandardCheckpointHandler() for k in ARRAY_ITEMS}
    h.update({k: ocp.JsonCheckpointHandler() for k in JSON_ITEMS})
    return h


#: Longest wait for an asynchronous save (seconds). Orbax waits 20 minutes by default; a local or
#: network disk that has not written a checkpoint in this time has failed.
ASYNC_TIMEOUT_S = 600


def manager(
    root: str,
    *,
    read_only: bool = False,
    async_save: bool = True,
    preservation=None,
    best_fn: Callable | None = None,
    best_mode: str = "max",
) -> ocp.CheckpointManager:
    """An Orbax manager of the step folders under ``root``, with one handler per item.

    A step's folders are created before ``save`` returns, not in the background: a folder that
    cannot be created (read-only, full, gone) fails that save in the caller's thread, and no
    writer thread waits on folders that never come (Orbax's waits run up to 5 minutes)."""
    opts = dict(
        create=not read_only,
        read_only=read_only,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=not read_only,
        best_fn=best_fn,
        best_mode=best_mode,
        async_options=ocp.AsyncOptions(timeout_secs=ASYNC_TIMEOUT_S, create_directories_asynchronously=False),
    )
    if read_only:
        opts["save_interval_steps"] = 0
    if preservation is not None:
        opts["preservation_policy"] = preservation
    with quiet():  # orbax warns that a read-only manager is read-only
        return ocp.CheckpointManager(
            os.path.abspath(root), options=ocp.CheckpointManagerOptions(**opts), item_handlers=_handlers()
        )


def retention(keep: int | None, best_fn: Callable | None = None, mode: str = "max", keep_best: int = 1):
    """Orbax preservation policy: the ``keep`` latest steps, plus the ``keep_best`` best by ``best_fn``."""
    cm = ocp.checkpoint_managers
    policies = [cm.LatestN(n=keep)]
    if best_fn is not None:
        policies.append(
            cm.BestN(
                get_metric_fn=best_fn, reverse=(mode == "min"), n=keep_best, keep_checkpoints_without_metrics=False
            )
        )
    return cm.AnyPreservationPolicy(policies)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
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


def drop_unawaited_writes() -> None:
    """After a failed save: Orbax leaves some of its write coroutines never awaited, and each would
    print a RuntimeWarning when collected (usually at exit, after the run's one-line error)."""
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)


# ---- abstract trees ----------------------------------------------------------------------------


def first_device() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def abstract(tree, sharding: jax.sharding.Sharding | None = None):
    """ShapeDtypeStructs for ``tree``; each leaf on ``sharding``, or on its own sharding when None."""

    def one(x):
        s = sharding if sharding is not None else getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s if s is not None else first_device())

    return jax.tree.map(one, tree)


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def keys_to_data(tree):
    """Typed PRNG keys (``jax.random.key``) are stored as their raw ``key_data``."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def abstract_state(tree, sharding: jax.sharding.Sharding | None = None):
    """Like :func:`abstract`, with typed keys described by their ``key_data``."""
    return abstract(jax.tree.map(lambda x: jax.eval_shape(jax.random.key_data, x) if _is_key(x) else x, tree), sharding)


def data_to_keys(restored, target):
    """Inverse of :func:`keys_to_data`: typed keys where ``target`` has them."""
    return jax.tree.map(
        lambda r, t: jax.random.wrap_key_data(r, impl=jax.random.key_impl(t)) if _is_key(t) else r, restored, target
    )


def is_empty(tree) -> bool:
    return len(jax.tree.leaves(tree)) == 0


# ---- folders and steps ----------------------------------------------------------------------------


def resolve_root(directory: str | os.PathLike) -> tuple[str, int | None]:
    """(checkpoint root, step) for a run folder, a checkpoint root, or one step's folder."""
    d = os.path.abspath(os.fspath(directory))
    if os.path.isdir(os.path.join(d, META)) and os.path.basename(d).isdigit():
        return os.path.dirname(d), int(os.path.basename(d))
    sub = os.path.join(d, CHECKPOINTS_SUBDIR)
    if os.path.isdir(sub):
        return sub, None
    return d, None


def is_checkpoint_folder(path: str | os.PathLike) -> bool:
    """A run folder (``checkpoints/`` inside), a checkpoint root (step folders with ``meta``) or one step's folder."""
    d = os.fspath(path)

    def is_step(p):
        return os.path.basename(p).isdigit() and os.path.isdir(os.path.join(p, META))

    return os.path.isdir(d) and (
        os.path.isdir(os.path.join(d, CHECKPOINTS_SUBDIR))
        or is_step(d)
        or any(is_step(os.path.join(d, x)) for x in os.listdir(d))
    )


def pick_step(mgr, root: str, step: int | str | None) -> int:
    """The step an int, ``None``/``"latest"`` or ``"best"`` names among the finished ones."""
    steps = sorted(mgr.all_steps())
    if not steps:
        from flaxheads.checkpoint.kinds import without_checkpoint  # kinds asks this module what a folder is

        raise CheckpointNotFoundError(without_checkpoint(root))
    if step is None or step == "latest":
        return steps[-1]
    if step == "best":
        best = _best_step(mgr, root, steps)
        if best is None:
            raise CheckpointError(
                f"{root}: no checkpoint was saved with a best_metric to pick the best one by; "
                f"pick a step by number (available: {steps}) or 'latest'"
            )
        return best
    if int(step) not in steps:
        raise CheckpointNotFoundError(f"{root}: no checkpoint for step {step}; available steps: {steps}")
    return int(step)


def _best_step(mgr, root: str, steps: list[int]) -> int | None:
    """The best step by the ``best_metric``/``mode`` recorded in each step's ``step`` item."""
    scored, mode = [], "max"
    for s in steps:
        try:
            info = read_json(mgr, root, s, STEP)
        except CorruptCheckpointError:
            continue
        name, m = info.get("best_metric"), info.get("metrics") or {}
        if name and name in m:
            scored.append((float(m[name]), s))
            mode = info.get("mode", "max")
    return pick_best(scored, mode)


def pick_best(scored: list[tuple[float, int]], mode: str) -> int | None:
    """Best (value, step) by ``mode``; ties go to the latest step (as Orbax's ``best_step``)."""
    if not scored:
        return None
    if mode == "max":
        return max(scored)[1]
    return min(scored, key=lambda vs: (vs[0], -vs[1]))[1]


@contextlib.contextmanager
def open_step(directory: str | os.PathLike, step: int | str | None) -> Iterator[tuple[Any, str, int]]:
    """``(manager, root, step)`` of a checkpoint opened read-only; ``step`` defaults to the one
    named by ``directory`` (a step folder) else the latest."""
    root, s = resolve_root(directory)
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"checkpoint folder {root} does not exist")
    mgr = manager(root, read_only=True)
    try:
        yield mgr, root, pick_step(mgr, root, s if step is None and s is not None else step)
    finally:
        mgr.close()


# ---- reading and writing items ----------------------------------------------------------------------


def corrupt(root: str, step: int, item: str, steps: list[int], err: BaseException) -> CorruptCheckpointError:
    """The error for an unreadable ``item`` of ``step``, naming the other steps to fall back on."""
    hint = fallback_hint(root, step, steps)
    return CorruptCheckpointError(
        f"checkpoint step {step} at {os.path.join(root, str(step))} is corrupt: its '{item}' item could not be "
        f"read ({type(err).__name__}: {str(err).strip()[:300]}). Its files are missing, truncated or damaged." + hint
    )


def fallback_hint(root: str, step: int, steps: list[int]) -> str:
    """Which other step to restore instead of a damaged ``step``."""
    others = sorted(s for s in steps if s != step)
    earlier = [s for s in others if s < step]
    pick = earlier[-1] if earlier else (others[-1] if others else None)
    return (
        f" Other steps in this folder: {others}; restore one with step={pick} "
        f"(train: --resume-step {pick}), or delete {os.path.join(root, str(step))}."
        if others
        else " There is no other step in this folder."
    )


def seal_step(root: str, step: int) -> None:
    """Record the checksums of a finished step's files (process 0 only; once)."""
    d = os.path.join(root, str(step))
    if jax.process_index() == 0 and os.path.isdir(d) and not os.path.isfile(os.path.join(d, checksums.MANIFEST)):
        checksums.write_manifest(d)


def check_step(mgr, root: str, step: int, items: tuple[str, ...] | None = None) -> None:
    """:class:`DamagedCheckpointError` when a file of ``step`` (of its ``items``: a head is read
    without the backbone) differs from its recorded checksum (a step saved without checksums, by an
    older flaxheads, is read as it is)."""
    try:
        checksums.verify_folder(os.path.join(root, str(step)), only=items)
    except checksums.ChecksumError as e:
        hint = fallback_hint(root, step, mgr.all_steps())
        raise DamagedCheckpointError(f"checkpoint step {step} is damaged: {e}.{hint}") from None


def require_item(mgr, root: str, step: int, item: str) -> None:
    """:class:`CorruptCheckpointError` when the folder of ``item`` of ``step`` is missing."""
    path = os.path.join(root, str(step), item)
    if not os.path.isdir(path):
        raise corrupt(root, step, item, mgr.all_steps(), FileNotFoundError(f"{path} does not exist"))


def read_json(mgr, root: str, step: int, item: str) -> dict:
    """A JSON item (``meta``, ``step``) of ``step``; :class:`CorruptCheckpointError` when unreadable."""
    require_item(mgr, root, step, item)
    check_step(mgr, root, step, (item,))
    try:
        out = mgr.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item]
    except Exception as e:  # orbax/json raise many types for damaged files
        raise corrupt(root, step, item, mgr.all_steps(), e) from e
    if not isinstance(out, dict):
        raise corrupt(root, step, item, mgr.all_steps(), ValueError(f"expected a JSON object, got {out!r}"))
    return out


def restore_arrays(mgr, root: str, step: int, items: dict) -> dict:
    """Restore {item: abstract tree}; empty trees are returned as given (never written). Every file of
    the items is checked against the step's checksums while Orbax restores them (on a helper thread:
    xxhash lets go of the GIL, tensorstore reads on its own threads); nothing is returned unless all match."""
    want = {k: v for k, v in items.items() if not is_empty(v)}
    for k in want:
        require_item(mgr, root, step, k)
    out = {k: v for k, v in items.items() if is_empty(v)}
    if not want:
        check_step(mgr, root, step, ())
        return out
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flaxheads-checksums") as pool:
        checked = pool.submit(contextvars.copy_context().run, check_step, mgr, root, step, tuple(want))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = mgr.restore(
                    step, args=ocp.args.Composite(**{k: ocp.args.StandardRestore(v) for k, v in want.items()})
                )
        except CheckpointError:
            raise
        except Exception as e:
            checked.result()  # a damaged file explains the failure better than Orbax's message
            raise corrupt(root, step, "/".join(want), mgr.all_steps(), e) from e
        checked.result()
    out.update({k: got[k] for k in want})
    return out


def save_args(arrays: Mapping[str, Any], json_items: Mapping[str, dict]) -> ocp.args.Composite:
    """The Orbax arguments that save array items (empty trees left out) and JSON items. A quantised base
    (Qwix codes, which Orbax does not store) is refused: a frozen base is saved by its folder."""
    for k, v in arrays.items():
        if any(is_quantized(x) for x in jax.tree.leaves(v, is_leaf=is_quantized)):
            raise CheckpointError(
                f"the checkpoint's {k!r} item holds a quantised base (int8 / int4 / nf4 codes), "
                "which a checkpoint does not store: save it with save_backbone=False (as "
                "flaxheads train does for a frozen or LoRA base; a restore reads the base again "
                "from its folder and quantises it)"
            )
    items = {k: ocp.args.JsonSave(v) for k, v in json_items.items()}
    items.update({k: ocp.args.StandardSave(v) for k, v in arrays.items() if not is_empty(v)})
    return ocp.args.Composite(**items)


def item_targets(mgr, root: str, step: int, items: list[str]) -> dict:
    """Abstract trees (on the first device) of the array ``items`` of ``step``, from their metadata."""
    try:
        md = mgr.item_metadata(step)
    except Exception as e:
        raise corrupt(root, step, "metadata", mgr.all_steps(), e) from e
    dev, out = first_device(), {}
    for item in items:
        try:
            out[item] = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=dev), md[item].tree
            )
        except Exception as e:
            raise corrupt(root, step, item, mgr.all_steps(), e) from e
    return out


# ---- failed writes ------------------------------------------------------------------------------------


def write_failed(root: str, step: int | None, err: BaseException, kept: list[int]) -> CheckpointWriteError:
    """The error for a save of ``step`` under ``root`` that failed, naming what is kept."""
    where = os.path.join(root, str(step)) if step is not None else root
    keep = (
        f"the latest complete checkpoint is step {kept[-1]} ({os.path.join(root, str(kept[-1]))}), intact"
        if kept
        else "no earlier checkpoint exists"
    )
    hint = {
        os.strerror(errno.ENOSPC): "free some space",
        os.strerror(errno.EFBIG): "raise the file size limit",
        os.strerror(errno.EDQUOT): "free some quota",
        os.strerror(errno.EROFS): "use a writable disk",
    }
    cause = os_error_cause(err) or f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
    fix = hint.get(cause, "fix the disk")
    rerun = "rerun the same command to resume" if kept else "rerun the same command (it starts over)"
    return CheckpointWriteError(f"could not write checkpoint {where}: {cause}; {keep}; {fix} and {rerun}")
