"""A :class:`~flaxheads.run.spec.RunSpec` checked before any work: settings that conflict or name
nothing are refused in one line. Settings are named as the ``flaxheads train`` flags spell them
(``--sweep`` is ``sweep=``), one spelling for the command and the library."""

from __future__ import annotations

import math
import os

from flaxheads.data.objects import DataObject, missing_message
from flaxheads.data.splits import SOURCE_FIELDS
from flaxheads.errors import TrainingError, UsageError
from flaxheads.heads.poolers import POOLER_NAMES
from flaxheads.layers.remat import REMAT_POLICIES
from flaxheads.model.base_dtype import BASE_DTYPES
from flaxheads.model.quantize import QUANTIZATIONS
from flaxheads.run.spec import HEADS, PROBLEM_TYPES, RunSpec, settle_precision
from flaxheads.runtime.sharding import parse_mesh
from flaxheads.tasks.ranking.objectives import MARGIN_OBJECTIVES, OBJECTIVES
from flaxheads.tasks.ranking.task import SCALE_OBJECTIVES, Ranking
from flaxheads.training.profiling import parse_steps


def check_spec(spec: RunSpec) -> RunSpec:
    """``spec`` with its precision settled (``$FLAXHEADS_PRECISION``, else auto); raises
    :class:`~flaxheads.errors.UsageError` on the first conflict (``report_to``: when the job resolves it)."""
    _check_values(spec)
    _check_model(spec)
    spec = _check_sources(spec)
    if (spec.data.validation_file or spec.data.test_file) and not spec.data.train_file:
        raise UsageError("--validation-file/--test-file need --train-file (or give one --data file and --split)")
    o, d = spec.optim, spec.devices
    if spec.cached and (d.parallel != "single" or d.mesh or o.accumulation_steps != 1):
        raise UsageError(
            "--cache-features/--sweep run on one device without gradient accumulation "
            "(drop --parallel/--mesh/--accumulation-steps)"
        )
    if d.mesh and d.parallel == "pmap":
        raise UsageError(f"--mesh {d.mesh} runs jit over a device mesh; it cannot be combined with --parallel pmap")
    if d.mesh:
        try:
            parse_mesh(d.mesh)
        except TrainingError as e:
            raise UsageError(f"--mesh: {e}") from None
    _check_profile(spec)
    _check_lora(spec)
    _check_distributed(spec)
    if spec.ranking:
        _check_ranking(spec)
    return spec.replace(precision=settle_precision(spec.model.precision))


def _check_sources(spec: RunSpec) -> RunSpec:
    """In-memory tables are there (a spec read from a run folder holds only their descriptions), each
    to be described afresh by this run (it may have changed since the spec was made)."""
    raw = {k: v for k in SOURCE_FIELDS if not isinstance(v := getattr(spec.data, k), (str, os.PathLike, DataObject))}
    if any(v is not None for v in raw.values()):  # a DataSpec made directly holds the tables themselves
        spec = spec.replace(**{k: v for k, v in raw.items() if v is not None})
    objects = spec.data_objects
    missing = {v.given_as: v for v in objects.values() if v.missing}
    if missing:
        raise UsageError(missing_message(missing))
    return spec.replace(**{k: v.fresh() for k, v in objects.items()}) if objects else spec


def _check_profile(spec: RunSpec) -> None:
    """``profile_steps`` is ``A:B``, on a run that has steps to profile."""
    c = spec.checkpoints
    if c.profile_steps is not None:
        if spec.cached:
            raise UsageError(
                "--profile-steps profiles fine-tuning steps; heads on cached features "
                "(--cache-features/--sweep) have none: drop one of them"
            )
        parse_steps(c.profile_steps)


def _check_values(spec: RunSpec) -> None:
    """Single values the command's parser checks as it reads them, checked again for Python callers."""
    o, d = spec.optim, spec.data
    positive = {
        "batch_size": o.batch_size,
        "eval_batch_size": o.eval_batch_size,
        "log_every": o.log_every,
        "accumulation_steps": o.accumulation_steps,
        "max_length": d.max_length,
        "bucket_step": d.bucket_step,
        "keep": spec.checkpoints.keep,
        "negatives": d.negatives,
    }
    for name, v in {
        **positive,
        "max_steps": o.max_steps,
        "eval_every": o.eval_every,
        "limit": d.limit,
        "eval_limit": d.eval_limit,
    }.items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise UsageError(f"{name} must be a positive integer, got {v!r}")
    if not (isinstance(o.epochs, (int, float)) and math.isfinite(o.epochs) and o.epochs > 0):
        raise UsageError(f"epochs must be a number > 0, got {o.epochs!r}")
    if len(d.split) != 3 or min(d.split) < 0 or d.split[0] <= 0 or abs(sum(d.split) - 1) > 1e-6:
        raise UsageError(
            f"split {d.split}: expected three fractions train,validation,test with a train fraction > 0 that sum to 1"
        )
    if spec.task.problem_type is not None and spec.task.problem_type not in PROBLEM_TYPES:
        raise UsageError(f"problem_type {spec.task.problem_type!r} is not one of {', '.join(PROBLEM_TYPES)}")
    if spec.task.objective not in ("classification", *OBJECTIVES):
        raise UsageError(f"objective {spec.task.objective!r} is not one of classification, {', '.join(OBJECTIVES)}")
    r = spec.checkpoints.resume
    if not (r in ("auto", "never") or (isinstance(r, int) and not isinstance(r, bool) and r >= 0)):
        raise UsageError(f"resume {r!r}: expected auto, never or a step number")
    if spec.devices.parallel not in ("single", "pmap", "mesh"):
        raise UsageError(f"parallel {spec.devices.parallel!r} is not one of single, pmap, mesh")


def _check_model(spec: RunSpec) -> None:
    m = spec.model
    if m.pooler != "preset":
        bad = [p for p in m.pooler.split(",") if p not in POOLER_NAMES]
        if bad:
            raise UsageError(
                f"--pooler {m.pooler!r}: unknown pooler {bad[0]!r}; valid poolers: "
                f"{', '.join(sorted(POOLER_NAMES))}, `preset`, or several names joined by commas"
            )
    if m.head not in HEADS:
        raise UsageError(f"--head {m.head!r} is not one of {', '.join(HEADS)}")
    if m.head == "token-logits" and (not spec.ranking or m.pooler not in ("mean", "preset")):
        raise UsageError(
            "--head token-logits scores (query, document) pairs from the LM head at the last token: train it "
            "with a ranking --objective, and leave --pooler out (it takes the preset's last token)"
        )
    if m.head_hidden and m.head != "mlp":
        raise UsageError(f"--head-hidden sets the widths of an MLP head; it needs --head mlp (got --head {m.head})")
    if m.remat not in REMAT_POLICIES:
        raise UsageError(f"--remat {m.remat!r} is not one of {', '.join(REMAT_POLICIES)}")
    if m.base_dtype not in BASE_DTYPES:
        raise UsageError(f"--base-dtype {m.base_dtype!r} is not one of {', '.join(BASE_DTYPES)}")
    if m.quantize is not None and (m.quantize not in QUANTIZATIONS or not spec.base_frozen):
        raise UsageError(
            f"--quantize {m.quantize}: expected one of {', '.join(QUANTIZATIONS)} on a base that does not "
            "train: add --lora-rank (QLoRA) or --freeze-backbone"
        )
    if m.base_dtype == "bfloat16" and not spec.base_frozen:
        raise UsageError(
            "--base-dtype bfloat16 stores a base that does not train; this run fine-tunes the backbone, "
            "whose small updates would round away in bfloat16: add --freeze-backbone, "
            "--cache-features or --lora-rank, or drop --base-dtype"
        )


def _check_lora(spec: RunSpec) -> None:
    """LoRA settings need a rank (or an adapter folder) and a backbone that runs forward with them."""
    m = spec.model
    if m.lora_from is not None:
        given = [
            f
            for f, v in (
                ("--lora-rank", m.lora_rank),
                ("--lora-alpha", m.lora_alpha),
                ("--lora-targets", m.lora_targets),
            )
            if v is not None
        ]
        if given:
            raise UsageError(
                f"{given[0]} cannot be combined with --lora-from: the adapter folder sets its rank, alpha and targets"
            )
        if not os.path.isdir(m.lora_from):
            raise UsageError(
                f"--lora-from {m.lora_from!r} is not a folder (expected a PEFT adapter folder with adapter_config.json)"
            )
        if not os.path.isfile(os.path.join(m.lora_from, "adapter_config.json")):
            raise UsageError(f"--lora-from {m.lora_from}: no adapter_config.json; expected a PEFT adapter folder")
    if not spec.trains_adapters:
        given = [
            f
            for f, v in (
                ("--lora-alpha", m.lora_alpha),
                ("--lora-targets", m.lora_targets),
                ("--lora-dropout", m.lora_dropout or None),
            )
            if v is not None
        ]
        if given:
            raise UsageError(f"{given[0]} sets up LoRA adapters; it needs --lora-rank (e.g. --lora-rank 8)")
        return
    if spec.optim.freeze_backbone or spec.cached:
        flag = "--lora-rank" if m.lora_rank is not None else "--lora-from"
        raise UsageError(
            f"{flag} trains adapters inside the backbone; it cannot run with --freeze-backbone, "
            "--cache-features or --sweep (which train the head alone on fixed features)"
        )


def _check_distributed(spec: RunSpec) -> None:
    d = spec.devices
    procs = (d.num_processes, d.process_id)
    if d.coordinator_address is None:
        if procs != (None, None):
            raise UsageError("--num-processes/--process-id need --coordinator-address (multi-host runs)")
        return
    if d.parallel == "pmap":
        raise UsageError("multi-host runs (--coordinator-address) use --parallel mesh, not pmap")
    if d.coordinator_address != "auto":
        num_processes, process_id = procs
        if num_processes is None or process_id is None:
            raise UsageError(
                "--coordinator-address needs --num-processes and --process-id (or `auto` on a cluster JAX can discover)"
            )
        if process_id >= num_processes:
            raise UsageError(
                f"--process-id {d.process_id} is not below --num-processes {d.num_processes}: "
                "processes are numbered 0..N-1"
            )
    if spec.checkpoints.output_dir is None:
        raise UsageError("multi-host runs need --output-dir: every process must name the same run folder")


def _check_ranking(spec: RunSpec) -> None:
    """The task refuses, in one line, what means nothing for a one-score ranker trained on groups."""
    t, flat = spec.task, spec.flat()
    bad = [name for name in Ranking.refuses if flat[name]]
    if bad:
        raise UsageError(
            f"--{bad[0].replace('_', '-')} does not apply to --objective {t.objective} (a one-score "
            "ranker trained on groups): drop it"
        )
    if t.margin is not None and t.objective not in MARGIN_OBJECTIVES:
        raise UsageError(f"--margin applies to --objective {' or '.join(MARGIN_OBJECTIVES)}, not {t.objective}")
    if t.scale is not None and t.objective not in SCALE_OBJECTIVES:
        raise UsageError(f"--scale applies to --objective {' or '.join(SCALE_OBJECTIVES)}, not {t.objective}")
