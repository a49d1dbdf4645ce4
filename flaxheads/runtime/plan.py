"""The compute plan: every host-dependent choice a program's computations make, decided once.

A :class:`ComputePlan` is built once per program (:meth:`ComputePlan.for_host`: the backend, the
process's XLA flags, the jax version and the user's choices) and passed explicitly: a backbone
holds one (``Backbone.plan``) and hands it to the shared layers; train steps, feature caches and
predictors take their compiler options and constant-weight decision from it. The layers read the
plan's fields while tracing; nothing reads the environment or XLA's flags then, so a program is a
function of its arguments and its plan.

docs/performance.md has the measurements behind each default; the field docstrings say what each
choice was measured against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from flaxheads.errors import ConfigError
from flaxheads.runtime.cpu import CpuInfo, installed_jax, version_tuple
from flaxheads.runtime.precision import Precision, choose_precision
from flaxheads.runtime.xla_flags import OPT_OUT_ENV, YNN_PROGRAM_OPTIONS, XlaSetting

#: ``FLAXHEADS_ATTENTION``: ``auto`` (default), ``fused``, ``cpu``, ``plain`` or ``ynn``: read by
#: :meth:`ComputePlan.for_host` only.
ATTENTION_ENV = "FLAXHEADS_ATTENTION"
ATTENTION_IMPLS = ("auto", "fused", "cpu", "plain", "ynn")
DOTS = ("xla", "eigen", "onednn")
#: The most parameter bytes a program may hold as constants (:meth:`ComputePlan.constant_weights`):
#: the executable keeps its own (reordered) copy of them, one per compiled shape.
CONSTANT_WEIGHTS_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class ComputePlan:
    """How flaxheads' programs compute on one host. Frozen and hashable: part of what a traced
    program is a function of. Build it with :meth:`for_host`; the defaults are XLA's own choices
    on the CPU backend with nothing arranged for a dot library."""

    #: JAX's backend: ``"cpu"``, ``"gpu"``, ``"tpu"``
    backend: str = "cpu"
    #: whose dots XLA:CPU runs (:class:`~.xla_flags.XlaSetting`): ``"xla"`` (its default; always
    #: off the CPU), ``"eigen"``, ``"onednn"``
    dots: str = "xla"
    #: YNNPACK takes the process's reductions (XLA:CPU's default and the AVX2 flags)
    ynn_reductions: bool = True
    #: LayerNorm's mean and variance as products with a ``1/n`` column (``"products"``) instead of
    #: reductions, in programs without derivatives: where the dots are Eigen's or oneDNN's and the
    #: reductions YNNPACK's. There the reductions' YNNPACK fusions take the whole LayerNorm out of
    #: XLA's loop fusions, and Eigen's matrix-vector products were faster: the MiniLM forward at
    #: 32 x 256 took 1311 ms against 1551 ms with reductions and 1569 ms with YNNPACK off (AMD EPYC
    #: with AVX2, jax 0.12). Beside oneDNN's dots YNNPACK's reduction fusions otherwise take in the
    #: neighbouring dense products (Intel Xeon with AMX, bf16 forward at 32 x 256: 436 ms against
    #: 258 ms with the products). The derivative keeps the reductions (0.99-1.03x train steps).
    layer_norm: str = "reductions"
    #: the attention arrangement without attention dropout: ``"fused"`` (``jax.nn.dot_product_attention``,
    #: cuDNN on GPU), ``"cpu"`` (the CPU-tuned arrangement), ``"plain"`` (HF's), ``"ynn"`` (arranged
    #: for YNNPACK to fuse whole, with oneDNN's dots: Intel Xeon with AMX, bf16 32 x 256 1.00x
    #: PyTorch autocast against 0.89-0.95x, float32 0.95x against 0.90x)
    attention: str = "plain"
    #: batch chunks of attention: ``"auto"`` or a count (speed and memory only)
    attention_chunks: int | str = "auto"
    #: ``compiler_options`` of programs that take gradients: YNNPACK's dots and reductions where the
    #: process kept the dots for Eigen (AMD EPYC with AVX2, jax 0.12: every train step measured
    #: faster, 0.83-0.95x the step time, and compiled in 0.7-0.8x the time)
    gradient_options: tuple[tuple[str, str], ...] = ()
    #: the compute precision of programs built from this plan, and why
    precision: Precision = Precision("float32", "default")

    def __post_init__(self):
        if self.dots not in DOTS:
            raise ConfigError(f"compute plan: dots {self.dots!r} is not one of {DOTS}")
        if self.attention not in ATTENTION_IMPLS[1:]:
            raise ConfigError(
                f"attention implementation {self.attention!r} is not known: expected one of "
                f"{', '.join(ATTENTION_IMPLS)}"
            )
        if self.layer_norm not in ("reductions", "products"):
            raise ConfigError(f"compute plan: layer_norm {self.layer_norm!r} is not 'reductions' or 'products'")

    # ---- building ---------------------------------------------------------------------------------
    @classmethod
    def for_host(
        cls,
        *,
        attention: str | None = None,
        precision: str = "float32",
        attention_chunks: int | str = "auto",
        xla_flags: str | None = None,
        backend: str | None = None,
        cpu: CpuInfo | None = None,
        jax_version: str | None = None,
        gpu_capability: str | None = None,
    ) -> ComputePlan:
        """The plan for this process: ``backend`` (default JAX's), ``xla_flags`` (default
        ``$XLA_FLAGS``: XLA reads them once, so they are the process's), ``jax_version`` (default the
        installed one) and the user's choices: ``attention`` (one of :data:`ATTENTION_IMPLS`, default
        ``$FLAXHEADS_ATTENTION`` else ``auto``), ``precision`` (``auto``, ``float32``, ``bfloat16``)
        and ``attention_chunks``. ``FLAXHEADS_XLA_DEFAULTS=0`` leaves train steps' options empty."""
        if backend is None:
            import jax

            backend = jax.default_backend()
        want = (attention or os.environ.get(ATTENTION_ENV) or "auto").strip().lower()
        if want not in ATTENTION_IMPLS:
            raise ConfigError(
                f"attention implementation {want!r} (argument or ${ATTENTION_ENV}) is not known: "
                f"expected one of {', '.join(ATTENTION_IMPLS)}; unset ${ATTENTION_ENV} for the default"
            )
        on_cpu = backend == "cpu"
        xla = XlaSetting.parse(os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags)
        dots = xla.dots if on_cpu else "xla"
        gradient = {}
        if (
            on_cpu
            and dots == "eigen"
            and os.environ.get(OPT_OUT_ENV, "1") != "0"
            and version_tuple(jax_version or installed_jax()) >= (0, 11)
        ):  # measured on jax 0.12 only
            gradient = dict(YNN_PROGRAM_OPTIONS)
        plan = cls(
            backend=backend,
            dots=dots,
            ynn_reductions=xla.ynn_reductions,
            layer_norm="products" if on_cpu and dots != "xla" and xla.ynn_reductions else "reductions",
            attention_chunks=attention_chunks,
            gradient_options=tuple(sorted(gradient.items())),
            precision=choose_precision(
                precision, backend=backend, cpu=cpu, jax_version=jax_version, gpu_capability=gpu_capability
            ),
        )
        if want == "auto":
            want = (
                "fused"
                if backend == "gpu"
                else "ynn"
                if plan.onednn and plan.ynn_reductions
                else plan.unfused_attention
            )
        return plan.replace(attention=want)

    def replace(self, **changes: Any) -> ComputePlan:
        """This plan with some fields changed (e.g. ``plan.replace(attention="plain")``)."""
        return replace(self, **changes)

    # ---- what the pieces ask -----------------------------------------------------------------------
    @property
    def onednn(self) -> bool:
        """oneDNN runs the CPU's dots."""
        return self.backend == "cpu" and self.dots == "onednn"

    @property
    def float32_products(self) -> bool:
        """bf16 products ask for float32 outputs (``preferred_element_type``): yes, except with
        oneDNN's dots, which run bf16 x bf16 -> float32 products converted, ~10x slower than
        bf16 -> bf16 (Intel Xeon with AMX, jax 0.12, 4096 x 384 x 1536: 18.4 vs 1.6 ms)."""
        return not self.onednn

    @property
    def cpu_matmul(self) -> bool:
        """bf16 dense layers get the backward pass laid out for XLA:CPU's 16-bit dots."""
        return self.backend == "cpu"

    @property
    def activation_barrier(self) -> bool:
        """Activations' derivatives read their input behind an optimization barrier: with oneDNN's
        dots, whose rewriter fused an activation into the matmul before it and handed the fused
        output to the derivative too (jaxlib 0.12: gradients off by 25% of their scale)."""
        return self.onednn

    @property
    def attention_groups(self) -> bool:
        """float32 attention of a large batch runs in sequential groups: with oneDNN's dots only."""
        return self.onednn

    @property
    def layer_norm_products(self) -> bool:
        return self.backend == "cpu" and self.layer_norm == "products"

    @property
    def unfused_attention(self) -> str:
        """The arrangement for attention with dropout (the fused kernels have none): the CPU one
        where bf16 products take float32 outputs, HF's plain one elsewhere."""
        return "cpu" if self.backend == "cpu" and self.float32_products else "plain"

    def attention_for(self, dropout: bool, impl: str | None = None) -> str:
        """The arrangement of one attention: ``impl`` (a name of :data:`ATTENTION_IMPLS`, ``auto``
        meaning the plan's) or the plan's; with attention ``dropout`` the unfused one of the backend
        whatever was asked."""
        how = self.attention if impl in (None, "auto") else impl
        if how not in ATTENTION_IMPLS[1:]:
            raise ConfigError(
                f"attention implementation {how!r} is not known: expected one of {', '.join(ATTENTION_IMPLS)}"
            )
        if how in ("fused", "ynn") and dropout:
            return self.unfused_attention
        return how

    @property
    def gradient_ynn_reductions(self) -> bool:
        """YNNPACK takes the reductions of programs that take gradients: the process's setting, or the
        train steps' own options. Without it large reductions are folded first
        (``training.optim.sum_of_squares``: XLA's own reduction of MiniLM's gradient norm took 21 ms
        against 4.5 ms folded, AMD EPYC with AVX2)."""
        return self.ynn_reductions or bool(self.gradient_options)

    @property
    def fold_reductions(self) -> bool:
        """Train steps fold large reductions before reducing (see :attr:`gradient_ynn_reductions`)."""
        return self.backend == "cpu" and not self.gradient_ynn_reductions

    def compiler_options(self, gradients: bool) -> dict[str, str]:
        """``jax.jit(..., compiler_options=...)`` for a program, with or without derivatives."""
        return dict(self.gradient_options) if gradients else {}

    def constant_weights(self, nbytes: int, dtype: Any = "float32") -> bool:
        """Whether an inference program whose parameters stay the same over many calls (a feature
        cache's encoder, prediction) takes them as compile-time constants: with oneDNN's dots, for a
        float32 compute ``dtype`` and at most :data:`CONSTANT_WEIGHTS_MAX_BYTES` of them.

        XLA reorders constant weights into oneDNN's blocked layout once, at compile time, instead
        of oneDNN repacking them in every product (Intel Xeon with AMX, jax 0.12, MiniLM forward at
        every position, float32 32 x 256: 755 ms against 817, the same numbers to the bit). In
        bfloat16 the forward gained 3% but each program compiled ~0.4 s longer. Eigen's and
        YNNPACK's dots have no such step, so elsewhere the parameters stay arguments."""
        import jax.numpy as jnp

        return self.onednn and jnp.dtype(dtype) == jnp.float32 and nbytes <= CONSTANT_WEIGHTS_MAX_BYTES

    def describe(self) -> str:
        """One line for a run report."""
        parts = [f"backend {self.backend}", f"precision {self.precision.name}"]
        if self.backend == "cpu":
            parts += [
                f"dots {self.dots}",
                f"reductions {'YNNPACK' if self.ynn_reductions else 'XLA'}",
                f"LayerNorm {self.layer_norm}",
            ]
        parts.append(f"attention {self.attention}")
        if self.gradient_options:
            parts.append("train steps: YNNPACK's dots and reductions")
        return "compute plan: " + ", ".join(parts)
