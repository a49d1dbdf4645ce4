"""LoRA adapters for every backbone family, as a pure transformation of the backbone params.

A model with adapters keeps its params as ``{"backbone", "head", "lora"}``: ``backbone`` is
the frozen base, ``lora`` mirrors the paths of the adapted kernels with ``{"lora_A": [in, r],
"lora_B": [r, out]}`` per module. The forward runs the family's own code on
``W + (alpha / r) * A @ B`` for each adapted kernel (:func:`merge_lora`), so no family needs
LoRA-specific code, the frozen base is never written, and ``jax.grad`` over
``{"lora", "head"}`` trains the adapters and the head only.

That equals PEFT's ``x W + (alpha / r) * dropout(x) A B`` exactly for ``lora_dropout = 0``
(PEFT's default). Dropout on the adapter's input cannot be written as a change of weights, so
a positive dropout is refused rather than ignored.

Kernel layouts: the params trees store a kernel ``[in, out]``, except GPT-2's ``Conv1D``
kernels, which are ``[out, in]`` (see :mod:`flaxheads.backbones.families.gpt2`); the family's
:attr:`~flaxheads.backbones.base.Backbone.kernels_out_in` is the one place that says so
(:func:`kernels_out_in`), and PEFT's ``fan_in_fan_out`` follows from it. The default targets
are the family's :attr:`~flaxheads.backbones.base.Backbone.lora_targets`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

from flaxheads.backbones.registry import family_for
from flaxheads.errors import ConfigError
from flaxheads.layers.lora import LORA, LoraKernel
from flaxheads.layers.quantized import dequantize_tree

A, B = "lora_A", "lora_B"


def kernels_out_in(model_type: str) -> bool:
    """Whether a ``model_type`` params tree stores every 2-D ``kernel`` as ``[out, in]`` (its native
    family's :attr:`~flaxheads.backbones.base.Backbone.kernels_out_in`; PEFT's ``fan_in_fan_out``)."""
    fam = family_for(model_type)
    return fam is not None and fam.kernels_out_in


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Adapters of rank ``rank`` scaled by ``alpha / rank`` on the kernels ``targets`` names.

    A target is a module name (the last part of a kernel's path, e.g. ``query``, ``q_proj``,
    ``c_attn``) or a ``/``-separated glob over the whole module path (``encoder/layer/1*/*/query``).
    ``targets=None`` takes the backbone family's defaults (its ``lora_targets``) when the adapters
    are attached. ``dropout`` must be 0 (see the module docstring)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError(
                f"LoRA alpha must be a number > 0 (the adapter is scaled by alpha / rank), got {self.alpha!r}"
            )
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ConfigError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.dropout > 0:
            raise ConfigError(
                f"LoRA dropout {self.dropout} is not supported: flaxheads applies adapters as W + (alpha/r) A B on "
                "the weights, which is exact for every backbone family only without dropout on the adapter input. "
                "Use dropout 0 (PEFT's default); the backbone's own dropout still applies while training."
            )
        if self.targets is not None:
            targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
            if not targets or not all(isinstance(t, str) and t.strip() for t in targets):
                raise ConfigError(f"LoRA targets must be non-empty module names or path globs, got {self.targets!r}")
            object.__setattr__(self, "targets", tuple(t.strip() for t in targets))
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "targets": None if self.targets is None else list(self.targets),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoraConfig:
        t = d.get("targets")
        return cls(
            rank=int(d["rank"]),
            alpha=float(d["alpha"]),
            dropout=float(d.get("dropout", 0.0)),
            targets=None if t is None else tuple(t),
        )


# ---- which kernels ------------------------------------------------------------------------------


def kernel_modules(backbone_params) -> dict[tuple[str, ...], tuple[int, ...]]:
    """``{module path: kernel shape}`` of every 2-D ``kernel`` in a backbone params tree."""
    return {
        k[:-1]: tuple(v.shape)
        for k, v in flatten_dict(backbone_params).items()
        if k[-1] == "kernel" and len(getattr(v, "shape", ())) == 2
    }


def _matches(target: str, module: tuple[str, ...]) -> bool:
    if "/" in target or any(c in target for c in "*?["):
        return fnmatch.fnmatchcase("/".join(module), target)
    return module[-1] == target


def default_targets(model_type: str, backbone_params) -> tuple[str, ...]:
    """The default targets of ``model_type`` (its native family's
    :attr:`~flaxheads.backbones.base.Backbone.lora_targets`); :class:`ConfigError` for a type without defaults."""
    fam = family_for(model_type)
    if fam is None or not fam.lora_targets:
        raise ConfigError(
            f"no default LoRA targets for model_type {model_type!r}; name them (targets=..., "
            f"--lora-targets) from its kernels: {_kernel_names(backbone_params)}"
        )
    return fam.lora_targets


def resolve_targets(config: LoraConfig, backbone_params, model_type: str) -> list[tuple[str, ...]]:
    """The module paths ``config.targets`` (or the defaults) select, in tree order; every target
    must select at least one kernel, else a :class:`ConfigError` listing the kernel names there are."""
    modules = kernel_modules(backbone_params)
    targets = config.targets if config.targets is not None else default_targets(model_type, backbone_params)
    for t in targets:
        if not any(_matches(t, m) for m in modules):
            raise ConfigError(
                f"LoRA target {t!r} matches no kernel of this {model_type} backbone; its kernels are "
                f"named {_kernel_names(backbone_params)} (paths like "
                f"{'/'.join(next(iter(modules), ('?',)))!r}); give names from that list or "
                "/-separated globs over the paths"
            )
    return [m for m in modules if any(_matches(t, m) for t in targets)]


def _kernel_names(backbone_params) -> str:
    return ", ".join(sorted({m[-1] for m in kernel_modules(backbone_params)})) or "(none)"


def in_out(shape: Sequence[int], model_type: str) -> tuple[int, int]:
    """(fan in, fan out) of a kernel of ``shape`` in a ``model_type`` params tree."""
    return (shape[1], shape[0]) if kernels_out_in(model_type) else (shape[0], shape[1])


# ---- params --------------------------------------------------------------------------------------


def init_lora(config: LoraConfig, backbone_params, model_type: str, rng: jax.Array) -> dict:
    """Fresh adapters as PEFT initialises them: ``A`` uniform in ``±1/sqrt(in)`` (its Kaiming
    uniform with ``a=sqrt(5)``), ``B`` zeros, so the model starts equal to the base."""
    modules = kernel_modules(backbone_params)
    flat = {}
    for i, m in enumerate(resolve_targets(config, backbone_params, model_type)):
        fan_in, fan_out = in_out(modules[m], model_type)
        bound = 1.0 / math.sqrt(fan_in)
        flat[m + (A,)] = jax.random.uniform(
            jax.random.fold_in(rng, i), (fan_in, config.rank), jnp.float32, -bound, bound
        )
        flat[m + (B,)] = jnp.zeros((config.rank, fan_out), jnp.float32)
    return unflatten_dict(flat)


def adapter_modules(lora_params) -> dict[tuple[str, ...], dict]:
    """``{module path: {"lora_A": ..., "lora_B": ...}}`` of an adapters tree."""
    out: dict[tuple[str, ...], dict] = {}
    for k, v in flatten_dict(lora_params).items():
        out.setdefault(k[:-1], {})[k[-1]] = v
    return out


def delta(a: jax.Array, b: jax.Array, scaling: float, out_in: bool) -> jax.Array:
    """``scaling * A @ B`` in the kernel's layout (transposed for ``[out, in]`` kernels)."""
    d = scaling * jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
    return d.T if out_in else d


def merge_lora(backbone_params, lora_params, config: LoraConfig, model_type: str) -> dict:
    """The backbone params with ``W + (alpha/r) A @ B`` in place of each adapted kernel (pure;
    differentiable in both trees; the input trees are not modified)."""
    flat = flatten_dict(backbone_params)
    out_in = kernels_out_in(model_type)
    for m, ab in adapter_modules(lora_params).items():
        w = flat[m + ("kernel",)]
        if hasattr(w, "qvalue"):  # a quantised kernel keeps its codes: the adapter runs beside it (QLoRA)
            flat[m + ("kernel",)] = LoraKernel(w, ab[A], ab[B], config.scaling)
            continue
        d = delta(ab[A], ab[B], config.scaling, out_in)
        # a 16-bit base is merged in float32: its rounding would swallow a small delta (float32: unchanged)
        dt = jnp.promote_types(w.dtype, d.dtype)
        flat[m + ("kernel",)] = w.astype(dt) + d.astype(dt)
    return unflatten_dict(flat)


def check_adapters(config: LoraConfig, lora_params, backbone_params, model_type: str, where: str) -> None:
    """``lora_params`` are adapters of ``config`` for this backbone: the modules its targets select,
    with ``A [in, rank]`` and ``B [rank, out]`` for each kernel; else a :class:`ConfigError`."""
    kernels = kernel_modules(backbone_params)
    want = resolve_targets(config, backbone_params, model_type)
    have = adapter_modules(lora_params)
    problems = [f"no adapter for {'/'.join(m)}" for m in want if m not in have]
    problems += [f"{'/'.join(m)} is not a selected kernel of this backbone" for m in have if m not in want]
    for m in (m for m in want if m in have):
        fi, fo = in_out(kernels[m], model_type)
        got = (tuple(have[m][A].shape), tuple(have[m][B].shape))
        if got != ((fi, config.rank), (config.rank, fo)):
            problems.append(
                f"{'/'.join(m)}: A {got[0]}, B {got[1]} but the kernel needs A {(fi, config.rank)}, "
                f"B {(config.rank, fo)}"
            )
    if problems:
        raise ConfigError(
            f"{where}: the adapters do not fit this {model_type} backbone: {'; '.join(problems[:6])}"
            f"{' ...' if len(problems) > 6 else ''}. Load them on the backbone they were trained on."
        )


# ---- models ----------------------------------------------------------------------------------------


def with_lora(model, config: LoraConfig | None = None, *, seed: int = 0, params: Mapping | None = None, **options):
    """``model`` with fresh adapters: ``model.lora`` set, ``params["lora"]`` initialised (B = 0,
    so the logits are the base model's). ``config`` or ``options`` (``rank``, ``alpha``,
    ``targets``, ...) choose the adapters; ``targets=None`` resolves to the family's defaults."""
    if config is None:
        config = LoraConfig(**options)
    elif options:
        config = dataclasses.replace(config, **options)
    if getattr(model, "lora", None) is not None:
        raise ConfigError(
            "this model already has LoRA adapters; merge them first (merge_model) or start from the base model"
        )
    base = dict(model.params if params is None else params)
    if config.targets is None:
        config = dataclasses.replace(config, targets=default_targets(model.model_type, base["backbone"]))
    lora = init_lora(config, base["backbone"], model.model_type, jax.random.PRNGKey(seed))
    return dataclasses.replace(model, lora=config, params={**base, LORA: lora})


def merged_params(model, params: Mapping | None = None) -> dict:
    """``{"backbone": merged, "head": ...}``: the adapters folded into the backbone kernels."""
    params = model.params if params is None else params
    return {"backbone": dequantize_tree(model.backbone_params(params)), "head": params["head"]}


def merge_model(model, params: Mapping | None = None):
    """A plain model (no adapters) whose backbone kernels hold ``W + (alpha/r) A @ B``: same logits,
    exportable as a full transformers / sentence-transformers model."""
    if getattr(model, "lora", None) is None:
        return model
    return dataclasses.replace(model, lora=None, params=merged_params(model, params))


def adapters_meta(model) -> dict | None:
    """What a checkpoint's meta records of ``model``'s adapters: the config and, per adapted
    module, its kernel's ``[in, out]`` (None for a model without adapters)."""
    if getattr(model, "lora", None) is None:
        return None
    kernels = kernel_modules(model.params["backbone"])
    return {
        **model.lora.to_dict(),
        "modules": {
            "/".join(m): list(in_out(kernels[m], model.model_type)) for m in adapter_modules(model.params[LORA])
        },
    }


def adapters_diff(saved: Mapping | None, have: Mapping | None) -> list[str]:
    """How two :func:`adapters_meta` records differ (empty when the adapters are interchangeable)."""
    if saved is None or have is None:
        return (
            []
            if saved is have
            else [
                f"adapters: checkpoint {'none' if saved is None else 'LoRA'} vs target "
                f"{'none' if have is None else 'LoRA'}"
            ]
        )
    out = [
        f"{k}: checkpoint {saved.get(k)!r} vs target {have.get(k)!r}"
        for k in ("rank", "alpha", "targets")
        if saved.get(k) != have.get(k)
    ]
    sm, hm = saved.get("modules", {}), have.get("modules", {})
    out += [
        f"{m}: checkpoint {sm.get(m)} vs target {hm.get(m)}"
        for m in sorted(set(sm) | set(hm))
        if sm.get(m) != hm.get(m)
    ]
    return out
