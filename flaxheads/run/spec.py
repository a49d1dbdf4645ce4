""":class:`RunSpec`: one frozen, typed description of a training run.

A spec is six groups (model, data, task, optimisation, checkpoints, devices) and a seed. Every
field has the default ``flaxheads train`` has, so ``RunSpec()`` is the README's main job and
``flaxheads train FLAGS`` is ``fh.train(RunSpec.from_kwargs(**flags))``. Its JSON form is kept in
the run's ``config.json`` (key ``"spec"``): :meth:`RunSpec.from_run` gives back the spec that made a
run folder, and running it again resumes that run.

Keyword arguments reach their group by name (:meth:`RunSpec.from_kwargs`, :meth:`RunSpec.replace`):
every field name is unique across the groups. ``train=``, ``validation=`` and ``test=`` are
``train_file=``, ``validation_file=`` and ``test_file=``; these and ``data=`` take a path or an
in-memory table (:mod:`flaxheads.data.objects`), which the JSON form records by its description.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flaxheads.data.objects import DataObject, as_source, record, recorded, split_objects
from flaxheads.data.splits import SOURCE_FIELDS, TableSources
from flaxheads.errors import UsageError
from flaxheads.losses import MULTI_LABEL, REGRESSION, SINGLE_LABEL
from flaxheads.model.hub import PACKAGED_MODEL
from flaxheads.runtime.precision import PRECISION_ENV, PRECISIONS
from flaxheads.tasks.ranking.objectives import OBJECTIVES
from flaxheads.training.optim import DEFAULT_HEAD_LR, DEFAULT_LR, LORA_LR, PROBE_LR, OptimConfig
from flaxheads.training.trainer import TrainConfig

#: The problem types a classification run can be given (default: guessed from the labels).
PROBLEM_TYPES = (SINGLE_LABEL, MULTI_LABEL, REGRESSION)
#: The heads a run can put on its pooler (``token-logits``: an LLM reranker, :mod:`flaxheads.heads.token_logits`).
HEADS = ("linear", "mlp", "preset", "token-logits")
#: ``task.objective`` values other than ``classification``.
RANKING_OBJECTIVES = OBJECTIVES


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The backbone folder, the pooler and head on it, LoRA adapters and the compute precision."""

    model: str = PACKAGED_MODEL  # local Hugging Face folder, the packaged model, or a hub id in the cache
    pooler: str = "mean"  # a pooler name, names joined by commas (concatenated), or "preset"
    head: str = "linear"  # linear | mlp | preset | token-logits (an LLM reranker: heads.token_logits)
    head_hidden: tuple[int, ...] | None = None  # hidden widths of an mlp head
    precision: str | None = None  # auto | float32 | bfloat16 (None: $FLAXHEADS_PRECISION, else auto)
    base_dtype: str = "auto"  # a frozen base's storage: auto (bfloat16 if frozen and precision is) | float32 | bfloat16
    quantize: str | None = None  # a frozen base's matmul kernels in int8 | int4 | nf4 (flaxheads.model.quantize)
    remat: str = "none"  # what the backward pass keeps of each layer: none | full | save-dots | save-named
    lora_rank: int | None = None
    lora_alpha: float | None = None  # default 2 x rank
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] | None = None  # default: the backbone's attention query/value projections
    lora_from: str | None = None  # a PEFT LoRA sequence-classification adapter folder to continue


@dataclasses.dataclass(frozen=True)
class DataSpec(TableSources):
    """Where the examples come from (the fields of :class:`~flaxheads.data.splits.TableSources`),
    how they split, and how they become token batches."""

    query_column: str | None = None  # ranking tables: the query / prompt column
    negatives: int = 3  # ranking on bbc_news: passages of other classes per headline
    label_ids: bool = False  # integer labels are class ids 0..K-1, not classes by value
    labels: tuple[str, ...] | None = None  # the class names in id order (default: every label of the data)
    split: tuple[float, float, float] = (0.8, 0.1, 0.1)
    limit: int | None = None  # a stratified subset of this many examples (quick runs)
    eval_limit: int | None = None  # evaluate during training on a sample of this many validation examples
    stream: bool | None = None  # read tables as training runs (None: files over 16 MiB and globs)
    max_length: int = 128
    bucket_step: int = 32
    pack: bool | None = None  # None: packed where that saves enough and the backbone keeps texts apart


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What is learnt: classification (single-label, multi-label, regression) or a ranking objective."""

    objective: str = "classification"  # or one of RANKING_OBJECTIVES
    problem_type: str | None = None  # classification: guessed from the labels when None
    label_smoothing: float = 0.0
    threshold: float = TrainConfig.threshold  # multi-label decision threshold of the metrics
    margin: float | None = None  # pairwise / hinge
    scale: float | None = None  # listwise / listnet


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    """AdamW, its schedule, the length of the run and what trains. A default that the library's
    configs share is theirs (``TrainConfig``, ``OptimConfig``): one set of defaults."""

    epochs: float = TrainConfig.epochs
    max_steps: int | None = TrainConfig.max_steps  # overrides epochs
    batch_size: int = TrainConfig.batch_size  # global, per step (groups for a ranking objective)
    eval_batch_size: int = TrainConfig.eval_batch_size
    eval_every: int | None = TrainConfig.eval_every  # steps between validations (None: each epoch)
    log_every: int = TrainConfig.log_every
    freeze_backbone: bool = OptimConfig.freeze_backbone
    cache_features: bool = False  # frozen backbone encoded once; the head trains on the features
    sweep: int = 0  # K heads at once on cached features; the best on validation is kept
    lr: float | None = None  # None: DEFAULT_LR, PROBE_LR with a frozen backbone, LORA_LR for adapters
    head_lr: float | None = None  # None: DEFAULT_HEAD_LR when fine-tuning, else lr
    weight_decay: float = OptimConfig.weight_decay
    schedule: str = OptimConfig.schedule  # linear | cosine | constant
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0  # 0: no clipping (OptimConfig's default)
    accumulation_steps: int = OptimConfig.accumulation_steps


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """The run folder: its checkpoints, where its log goes, a profiled window of steps."""

    output_dir: str | None = None  # None: runs/<time>-<data name>
    resume: str | int = "auto"  # auto (latest checkpoint, if any) | never | a step number
    checkpoint_every: int | None = None  # None: at each evaluation and the last step; 0: the last step only
    keep: int = 3
    keep_best_by: str = "auto"  # validation/<metric>, auto (the headline metric) or none
    report_to: tuple[str, ...] | None = None  # jsonl, tensorboard, or none (None: both)
    profile_steps: str | None = None  # "A:B": a jax.profiler trace of steps A to B (both included) in <run>/profile


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """How the steps run on devices, and the processes of a multi-host run."""

    parallel: str = TrainConfig.parallel  # single | pmap | mesh
    mesh: str | None = TrainConfig.mesh  # e.g. "data=2,fsdp=4" (implies mesh)
    coordinator_address: str | None = None  # multi-host: host:port of process 0, or "auto"
    num_processes: int | None = None
    process_id: int | None = None


GROUPS: dict[str, type] = {
    "model": ModelSpec,
    "data": DataSpec,
    "task": TaskSpec,
    "optim": OptimSpec,
    "checkpoints": CheckpointSpec,
    "devices": DeviceSpec,
}
#: field name -> its group
FIELD_GROUP: dict[str, str] = {f.name: g for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}
_TUPLES = {"head_hidden", "lora_targets", "labels", "split", "report_to"}
#: The other names of settings: ``train=`` is ``train_file=`` (a path or an in-memory table).
ALIASES = {"train": "train_file", "validation": "validation_file", "test": "test_file"}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything that defines a run (see the module docstring)."""

    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    task: TaskSpec = TaskSpec()
    optim: OptimSpec = OptimSpec()
    checkpoints: CheckpointSpec = CheckpointSpec()
    devices: DeviceSpec = DeviceSpec()
    seed: int = TrainConfig.seed  # data split, order, init and dropout

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> RunSpec:
        """A spec from flat keyword arguments (``model=..., epochs=3, output_dir=...``)."""
        return cls().replace(**kwargs)

    def replace(self, **kwargs: Any) -> RunSpec:
        """A copy with the named fields changed (flat names, each routed to its group)."""
        groups: dict[str, dict] = {}
        top = {}
        for name, value in _sources(kwargs).items():
            if name == "seed":
                top["seed"] = value
                continue
            group = FIELD_GROUP.get(name)
            if group is None:
                raise UsageError(
                    f"{name!r} is not a run setting; the settings are: seed, "
                    + ", ".join(sorted([*FIELD_GROUP, *ALIASES]))
                )
            if name == "report_to" and isinstance(value, str):  # "tensorboard,jsonl", as the flag spells it
                value = tuple(v.strip() for v in value.split(",") if v.strip())
            groups.setdefault(group, {})[name] = (
                tuple(value) if name in _TUPLES and value is not None and not isinstance(value, str) else value
            )
        return dataclasses.replace(
            self, **top, **{g: dataclasses.replace(getattr(self, g), **v) for g, v in groups.items()}
        )

    def flat(self) -> dict[str, Any]:
        """Every field by its flat name (what :meth:`from_kwargs` takes)."""
        out = {name: getattr(getattr(self, g), name) for name, g in FIELD_GROUP.items()}
        return {**out, "seed": self.seed}

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``{"model": {...}, ..., "seed": 0}``; an in-memory table is its description."""
        out: dict[str, Any] = {
            g: {f.name: record(getattr(getattr(self, g), f.name)) for f in dataclasses.fields(cls)}
            for g, cls in GROUPS.items()
        }
        return json.loads(json.dumps({**out, "seed": self.seed}))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunSpec:
        """The spec of :meth:`to_dict` (unknown keys are refused by name)."""
        if not isinstance(d, Mapping):
            raise UsageError(
                f"a run spec is a JSON object of groups {', '.join(GROUPS)} and seed; got {type(d).__name__}"
            )
        flat: dict[str, Any] = {}
        for key, value in d.items():
            if key == "seed":
                flat["seed"] = value
            elif key in GROUPS and isinstance(value, Mapping):
                known = {f.name for f in dataclasses.fields(GROUPS[key])}
                bad = sorted(set(value) - known)
                if bad:
                    raise UsageError(
                        f"run spec group {key!r} has no setting {bad[0]!r}; it has {', '.join(sorted(known))}"
                    )
                flat.update({k: recorded(v, _given_as(k)) if k in SOURCE_FIELDS else v for k, v in value.items()})
            else:
                raise UsageError(f"run spec key {key!r} is not one of {', '.join(GROUPS)}, seed")
        return cls.from_kwargs(**flat)

    @classmethod
    def from_run(cls, run_dir: str | os.PathLike) -> RunSpec:
        """The spec that made the run folder ``run_dir`` (its ``config.json``); running it resumes the run."""
        path = Path(run_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise UsageError(f"{run_dir} has no config.json: not a flaxheads run folder") from None
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} is not valid JSON ({e}); the run folder is damaged") from None
        if not isinstance(cfg, dict) or "spec" not in cfg:
            raise UsageError(
                f"{path} records no run spec: the run was made by an older flaxheads; start it again "
                "with the same settings"
            )
        return cls.from_dict(cfg["spec"])

    @property
    def needs_data(self) -> dict[str, dict]:
        """The in-memory tables this spec trains on but does not hold (a spec read from a run folder):
        keyword (``data``, ``train``, ...) -> the description the folder recorded. Pass each again:
        ``fh.train(spec, data=frame)``."""
        return {v.given_as: v.description for v in self.data_objects.values() if v.missing}

    @property
    def data_objects(self) -> dict[str, DataObject]:
        """The in-memory tables the run reads, by field (``data`` only when no ``train_file`` replaces it)."""
        d = self.data
        used = [k for k in SOURCE_FIELDS if k != "data" or not d.train_file]
        return {k: v for k in used if isinstance(v := getattr(d, k), DataObject)}

    @property
    def ranking(self) -> bool:
        return self.task.objective != "classification"

    def run_folder(self) -> Path:
        """``output_dir``, or ``runs/<time>-<data name>[-<ranking objective>]``."""
        d = self.data
        source = d.train_file or d.data
        name = source.stem if isinstance(source, DataObject) else Path(str(source)).stem
        stem = name + (f"-{self.task.objective}" if self.ranking else "")
        return Path(self.checkpoints.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{stem}")

    @property
    def cached(self) -> bool:
        """Heads trained on features encoded once (``cache_features`` or ``sweep``)."""
        return bool(self.optim.cache_features or self.optim.sweep)

    @property
    def trains_adapters(self) -> bool:
        return self.model.lora_rank is not None or self.model.lora_from is not None

    @property
    def frozen(self) -> bool:
        """The backbone does not train (frozen or cached); LoRA runs train their adapters."""
        return self.optim.freeze_backbone or self.cached

    @property
    def base_frozen(self) -> bool:
        """The base's own weights do not train (frozen, cached, or LoRA adapters train instead)."""
        return self.frozen or self.trains_adapters

    @property
    def learning_rates(self) -> tuple[float, float]:
        """The peak rates of the backbone (or its adapters) and of the head: ``lr`` / ``head_lr`` as
        given, else ``flaxheads.training.optim``'s for what trains (adapters, a probe, a fine-tune)."""
        o, frozen = self.optim, self.frozen
        lr = o.lr if o.lr is not None else LORA_LR if self.trains_adapters else PROBE_LR if frozen else DEFAULT_LR
        return lr, o.head_lr if o.head_lr is not None else (lr if frozen else DEFAULT_HEAD_LR)

    @property
    def parallel_mode(self) -> str:
        d = self.devices
        return "mesh" if d.coordinator_address is not None or d.mesh else d.parallel


def _given_as(field: str) -> str:
    """The keyword an in-memory source is given as (``train`` for ``train_file``)."""
    return {v: k for k, v in ALIASES.items()}.get(field, field)


def _sources(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with aliases under their field's name, data sources as a spec holds them, and a
    ``DatasetDict`` given as ``data=`` spread over ``train_file`` / ``validation_file`` / ``test_file``."""
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        field = ALIASES.get(name, name)
        if field in out:
            raise UsageError(f"{_given_as(field)}= and {field}= are one setting: give one of them")
        if field == "data" and (splits := split_objects(value)) is not None:
            if any(k in kwargs for k in (*ALIASES, *ALIASES.values())):
                raise UsageError(
                    "data= got a dict of splits, which sets train=, validation= and test=: give one or the other"
                )
            out["data"] = None
            for split, obj in splits.items():
                out[f"{split}_file"] = as_source(obj, split)
            continue
        if field in SOURCE_FIELDS:
            value = as_source(value, _given_as(field))
        elif isinstance(value, os.PathLike):  # a pathlib.Path for model=, output_dir=, ...: the spec holds text
            value = os.fspath(value)
        out[field] = value
    return out


def settle_precision(name: str | None) -> str:
    """``precision``: as given, else ``$FLAXHEADS_PRECISION``, else ``auto``."""
    if name is None:
        name = os.environ.get(PRECISION_ENV, "").strip() or "auto"
        if name not in PRECISIONS:
            raise UsageError(
                f"${PRECISION_ENV}={name!r} is not a precision: expected one of {', '.join(PRECISIONS)} (or unset it)"
            )
    elif name not in PRECISIONS:
        raise UsageError(f"precision {name!r} is not one of {', '.join(PRECISIONS)}")
    return name
