"""A memory plan before the run: what one device will hold while training, and which devices fit it.

:func:`plan_memory` sizes a run from a model folder's ``config.json`` alone: the params are
``jax.eval_shape`` shapes (:func:`abstract_model`; no weight file is opened), the real train step
(:func:`~flaxheads.training.steps.make_train_step`, the run's optimizer, LoRA, base dtype, remat
and mesh) is lowered on ``ShapeDtypeStruct`` arguments carrying their shardings and compiled, and
XLA's own memory analysis of that program gives the activations and workspace
(:func:`~flaxheads.training.memory.memory_report`). Params, adapters and optimizer state per device
come from their shapes and shardings. So a 70B run can be planned on a laptop: a mesh of ``n``
devices needs ``n`` devices in the process, which on a CPU-only host are forced host devices
(``flaxheads plan`` arranges that itself).

The plan is for the backend that compiles it: on a CPU host it is XLA:CPU's program, whose buffer
assignment is close to, but not the same as, a GPU's or TPU's (docs/performance.md has the
comparison with measured peaks).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from flaxheads.errors import UsageError
from flaxheads.losses import MULTI_LABEL, REGRESSION
from flaxheads.model.abstract import abstract_model
from flaxheads.model.base_dtype import resolve_base_dtype
from flaxheads.model.lora import LORA, LoraConfig
from flaxheads.runtime.parallel import Parallel
from flaxheads.runtime.plan import ComputePlan
from flaxheads.runtime.sharding import parse_mesh, shard_bytes
from flaxheads.training.loop import TrainConfig, Trainer
from flaxheads.training.memory import memory_report
from flaxheads.training.optim import OptimConfig

#: Device memory in bytes of the devices a plan is checked against (the vendors' figures; an
#: accelerator's usable memory is a little less: the runtime and its libraries take some).
DEVICES: Mapping[str, int] = {
    "H100 80GB": 80 * 10**9,
    "H200 141GB": 141 * 10**9,
    "B200 192GB": 192 * 10**9,
    "A100 40GB": 40 * 10**9,
    "A100 80GB": 80 * 10**9,
    "L4 24GB": 24 * 10**9,
    "RTX 4090 24GB": 24 * 10**9,
    "TPU v5e 16GB": 16 * 2**30,
    "TPU v5p 95GB": 95 * 2**30,
    "TPU v6e 32GB": 32 * 2**30,
}
#: Share of a device's memory a plan may fill and still be said to fit (runtime, fragmentation).
FIT_SHARE = 0.9


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of one train step. ``peak``: XLA's arguments + outputs + temporaries less the
    outputs written over donated arguments (None where the backend reports no analysis)."""

    model: str
    layout: str
    batch: tuple[int, int]
    base: int  # the backbone's params (frozen or trained)
    adapters: int  # LoRA adapters
    head: int
    opt_state: int
    activations: int | None  # XLA's temporaries: activations, gradients, workspace
    peak: int | None
    backend: str
    notes: tuple[str, ...] = ()
    unknown: str | None = None  # why the activations are not estimated (None: they are)

    @property
    def state(self) -> int:
        return self.base + self.adapters + self.head + self.opt_state

    @property
    def total(self) -> int:
        """The plan's bytes per device: XLA's peak, else the state alone."""
        return self.peak if self.peak is not None else self.state

    def fits(self, devices: Mapping[str, int] | None = None) -> dict[str, bool]:
        """``{device: fits}``: the plan within :data:`FIT_SHARE` of each device's memory."""
        return {name: self.total <= FIT_SHARE * size for name, size in (devices or DEVICES).items()}

    def lines(self, devices: Mapping[str, int] | None = None) -> list[str]:
        """The plan as printed by ``flaxheads plan`` and at the start of ``flaxheads train``."""
        b, t = self.batch
        out = [
            f"memory plan per device ({self.model}, {self.layout}, batch {b} x {t}, "
            f"{'compiled for' if self.activations is not None else 'on'} {self.backend}):",
            f"  base {gib(self.base)}, adapters {gib(self.adapters)}, head {gib(self.head)}, "
            f"optimizer state {gib(self.opt_state)}",
        ]
        if self.activations is None or self.peak is None:
            # no figure to judge a device by: the state alone would say every device fits
            out.append(
                f"  activation memory and the peak not estimated: {self.unknown or 'XLA reported no buffer sizes'}; "
                f"the state alone is {gib(self.state)}"
            )
        else:
            out.append(f"  activations and workspace {gib(self.activations)}, peak {gib(self.peak)}")
            fit = self.fits(devices)
            out.append(
                "  fits: "
                + (", ".join(n for n, ok in fit.items() if ok) or "none of the listed devices")
                + ("; too big for: " + ", ".join(n for n, ok in fit.items() if not ok) if not all(fit.values()) else "")
            )
        out += [f"  note: {n}" for n in self.notes]
        return out

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total, "fits": self.fits()}


def gib(n: int | None) -> str:
    """Bytes as GiB (MiB below 16 MiB); ``not estimated`` for None."""
    return "not estimated" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**24 else f"{n / 2**20:.2f} MiB"


def plan_memory(
    model,
    *,
    batch_size: int,
    max_length: int,
    mesh: str | Mapping[str, int] | None = None,
    lora: LoraConfig | None = None,
    base_dtype: str = "auto",
    precision: str = "float32",
    remat: bool | str = False,
    freeze_backbone: bool = False,
    quantize: str | None = None,
    num_labels: int | None = None,
    compile: bool = True,
) -> MemoryPlan:
    """The per-device memory of training ``model`` (a folder with a ``config.json``, weights not
    needed, or a :class:`~flaxheads.model.sequence.SequenceModel`) on batches of ``batch_size`` x
    ``max_length`` tokens over ``mesh`` (``"fsdp=8"``; None: one device). ``lora``, ``base_dtype``
    (``auto | float32 | bfloat16``), ``precision`` (the compute dtype), ``remat``, ``quantize``
    (``int8 | int4 | nf4``) and ``freeze_backbone`` are the run's settings."""
    if batch_size < 1 or max_length < 1:
        raise UsageError(f"a plan needs a batch size and a length >= 1, got {batch_size} x {max_length}")
    notes = []
    folder: str | os.PathLike | None = None
    build: dict[str, Any] = {}  # abstract_model's settings (a folder's model is built here)
    if isinstance(model, (str, os.PathLike)):
        folder = model
        if precision not in ("float32", "bfloat16"):  # auto: this host's choice
            precision = jnp.dtype(ComputePlan.for_host(precision=precision).precision.dtype).name
        dtype = jnp.dtype(precision)
        frozen = freeze_backbone or lora is not None
        stored = resolve_base_dtype(base_dtype, frozen=frozen, compute_dtype=dtype)
        if quantize is not None and not frozen:
            raise UsageError("a quantised base cannot be fine-tuned: add LoRA adapters (--lora) or freeze it")
        build = dict(
            num_labels=num_labels,
            dtype=dtype,
            remat=remat,
            lora=lora,
            base_dtype=stored,
            quantize=quantize,
            plan=ComputePlan.for_host(precision=precision),
        )
        model = abstract_model(folder, **build)
    devices = _mesh_devices(mesh)
    if devices > jax.device_count():
        raise UsageError(
            f"mesh {mesh} needs {devices} devices but this process has {jax.device_count()} "
            f"({jax.default_backend()}); plan it with `flaxheads plan` (which forces {devices} host "
            f"devices), or start Python with XLA_FLAGS=--xla_force_host_platform_device_count={devices} "
            "JAX_PLATFORMS=cpu"
        )
    mesh_text = mesh if mesh is None or isinstance(mesh, str) else ",".join(f"{a}={s}" for a, s in mesh.items())
    cfg = TrainConfig(batch_size=batch_size, parallel="mesh" if mesh else "single", mesh=mesh_text or None)
    trainer = Trainer.build(
        model, OptimConfig(freeze_backbone=freeze_backbone), cfg, Parallel.from_config(cfg.parallel, cfg.mesh)
    )
    if batch_size % trainer.parallel.width:
        raise UsageError(
            f"batch size {batch_size} does not split over the mesh's {trainer.parallel.width} "
            "data-parallel devices: make it a multiple of them"
        )
    batch = plan_batch(model, batch_size, max_length)
    layers = int(getattr(model.backbone.config, "num_hidden_layers", 0) or 0)
    if compile and folder is not None and layers > EXTRAPOLATE_ABOVE:
        report = _extrapolated(
            memory_report(trainer, batch, compile=False),
            folder,
            build,
            layers,
            lambda m: _report(m, cfg, freeze_backbone, batch),
        )
        notes.append(f"XLA's figures compiled at 2 and 3 of the {layers} layers and extended linearly")
    else:
        report = memory_report(trainer, batch, compile=compile)
    return plan_of(trainer, report, batch_size, max_length, notes, compiled=compile)


def plan_of(
    trainer, report, batch_size: int, max_length: int, notes: Sequence[str] = (), *, compiled: bool = True
) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``trainer``'s step from its :func:`~flaxheads.training.memory.memory_report`
    (``compiled``: whether the report compiled the step; else the plan says so where it has no
    activations)."""
    model, par = trainer.model, trainer.parallel
    params = trainer.abstract_state().params
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = par.shardings(params) if par.mode == "mesh" else jax.tree.map(lambda _: one, params)
    part = {k: shard_bytes(params[k], shardings[k]) if k in params else 0 for k in ("backbone", LORA, "head")}
    backend = jax.default_backend()
    unknown = None
    if report.xla_arguments is None:
        unknown = (
            f"XLA:{backend.upper()} reports no buffer sizes for the compiled step"
            if compiled
            else "the train step was not compiled for the plan (a second compile; `flaxheads plan` makes it)"
        )
    return MemoryPlan(
        model=os.path.basename(model.name_or_path.rstrip("/")) or model.model_type,
        layout=report.layout,
        batch=(batch_size, max_length),
        base=part["backbone"],
        adapters=part[LORA],
        head=part["head"],
        opt_state=report.opt_state,
        activations=report.xla_temp,
        peak=report.xla_total,
        backend=backend,
        notes=tuple(notes),
        unknown=unknown,
    )


def lora_from_flags(rank: int | None, alpha: float | None = None, targets=None) -> LoraConfig | None:
    """The adapters ``--lora-rank`` / ``--lora-alpha`` (default 2 x rank) / ``--lora-targets`` name (None: no LoRA)."""
    return None if rank is None else LoraConfig(rank=rank, alpha=alpha or 2.0 * rank, targets=targets)


#: Deeper models are compiled at 2 and 3 layers and XLA's figures extended linearly to all of them
#: (every layer adds the same buffers; compiling 80 unrolled layers on a CPU takes many minutes).
EXTRAPOLATE_ABOVE = 4


def _report(model, cfg, freeze_backbone: bool, batch):
    trainer = Trainer.build(
        model, OptimConfig(freeze_backbone=freeze_backbone), cfg, Parallel.from_config(cfg.parallel, cfg.mesh)
    )
    return memory_report(trainer, batch)


def _extrapolated(base, folder, build: dict, layers: int, report_of):
    """``base`` (the full model's state bytes) with XLA's figures of 2 and 3 layers extended to ``layers``
    (not 1: the last layer of a one-token pooler runs at that token alone, so a 1-layer model is no
    layer of the deep one)."""
    two, three = (report_of(abstract_model(folder, config_changes={"num_hidden_layers": n}, **build)) for n in (2, 3))
    if two.xla_arguments is None:
        return base

    def at(name):
        a, b = getattr(two, name), getattr(three, name)
        return int(a + (layers - 2) * (b - a))

    return dataclasses.replace(base, **{n: at(n) for n in ("xla_arguments", "xla_outputs", "xla_temp", "xla_aliased")})


def plan_batch(model, batch_size: int, max_length: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of a training batch of ``model``'s task: ids, mask, labels and example weights."""
    rows = (batch_size, max_length)

    if model.problem_type in (MULTI_LABEL, REGRESSION):
        labels = jax.ShapeDtypeStruct(
            (batch_size, model.num_labels) if model.num_labels > 1 else (batch_size,), jnp.float32
        )
    else:
        labels = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
    batch = {
        "input_ids": jax.ShapeDtypeStruct(rows, jnp.int32),
        "attention_mask": jax.ShapeDtypeStruct(rows, jnp.int32),
        "labels": labels,
        "weights": jax.ShapeDtypeStruct((batch_size,), jnp.float32),
    }
    return batch


def _mesh_devices(mesh: str | Mapping[str, int] | None) -> int:
    """Devices a mesh shape names (its sizes multiplied; a ``-1`` axis counts as 1)."""
    if not mesh:
        return 1
    return math.prod(s for s in parse_mesh(mesh).values() if s > 0)


def plan_from_flags(
    *,
    model: str,
    mesh: str | None,
    batch_size: int,
    max_length: int,
    lora_rank: int | None,
    lora_alpha: float | None,
    lora_targets,
    base_dtype: str,
    precision: str | None,
    bf16: bool,
    remat: str,
    quantize: str | None,
    freeze_backbone: bool,
    json: bool,
    **_ignored,
) -> str:
    """``flaxheads plan``: the plan of the flags (the mesh's host devices forced first), as text or JSON."""
    import json as _json

    force_host_devices(_mesh_devices(mesh))
    plan = plan_memory(
        model,
        batch_size=batch_size,
        max_length=max_length,
        mesh=mesh,
        lora=lora_from_flags(lora_rank, lora_alpha, lora_targets),
        base_dtype=base_dtype,
        precision="bfloat16" if bf16 else precision or "float32",
        remat=remat,
        quantize=quantize,
        freeze_backbone=freeze_backbone,
    )
    return _json.dumps(plan.to_dict()) if json else "\n".join(plan.lines())


def force_host_devices(n: int) -> None:
    """Ask XLA:CPU for ``n`` host devices (before JAX's backend starts; a no-op once it has, or when
    ``XLA_FLAGS`` already asks for a count)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def plan_table(plans: Sequence[tuple[str, MemoryPlan]], devices: Sequence[str]) -> str:
    """A markdown table: one row per ``(label, plan)``, GiB per device and whether it fits each device."""
    head = "| run | layout | base | adapters | opt. state | activations | peak | " + " | ".join(devices) + " |"
    rule = "|" + " --- |" * (7 + len(devices))
    rows = []
    for label, p in plans:
        fit = p.fits({d: DEVICES[d] for d in devices})
        rows.append(
            f"| {label} | {p.layout} | {gib(p.base)} | {gib(p.adapters)} | {gib(p.opt_state)} | "
            f"{gib(p.activations)} | {gib(p.peak)} | " + " | ".join("fits" if fit[d] else "no" for d in devices) + " |"
        )
    return "\n".join([head, rule, *rows])
