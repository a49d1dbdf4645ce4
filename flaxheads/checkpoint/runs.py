"""Checkpoints of a training run: every piece of a train state saved, kept by recency and by a
metric, and restored into the structure (and sharding) of a target state."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from flaxheads.checkpoint import io
from flaxheads.checkpoint.kinds import without_checkpoint
from flaxheads.checkpoint.meta import (
    BACKBONE,
    CHECKPOINTS_SUBDIR,
    EXTRA,
    HEAD,
    LORA,
    META,
    OPT_STATE,
    STEP,
    CheckpointError,
    CheckpointNotFoundError,
    backbone_checksum,
    check_format,
    check_resumable,
    make_meta,
)
from flaxheads.model.sequence import SequenceModel


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
        return {
            f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.metadata.get("pytree_node", True)
        }
    if hasattr(state, "_asdict"):
        return dict(state._asdict())
    raise TypeError(
        f"train state must be a mapping, dataclass or namedtuple with step/params/opt_state; got {type(state).__name__}"
    )


def _split_state(state) -> tuple[dict, Any, dict]:
    """(params, opt_state, the other array fields but ``step``) of a train state."""
    fields = _state_fields(state)
    params, opt_state = fields.pop("params"), fields.pop("opt_state")
    fields.pop("step", None)
    return params, opt_state, fields


def _replace_fields(state, values: dict):
    if isinstance(state, Mapping):
        return {**state, **values}
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        if hasattr(state, "replace"):
            return state.replace(**values)
        return dataclasses.replace(state, **values)
    return state._replace(**values)


def _restored_step(old, saved: int, sharding: jax.sharding.Sharding | None):
    """The saved step number in the form of the target's ``step`` field (array or int)."""
    if not hasattr(old, "dtype"):
        return int(saved)
    value = jnp.asarray(saved, dtype=old.dtype)
    where_to = sharding or getattr(old, "sharding", None)
    return value if where_to is None else jax.device_put(value, where_to)


class RunCheckpointer:
    """Checkpoints of one training run under ``<run_dir>/checkpoints``.

    ``state`` is any train state with ``step``, ``params`` (``{"backbone", "head"}``, plus ``"lora"``
    for a model with adapters, saved as the ``lora`` item) and
    ``opt_state`` (a mapping, dataclass or namedtuple); other array fields (rng keys, ...)
    go to the ``extra`` item. ``save_backbone=False`` (a frozen backbone) stores only the
    head; the backbone is then taken from the target state on restore.

    Retention: the ``keep`` most recent steps, plus the ``keep_best`` best by
    ``metrics[best_metric]`` (``mode`` "max" or "min") when ``best_metric`` is set."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        model: SequenceModel | None = None,
        *,
        keep: int | None = 3,
        best_metric: str | None = None,
        mode: str = "max",
        keep_best: int = 1,
        save_backbone: bool = True,
        async_save: bool = True,
        read_only: bool = False,
        extra_meta: Mapping[str, Any] | None = None,
    ):
        if mode not in ("max", "min"):
            raise CheckpointError(f"mode must be 'max' or 'min', got {mode!r}")
        if keep is not None and keep < 1:
            raise CheckpointError(f"keep must be >= 1 (or None for all), got {keep}")
        self.run_dir = os.path.abspath(os.fspath(run_dir))
        self.root = os.path.join(self.run_dir, CHECKPOINTS_SUBDIR)
        self.model, self.best_metric, self.mode = model, best_metric, mode
        self.save_backbone = save_backbone
        self.extra_meta = dict(extra_meta or {})
        self._checksum: float | None = None
        self._pending: int | None = None  # the step of the asynchronous save in flight
        if read_only and not os.path.isdir(self.root):
            raise CheckpointNotFoundError(without_checkpoint(self.run_dir))
        best_fn = None if best_metric is None else _metric_getter(best_metric)
        self._mgr = io.manager(
            self.root,
            read_only=read_only,
            async_save=async_save,
            preservation=io.retention(keep, best_fn, mode, keep_best),
            best_fn=best_fn,
            best_mode=mode,
        )

    # context manager: always wait for the last async save
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        try:
            self.wait_until_finished()
        finally:
            with io.quiet():
                try:
                    self._mgr.close()
                except Exception:  # the failed save is already reported; closing adds nothing
                    pass

    def wait_until_finished(self) -> None:
        """Wait for the save in flight; :class:`CheckpointWriteError` if it failed."""
        with self._writing(self._pending):
            self._mgr.wait_until_finished()
            self._seal()

    def _seal(self) -> None:
        """Record the checksums of the save that just finished (inside :meth:`_writing`: a disk that
        refuses them fails that step's save)."""
        if self._pending is not None:
            io.seal_step(self.root, self._pending)
        self._pending = None

    @contextlib.contextmanager
    def _writing(self, step: int | None):
        """Turn a failed write of ``step`` (Orbax, tensorstore or the OS, raised here or by the
        background save) into one :class:`CheckpointWriteError`."""
        try:
            with io.quiet():
                yield
        except CheckpointError:
            raise
        except Exception as e:
            self._pending = None
            io.drop_unawaited_writes()
            step = self._pending_failed(step, e)
            raise io.write_failed(self.root, step, e, self.all_steps()) from e

    def _pending_failed(self, step: int | None, err: Exception) -> int | None:
        """The step whose save failed: the one in flight (its error comes out of the next call) or ``step``."""
        m = re.search(r"checkpoints/(\d+)\.orbax-checkpoint-tmp", str(err))
        return int(m.group(1)) if m else step

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

    def _meta(self, params: dict) -> dict:
        if self.model is None:
            raise CheckpointError(
                "RunCheckpointer needs model= (the SequenceModel being trained) to write the "
                "checkpoint's meta; pass RunCheckpointer(run_dir, model, ...)"
            )
        extra = dict(self.extra_meta)
        if not self.save_backbone:
            if self._checksum is None:  # frozen: the same for every step of the run
                self._checksum = backbone_checksum(params["backbone"])
            extra["backbone_checksum"] = self._checksum
        return make_meta(self.model, params["head"], backbone_saved=self.save_backbone, extra=extra)

    def save(self, step: int, state, metrics: Mapping[str, float] | None = None, *, force: bool = True) -> bool:
        """Start an asynchronous, atomic save of ``state`` as ``step``; returns at once after the
        arrays are copied. The previous save is waited for first (Orbax)."""
        params, opt_state, fields = _split_state(state)
        metrics = None if metrics is None else {k: float(v) for k, v in metrics.items()}
        if self.best_metric is not None and metrics is not None and self.best_metric not in metrics:
            raise KeyError(f"best_metric {self.best_metric!r} is not among the metrics {sorted(metrics)}")
        info = {"step": int(step), "metrics": metrics, "best_metric": self.best_metric, "mode": self.mode}
        arrays = {
            HEAD: params["head"],
            OPT_STATE: opt_state,
            EXTRA: io.keys_to_data(fields),
            BACKBONE: params["backbone"] if self.save_backbone else {},
            LORA: params.get(LORA, {}),
        }
        args = io.save_args(arrays, {META: self._meta(params), STEP: info})
        with self._writing(self._pending if self._pending is not None else int(step)):
            self._mgr.wait_until_finished()  # a failure of the save in flight is reported as that step's
            self._seal()
        with self._writing(int(step)):
            saved = self._mgr.save(int(step), args=args, metrics=metrics, force=force)
        self._pending = int(step) if saved else None
        return saved

    def read_meta(self, step: int | None = None) -> dict:
        self._mgr.wait_until_finished()  # a step still being written is not readable yet
        step = io.pick_step(self._mgr, self.root, step)
        return io.read_json(self._mgr, self.root, step, META)

    def restore(self, step: int | str | None = None, *, target_state, sharding: jax.sharding.Sharding | None = None):
        """The state saved at ``step`` (default: latest; or ``"best"``), in the structure of
        ``target_state``. Arrays go to ``sharding`` when given (a mesh ``NamedSharding`` or one
        device), else to each target leaf's own sharding. A frozen backbone (not saved) is
        taken from ``target_state``."""
        self._mgr.wait_until_finished()  # a step still being written is not readable yet
        step = io.pick_step(self._mgr, self.root, step)
        where = os.path.join(self.root, str(step))
        meta = io.read_json(self._mgr, self.root, step, META)
        check_format(meta, where)
        params, opt_state, fields = _split_state(target_state)
        check_resumable(meta, where, params, self.model)
        items = {
            HEAD: io.abstract(params["head"], sharding),
            OPT_STATE: io.abstract(opt_state, sharding),
            EXTRA: io.abstract_state(fields, sharding),
        }
        if meta.get("backbone_saved"):
            items[BACKBONE] = io.abstract(params["backbone"], sharding)
        if LORA in params:  # check_resumable made sure the checkpoint has the same adapters
            items[LORA] = io.abstract(params[LORA], sharding)
        got = io.restore_arrays(self._mgr, self.root, step, items)
        step_info = io.read_json(self._mgr, self.root, step, STEP)
        backbone = got.get(BACKBONE)
        if backbone is None:
            backbone = params["backbone"] if sharding is None else jax.device_put(params["backbone"], sharding)
        restored = {"backbone": backbone, "head": got[HEAD], **({LORA: got[LORA]} if LORA in got else {})}
        values = {"params": restored, "opt_state": got[OPT_STATE], **io.data_to_keys(got[EXTRA], fields)}
        old = _state_fields(target_state)
        if "step" in old:
            values["step"] = _restored_step(old["step"], step_info["step"], sharding)
        return _replace_fields(target_state, values)
