"""The host's CPU (model name, instruction sets) and the installed jax version."""

from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuInfo:
    """The host CPU's model name and instruction-set flags (``/proc/cpuinfo``; empty elsewhere)."""

    model: str = ""
    flags: frozenset[str] = frozenset()

    @classmethod
    def read(cls, path: str = "/proc/cpuinfo") -> CpuInfo:
        """The first processor's entry (the other cores repeat it); an empty ``CpuInfo`` when unreadable."""
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                first = f.read().split("\n\n")[0]
        except OSError:
            return cls(platform.processor())
        fields: dict[str, str] = {}
        for line in first.splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        # x86 names them "model name" / "flags"; ARM "CPU part" / "Features"
        model = fields.get("model name") or fields.get("CPU part") or platform.processor()
        return cls(model, frozenset((fields.get("flags") or fields.get("Features") or "").split()))

    @property
    def amx(self) -> bool:
        """AMX bfloat16 tiles (Intel Xeon from Sapphire Rapids)."""
        return "amx_bf16" in self.flags

    @property
    def bf16(self) -> bool:
        """bfloat16 dot instructions: AVX512-BF16 or AMX (without them a bf16 dot is converted)."""
        return self.amx or "avx512_bf16" in self.flags

    @property
    def kind(self) -> str:
        """The widest matrix/vector extension, as the tables in docs/performance.md name CPUs."""
        for flag, name in (("amx_bf16", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON")):
            if flag in self.flags:
                return name
        return "unknown"


def cpu_fingerprint(cpu: CpuInfo | None = None) -> str:
    """A short hash of this host's CPU model and instruction-set flags."""
    cpu = cpu or CpuInfo.read()
    text = " ".join([platform.machine(), cpu.model, *sorted(cpu.flags)])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def installed_jax() -> str:
    import jax  # importing jax starts no backend: XLA_FLAGS can still be set after this

    return jax.__version__


def version_tuple(text: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` -> ``(0, 12)``: the major and minor parts that choices are keyed on."""
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def backend_started() -> bool:
    """Whether JAX has started a backend in this process (after that, XLA's flags and the heap
    settings no longer take effect)."""
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - jax not importable: nothing started
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if callable(started) else False
