"""What flaxheads knows about the machine a program runs on, and the one plan made from it.

* :mod:`.cpu`: the CPU's model and instruction sets (:class:`~.cpu.CpuInfo`), the jax version.
* :mod:`.xla_flags`: the XLA flags chosen per CPU, and what a flag string asks of XLA:CPU.
* :mod:`.malloc`: glibc heap settings that keep XLA's big buffers mapped between steps.
* :mod:`.precision`: float32 or bfloat16 for the hardware.
* :mod:`.compile_cache`: JAX's persistent compilation cache, per jax version and CPU.
* :mod:`.plan`: :class:`~.plan.ComputePlan`, every such choice a program's computations depend on,
  built once (:meth:`~.plan.ComputePlan.for_host`) and passed explicitly to backbones, steps and
  predictors. Nothing below the plan reads the environment or XLA's flags while tracing.

The process-level settings (flags, malloc, compile cache) are applied only by programs
(the ``flaxheads`` command, benchmarks, examples), never on import.
"""

from flaxheads.runtime.plan import ComputePlan

__all__ = ["ComputePlan"]
