"""float32 or bfloat16 for the hardware a program runs on.

``bfloat16`` where the hardware multiplies it natively and JAX reaches it (TPU; NVIDIA GPUs from
sm_80; CPUs with AMX or AVX512-BF16 under jax >= 0.11), ``float32`` elsewhere. Without bf16 matrix
instructions a bf16 dot is converted and runs slower than fp32 (AMD EPYC with AVX2, jax 0.12: ~0.8x
the fp32 GEMM), so bfloat16 there would cost speed and precision. With AVX512-BF16 (AMD EPYC,
jax 0.12) the bf16 GEMM ran 1.9x the fp32 one, the MiniLM train step 1.23x and the forward 1.5x, at
equal test accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass

from flaxheads.errors import ConfigError
from flaxheads.runtime.cpu import CpuInfo, installed_jax, version_tuple

#: ``--precision`` values: ``auto`` asks :func:`choose_precision`.
PRECISIONS: tuple[str, ...] = ("auto", "float32", "bfloat16")
#: The default of ``flaxheads train --precision`` (``auto`` when unset).
PRECISION_ENV = "FLAXHEADS_PRECISION"


@dataclass(frozen=True)
class Precision:
    """A resolved ``--precision``: ``float32`` or ``bfloat16``, and why it was chosen."""

    name: str
    reason: str

    @property
    def dtype(self):
        import jax.numpy as jnp

        return jnp.bfloat16 if self.name == "bfloat16" else jnp.float32


def choose_precision(
    want: str = "auto",
    *,
    backend: str | None = None,
    cpu: CpuInfo | None = None,
    jax_version: str | None = None,
    gpu_capability: str | None = None,
) -> Precision:
    """Resolve ``want`` (one of :data:`PRECISIONS`) for this host. ``float32``/``bfloat16`` are kept
    as asked; ``auto`` picks bfloat16 only where the hardware multiplies it natively and JAX reaches
    that (module docstring). The keywords default to this process's backend, CPU and jax."""
    if want not in PRECISIONS:
        raise ConfigError(f"precision {want!r} is not known: expected one of {', '.join(PRECISIONS)}")
    if want != "auto":
        return Precision(want, "asked for")
    import jax

    backend = backend or jax.default_backend()
    if backend == "tpu":
        return Precision("bfloat16", "auto: TPU matrix units multiply bfloat16")
    if backend == "gpu":
        cap = gpu_capability if gpu_capability is not None else str(getattr(jax.devices()[0], "compute_capability", ""))
        if version_tuple(cap) >= (8, 0):
            return Precision("bfloat16", f"auto: GPU compute capability {cap} has bfloat16 tensor cores")
        return Precision("float32", f"auto: GPU compute capability {cap or 'unknown'} has no bfloat16 tensor cores")
    if backend != "cpu":
        return Precision("float32", f"auto: float32 on the {backend} backend")
    cpu = cpu or CpuInfo.read()
    jax_version = jax_version or installed_jax()
    units = "AMX bfloat16 tiles" if cpu.amx else "AVX512-BF16 instructions"
    if cpu.bf16 and version_tuple(jax_version) >= (0, 11):
        return Precision("bfloat16", f"auto: {cpu.model or 'this CPU'} has {units}")
    if cpu.bf16:
        return Precision("float32", f"auto: jax {jax_version} does not use this CPU's {units} (jax >= 0.11 does)")
    return Precision(
        "float32",
        f"auto: {cpu.model or 'this CPU'} has no bfloat16 matrix instructions (bfloat16 matmuls would run converted)",
    )
