"""The XLA flags flaxheads' programs choose for the host CPU, and what a flag string asks of XLA:CPU.

What is chosen (:func:`cpu_xla_flags`; docs/performance.md has the A/B numbers and the CPU of each):

* x86 with AVX2 and no AVX-512 (jax >= 0.11): :data:`CPU_FLAGS` keeps XLA:CPU's YNNPACK fusions
  (jaxlib routes dots *and* reductions through them) for reductions only: dots go to Eigen, which
  won the dense products of the forward on a 2-core AMD EPYC (AVX2), and the softmax's reductions to
  YNNPACK; LayerNorm's statistics are then products too (:class:`~.plan.ComputePlan` ``layer_norm``).
  The MiniLM forward at 32 x 256 took 0.84x the time of YNNPACK off (1311 against 1569 ms), and no
  shape measured lost. Under jax < 0.11 YNNPACK is turned off (:data:`EIGEN_FLAGS`, ~12% there).
  Train steps compile with YNNPACK's dots back on (:data:`YNN_PROGRAM_OPTIONS`, one program's
  option): measured per program, every train step took less time with them (0.95x at 16 x 128
  tokens, 0.83x on packed short texts) and compiled in 0.7-0.8x the time.
* With AMX (jax >= 0.11) the dots go to oneDNN's matmul custom call and YNNPACK keeps the
  reductions (:data:`ONEDNN_FLAGS`): on a 2-core Intel Xeon with AMX oneDNN ran MiniLM's bf16 dense
  products ~2x faster than YNNPACK (4096 x 384 x 1536: 1.6 vs 3.2 ms), and the MiniLM bf16 train
  step went 1.23x -> 1.93x PyTorch autocast, the fp32 one 1.34x -> 1.41x. oneDNN wants bf16 products
  with bf16 outputs. YNNPACK's reductions let forward programs hand it each attention whole (the
  ``"ynn"`` attention, with LayerNorm's statistics as products): the bf16 forward at 32 x 128 went
  1.18x -> 1.47x PyTorch autocast, the fp32 one 1.09x -> 1.17x; train steps ran as before (fp32
  1.45x, bf16 2.02x) and frozen-backbone ones faster.
* With AVX-512 and no AMX XLA's defaults are kept: on a 2-core AMD EPYC with AVX-512 and
  AVX512-BF16 they gave the fp32 train step 1.14x and forward 1.11x, and the bfloat16 GEMM 2.2x
  (YNNPACK's bf16 dots; Eigen converts). Where nothing was measured (ARM, other ISAs) the
  defaults are kept too.

XLA reads its flags once, when the backend starts: :func:`configure_xla` must run before the first
JAX computation, and :class:`XlaSetting` tells what the process's flags asked for.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from flaxheads.errors import ConfigError
from flaxheads.runtime.cpu import CpuInfo, backend_started, installed_jax, version_tuple

#: XLA:CPU's YNNPACK fusions for reductions only: dots go to Eigen, reductions (softmax, LayerNorm's
#: statistics where they stay reductions) to YNNPACK. x86 with AVX2 and no AVX-512 under jax >= 0.11.
CPU_FLAGS: tuple[str, ...] = ("--xla_cpu_experimental_ynn_fusion_type=reduce",)
#: XLA:CPU's YNNPACK fusions off: dots to Eigen, reductions in XLA's own loops. The same CPUs under
#: jax < 0.11, where this was measured.
EIGEN_FLAGS: tuple[str, ...] = ("--xla_cpu_experimental_ynn_fusion_type=",)
_ONEDNN: tuple[str, ...] = ("--xla_cpu_use_onednn=true", "--xla_cpu_experimental_onednn_custom_call=true")
#: XLA:CPU's dots through oneDNN's matmul custom call, with YNNPACK's fusions for reductions only (with
#: dots among their types they take the dots first): forward programs then get attention fused whole
#: by YNNPACK. Chosen on CPUs with AMX under jax >= 0.11.
ONEDNN_FLAGS: tuple[str, ...] = CPU_FLAGS + _ONEDNN
#: oneDNN's dots with YNNPACK off (oneDNN's softmax, XLA's reductions): the AMX choice before
#: YNNPACK's fused attention.
ONEDNN_ALONE_FLAGS: tuple[str, ...] = EIGEN_FLAGS + _ONEDNN

#: XLA:CPU's YNNPACK fusions as jax 0.12 has them by default (dots and reductions), as one program's
#: compiler option: what train steps get back where :data:`CPU_FLAGS` kept the dots from them for
#: the process (:attr:`~.plan.ComputePlan.gradient_options`).
YNN_PROGRAM_OPTIONS: dict[str, str] = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"
}

#: Set to ``0`` to make :func:`configure_xla` a no-op and train steps' own options empty
#: (e.g. to compare against XLA's defaults).
OPT_OUT_ENV = "FLAXHEADS_XLA_DEFAULTS"


def cpu_xla_flags(cpu: CpuInfo, jax_version: str | None = None) -> tuple[str, ...]:
    """The XLA flags :func:`configure_xla` adds on this CPU (module docstring): oneDNN's dots with
    AMX under jax >= 0.11 (``jax_version``, default the installed one); on x86 with AVX2 and no
    AVX-512 Eigen's dots, with YNNPACK's reductions under jax >= 0.11 (:data:`CPU_FLAGS`) and without
    YNNPACK under older jax (:data:`EIGEN_FLAGS`); XLA's defaults elsewhere."""
    new_jax = version_tuple(jax_version or installed_jax()) >= (0, 11)
    if cpu.amx and new_jax:
        return ONEDNN_FLAGS
    if "avx2" in cpu.flags and "avx512f" not in cpu.flags:
        return CPU_FLAGS if new_jax else EIGEN_FLAGS
    return ()


def split_flags(xla_flags: str) -> list[str]:
    try:
        return shlex.split(xla_flags)
    except ValueError as e:
        raise ConfigError(
            f"XLA_FLAGS={xla_flags!r} cannot be split into flags ({e}): expected space-separated "
            "--name=value flags; fix its quoting"
        ) from None


@dataclass(frozen=True)
class XlaSetting:
    """What an ``XLA_FLAGS`` string asks of XLA:CPU's dot and reduction libraries (the last setting of
    a flag wins)."""

    #: the fusion types ``--xla_cpu_experimental_ynn_fusion_type`` lists; ``None`` where it is not set
    #: (XLA's default: dots and reductions)
    ynn_types: frozenset[str] | None = None
    #: oneDNN and its matmul custom call both on
    onednn: bool = False

    @classmethod
    def parse(cls, xla_flags: str) -> XlaSetting:
        values = {}
        for flag in split_flags(xla_flags):
            name, _, value = flag.partition("=")
            values[name] = value.strip().lower()
        on = ("true", "1")
        ynn = values.get("--xla_cpu_experimental_ynn_fusion_type")
        return cls(
            None if ynn is None else frozenset(t for t in ynn.split(",") if t),
            values.get("--xla_cpu_use_onednn") in on and values.get("--xla_cpu_experimental_onednn_custom_call") in on,
        )

    @classmethod
    def of_process(cls) -> XlaSetting:
        """This process's ``$XLA_FLAGS``."""
        return cls.parse(os.environ.get("XLA_FLAGS", ""))

    @property
    def _no_ynn_dots(self) -> bool:
        return self.ynn_types is not None and not any("dot" in t for t in self.ynn_types)

    @property
    def onednn_dots(self) -> bool:
        """oneDNN takes the dots: oneDNN and its matmul call on, and YNNPACK's fusions (which take
        the dots first) set to no dot type."""
        return self.onednn and self._no_ynn_dots

    @property
    def ynn_reductions(self) -> bool:
        """YNNPACK's fusions take the reductions: at XLA's default and with :data:`CPU_FLAGS`; not
        where the fusion types list no ``reduce`` (:data:`EIGEN_FLAGS`, :data:`ONEDNN_ALONE_FLAGS`)."""
        return self.ynn_types is None or "reduce" in self.ynn_types

    @property
    def dots(self) -> str:
        """Whose dots: ``"onednn"``, ``"eigen"`` (YNNPACK's fusion types set without a dot type and
        oneDNN off) or ``"xla"`` (XLA's default: YNNPACK's in jax >= 0.11)."""
        if self.onednn_dots:
            return "onednn"
        return "eigen" if self._no_ynn_dots else "xla"


def configure_xla(flags: tuple[str, ...] | None = None, *, cpu: CpuInfo | None = None) -> list[str]:
    """Append ``flags`` (default: :func:`cpu_xla_flags` for ``cpu``, this host's CPU) to
    ``XLA_FLAGS`` for this process; returns the flags it added.

    A flag whose name the user already set in ``XLA_FLAGS`` is left as the user set it.
    Does nothing (returns ``[]``) when ``FLAXHEADS_XLA_DEFAULTS=0`` or when JAX has already
    started a backend in this process (flags are read once, at backend start)."""
    if os.environ.get(OPT_OUT_ENV, "1") == "0" or backend_started():
        return []
    if flags is None:
        flags = cpu_xla_flags(cpu or CpuInfo.read())
    current = split_flags(os.environ.get("XLA_FLAGS", ""))
    names = {f.split("=", 1)[0] for f in current}
    added = [f for f in flags if f.split("=", 1)[0] not in names]
    if added:
        os.environ["XLA_FLAGS"] = " ".join(current + added)
    return added
